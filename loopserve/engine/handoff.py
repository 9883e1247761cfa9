"""How an engine packs a request into a handoff (`protocol/handoff.py`) and unpacks it again:
only the engine knows a request's state."""

from __future__ import annotations

from loopserve.engine.request import Request
from loopserve.kv_cache import BlockTable
from loopserve.protocol.handoff import HandoffMessage


def pack(req: Request, table: BlockTable, compat: dict) -> HandoffMessage:
    """Prefill side: a request whose prompt is done (its first token sampled) as a handoff."""
    return HandoffMessage(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(req.output_token_ids),
        exit_depths=[req.exit_depth.get(p, 0) for p in range(req.num_tokens - 1)],
        params=req.params,
        seed=req.seed,
        block_table=table.to_dict(),
        num_kv_tokens=req.prompt_len,
        arrival_time=req.arrival_time,
        first_token_time=req.first_token_time,
        compat=compat,
    )


def unpack(h: HandoffMessage, detok: object, eos_token_id: int | None) -> Request:
    """Decode side: the request as the prefill side left it, its first output already sent."""
    req = Request(h.request_id, list(h.prompt_token_ids), h.params, h.seed, detok,
                  eos_token_id=eos_token_id, arrival_time=h.arrival_time)
    req.resume(h.output_token_ids, dict(enumerate(h.exit_depths)), h.first_token_time)
    return req
