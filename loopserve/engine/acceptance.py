"""CodaAcceptance: what a CODA's logits become for each item of the batch.

A draft round's greedy token is kept as a draft; a verify round keeps the longest prefix of
drafts the full-depth model agrees with; ordinary next tokens are drawn in one call for the
whole batch (at most one device sync, not one per request) and, with defer_readback, not
read here: they stay on the device for the next PRELUDE and come back as an `UnreadBatch`.
"""

from __future__ import annotations

import torch

from loopserve.engine.model_runner import ModelRunner
from loopserve.engine.readback import UNREAD, UnreadBatch
from loopserve.engine.request import Request
from loopserve.engine.sampler import draw_tokens
from loopserve.protocol.stats import EngineCounters
from loopserve.scheduler import BatchItem, ItemResult


class CodaAcceptance:
    def __init__(self, runner: ModelRunner, counters: EngineCounters, defer_readback: bool) -> None:
        self.runner = runner
        self.counters = counters
        self.defer_readback = defer_readback

    def results(self, items: list[BatchItem], reqs: dict[str, Request],
                logits: dict[str, torch.Tensor | None]) -> tuple[dict[str, ItemResult], UnreadBatch | None]:
        """Every item's CODA result, and the samples left on the device (None: all read)."""
        out: dict[str, ItemResult] = {}
        plain: list[BatchItem] = []
        for item in items:
            req, lg = reqs[item.request_id], logits[item.request_id]
            if req.finished or lg is None:  # aborted in flight, or a coda that only writes KV
                out[item.request_id] = ItemResult(finished=req.finished)
            elif item.draft:
                tok = int(torch.argmax(lg[0]).item())
                req.draft_token_ids.append(tok)
                self.counters.spec_drafted += 1
                out[item.request_id] = ItemResult(sampled=(tok,))
            elif item.verify:
                out[item.request_id] = self._accept(item, req, lg)
            else:
                plain.append(item)
        unread = None
        if plain:
            mine = [reqs[i.request_id] for i in plain]
            drawn = draw_tokens(torch.stack([logits[i.request_id][0] for i in plain]), [r.params for r in mine],
                                [r.seed for r in mine], [len(r.output_token_ids) for r in mine])
            if self.defer_readback:
                rids = [i.request_id for i in plain]
                produced = [i.logits_positions[0] for i in plain]
                self.runner.keep_tokens(rids, [p + 1 for p in produced], drawn.token_ids)
                unread = UnreadBatch(drawn, {rid: (k, p) for k, (rid, p) in enumerate(zip(rids, produced))})
                for rid in rids:  # the scheduler sees max_tokens itself; stop tokens come later
                    out[rid] = ItemResult(sampled=(UNREAD,))
            else:
                for item, req, s in zip(plain, mine, drawn.samples()):
                    req.append(s, item.logits_positions[0])
                    self.counters.tokens_generated += 1
                    out[item.request_id] = ItemResult(sampled=(s.token_id,), finished=req.finished)
        return {i.request_id: out[i.request_id] for i in items}, unread

    def _accept(self, item: BatchItem, req: Request, logits: torch.Tensor) -> ItemResult:
        """Greedy verify: keep the longest prefix of drafts the full-depth model agrees with.

        Each row is drawn as a plain decode step draws its token, so an emitted token carries
        the same logprobs as it would without speculation."""
        n, start = len(logits), len(req.output_token_ids)
        samples = draw_tokens(logits, [req.params] * n, [req.seed] * n, list(range(start, start + n))).samples()
        drafts, req.draft_token_ids = req.draft_token_ids, []
        emitted: list[int] = []
        for j, s in enumerate(samples):
            req.append(s, item.logits_positions[j])
            emitted.append(s.token_id)
            self.counters.tokens_generated += 1
            if req.finished or j + 1 >= n or drafts[j] != s.token_id:
                break
            self.counters.spec_accepted += 1
        return ItemResult(sampled=tuple(emitted), finished=req.finished)
