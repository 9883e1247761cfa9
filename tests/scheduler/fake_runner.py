"""A torch-free fake engine for scheduler tests: random exits, finishes, delayed retires."""

from __future__ import annotations

import random

from loopserve.scheduler import BatchResult, ItemResult, Operation, Scheduler, ScheduledBatch


class FakeRunner:
    def __init__(self, sched: Scheduler, seed: int = 0, finish_p: float = 0.05) -> None:
        self.sched, self.rng, self.finish_p = sched, random.Random(seed), finish_p
        self.inflight: list[ScheduledBatch] = []
        self.batches: list[ScheduledBatch] = []

    def result(self, batch: ScheduledBatch) -> BatchResult:
        items = {}
        for it in batch.items:
            req = self.sched.get_request(it.request_id)
            if batch.operation is Operation.RECURRENT:
                lo = req.min_loops if req else 1
                ex = tuple(p for p in it.positions if it.depth >= lo and self.rng.random() < 0.4)
                items[it.request_id] = ItemResult(exited=ex)
            elif batch.operation is Operation.CODA and it.logits_positions:
                n = self.rng.randint(1, len(it.logits_positions)) if it.verify else 1
                items[it.request_id] = ItemResult(sampled=(7,) * n, finished=self.rng.random() < self.finish_p)
            else:
                items[it.request_id] = ItemResult()
        return BatchResult(items)

    def step(self, max_inflight: int = 1) -> list:
        """Schedule one batch; retire the oldest once more than `max_inflight` are out."""
        out = self.sched.schedule()
        events = []
        if out.batch is not None:
            self.inflight.append(out.batch)
            self.batches.append(out.batch)
        while self.inflight and (len(self.inflight) > max_inflight - 1 or out.batch is None):
            b = self.inflight.pop(0)
            events.append(self.sched.update(b, self.result(b)))
            if out.batch is None:
                break
        return events

    def drain(self, max_steps: int = 20000, max_inflight: int = 1) -> int:
        steps = 0
        while self.sched.has_unfinished() or self.inflight:
            self.step(max_inflight)
            self.sched.assert_invariants()
            steps += 1
            assert steps < max_steps, f"no progress: {self.sched.stats()}"
        return steps
