"""Intake: how a caller's prompt and parameters become an engine Request and its scheduler view.

Every check a request passes before it is queued lives here, each ValueError naming the bad
field and its limit; capacity (KVCapacityError) and queue bounds (QueueFullError) are the
scheduler's, checked when the engine queues the SchedRequest.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Container

import torch

from loopserve.engine import handoff
from loopserve.engine.config import EngineConfig
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.model_limits import ModelLimits
from loopserve.protocol.prefix_keys import PrefixKeyer
from loopserve.engine.request import Request
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.model.tokenizer import ByteTokenizer, HFTokenizer
from loopserve.scheduler import SchedRequest


class Intake:
    def __init__(self, config: EngineConfig, limits: ModelLimits, model: torch.nn.Module,
                 tokenizer: ByteTokenizer | HFTokenizer, prefix_keyer: PrefixKeyer | None) -> None:
        self.limits = limits
        self.model = model
        self.tokenizer = tokenizer
        self.prefix_keyer = prefix_keyer
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)  # seeds of requests that give none

    def request(self, prompt: str | list[int], params: SamplingParams | None, request_id: str | None,
                arrival_time: float | None, in_use: Container[str]) -> tuple[Request, SchedRequest]:
        """A validated Request, its loop parameters resolved and its seed drawn, and what the
        scheduler sees of it."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise ValueError("request_id must be a non-empty string")
        if rid in in_use:
            raise ValueError(f"request_id {rid!r} is already in use")
        # A routed request comes as token ids with its loops resolved: the router checked it
        # against these same limits (a text prompt here is a direct caller's: LLM, tests).
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = self.limits.check(ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid, ids, params, seed, self.tokenizer.detokenizer(),
                      eos_token_id=self.tokenizer.eos_token_id)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        return req, self._sched_request(req)

    def handoff(self, h: HandoffMessage, in_use: Container[str]) -> tuple[Request, SchedRequest]:
        """Decode role: the request a prefill engine handed over, as it left it, and what the
        scheduler sees of it."""
        if h.request_id in in_use:
            raise ValueError(f"request_id {h.request_id!r} is already in use")
        req = handoff.unpack(h, self.tokenizer.detokenizer(), self.tokenizer.eos_token_id)
        return req, self._sched_request(req)

    def _sched_request(self, req: Request) -> SchedRequest:
        """What the scheduler sees of a request (with its prefix-cache keys)."""
        p = req.params
        return SchedRequest(
            request_id=req.request_id, prompt_len=req.prompt_len, max_tokens=p.max_tokens,
            min_loops=p.min_loops, max_loops=p.max_loops, priority=p.priority,
            arrival_time=req.arrival_time, greedy=p.greedy, num_planes=self.model.kv_planes(p.max_loops),
            block_hashes=self._block_hashes(req),
        )

    def _block_hashes(self, req: Request) -> tuple[bytes, ...] | None:
        """Prefix-cache keys of the prompt's full blocks; None when caching is off for it."""
        if self.prefix_keyer is None:
            return None
        return self.prefix_keyer.keys(req.prompt_token_ids, req.params, req.seed)
