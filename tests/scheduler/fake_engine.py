"""A torch-free engine for scheduler tests that checks what it is asked to run.

It executes batches on a simulated paged KV store whose slots hold (request, position)
markers instead of tensors: rows write their marker where the block table says, exited rows
are copied into deeper planes (last-exited rule), fresh blocks are zeroed, swaps move
markers to and from a host dict. Every item then checks that its whole context is present
on the plane it reads, so a block freed while in use, a missed swap or a wrong table shows up
as a missing marker. It also tracks each row's loop depth and each request's tokens, so an
item that skips a loop, loops an exited row, runs a coda early or reads a token that does
not exist fails. Exits are random within [min_loops, max_loops], finishes are random, and
retiring can lag scheduling (async). With prefix caching a full prompt block's marker names
its content (its prefix-cache key) instead of its request, so a request finds the markers of
a prefix another request computed, and no request may write into a block another one holds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from loopserve.intmath import cdiv
from loopserve.kv_cache import BlockTable
from loopserve.scheduler import (
    BatchItem,
    BatchResult,
    ItemResult,
    Operation,
    RequestStatus,
    ScheduledBatch,
    Scheduler,
    WorkKey,
)
from loopserve.scheduler.invariants import check_invariants

Marker = tuple[str, int]
# Draws a row's final exit depth in [min_loops, max_loops]: (rng, min_loops, max_loops) -> depth.
ExitDepth = Callable[[random.Random, int, int], int]


def uniform_exit(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


@dataclass
class Track:
    """The engine's view of one request."""

    prompt_len: int
    max_tokens: int
    min_loops: int
    max_loops: int
    n_out: int = 0  # output tokens produced
    drafts: int = 0  # draft tokens of the current speculation round
    cursor: int = 0  # next position a PRELUDE may start at
    depth: dict[int, int] = field(default_factory=dict)  # position -> last loop run
    exit_at: dict[int, int] = field(default_factory=dict)  # position -> depth of its final exit
    exited: set[int] = field(default_factory=set)


class FakeEngine:
    def __init__(self, sched: Scheduler, seed: int = 0, finish_p: float = 0.05,
                 max_lag: int = 1, exit_depth: ExitDepth = uniform_exit,
                 check_context: bool = True) -> None:
        """`check_context=False` skips re-reading every item's whole context (O(context) per
        item): for benchmarks at thousands of positions per request; tests keep it on."""
        self.sched, self.kv = sched, sched.kv
        self.rng = random.Random(seed)
        self.finish_p, self.max_lag = finish_p, max_lag
        self.exit_depth, self.check_context = exit_depth, check_context
        self.bs = self.kv.layout.block_size
        self.looped: dict[int, list[Marker | None]] = {}
        self.flat: dict[int, list[Marker | None]] = {}
        self.host: dict[str, tuple[list, list]] = {}
        self.tracks: dict[str, Track] = {}
        self.keys: dict[str, tuple[bytes, ...]] = {}  # prefix-cache keys of a request's prompt blocks
        self.pipeline: list[tuple[ScheduledBatch, BatchResult]] = []
        self.batches: list[ScheduledBatch] = []
        self.finished: dict[str, int] = {}  # request -> output tokens at finish
        self.aborted: set[str] = set()
        self.transferring: list[str] = []
        self.preempted: list[str] = []
        self.swaps: list[tuple[str, str]] = []  # ("out" | "in", request id), in order
        self.spec = sched.config.speculative

    # ------------------------------------------------------------------ requests
    def track(self, rid: str, prompt_len: int, max_tokens: int, min_loops: int, max_loops: int,
              n_out: int = 0) -> Track:
        t = Track(prompt_len, max_tokens, min_loops, max_loops, n_out=n_out,
                  cursor=prompt_len + n_out - 1 if n_out else 0)
        self.tracks[rid] = t
        return t

    def abort(self, rid: str) -> bool:
        if self.sched.abort(rid):
            self.aborted.add(rid)
            return True
        return False

    # ------------------------------------------------------------------ KV simulation
    def _slot(self, pool: dict, block: int) -> list:
        return pool.setdefault(block, [None] * self.bs)

    def marker(self, rid: str, pos: int) -> Marker:
        """What position `pos` of `rid` holds: its content (a cached prompt block's key) or its request."""
        keys, b = self.keys.get(rid, ()), pos // self.bs
        return (keys[b] if b < len(keys) else rid, pos)

    def write(self, table_plane: list[int], pool: dict, rid: str, pos: int) -> None:
        block = table_plane[pos // self.bs]
        kv_pool = self.kv.flat if pool is self.flat else self.kv.looped
        assert kv_pool.refs(block) == 1, f"{rid}: writes position {pos} into block {block}, shared"
        self._slot(pool, block)[pos % self.bs] = self.marker(rid, pos)

    def read(self, table_plane: list[int], pool: dict, pos: int) -> Marker | None:
        return self._slot(pool, table_plane[pos // self.bs])[pos % self.bs]

    def plane_markers(self, table: BlockTable) -> tuple[list, list]:
        looped = [list(self._slot(self.looped, b)) for p in table.depth for b in p]
        flat = [list(self._slot(self.flat, b)) for b in table.flat]
        return looped, flat

    def put_markers(self, table: BlockTable, data: tuple[list, list]) -> None:
        looped, flat = data
        ids = [b for p in table.depth for b in p]
        assert len(ids) == len(looped) and len(table.flat) == len(flat), "swap-in table has another size"
        for b, m in zip(ids, looped):
            self.looped[b] = list(m)
        for b, m in zip(table.flat, flat):
            self.flat[b] = list(m)

    def zero_new_blocks(self) -> None:
        new_looped, new_flat = self.kv.pop_new_blocks()
        for b in new_looped:
            self.looped[b] = [None] * self.bs
        for b in new_flat:
            self.flat[b] = [None] * self.bs

    def apply_moves(self, out) -> None:
        running = {i.request_id for b, _ in self.pipeline for i in b.items}
        for rid, table in out.swap_out:
            assert rid not in self.host, f"{rid} swapped out twice"
            assert rid not in running, f"{rid} swapped out while its batch is in flight"
            self.host[rid] = self.plane_markers(table)
            self.swaps.append(("out", rid))
        self.zero_new_blocks()
        for rid, table in out.swap_in:
            self.put_markers(table, self.host.pop(rid))
            self.swaps.append(("in", rid))

    def read_kv_from(self, prefill: FakeEngine, rid: str) -> None:
        """The decode side's NIXL READ: copy the prompt's markers, every plane, block by block,
        after the blocks this side's prefix cache already held."""
        self.zero_new_blocks()  # fresh blocks are zeroed before the read lands (as the engine does)
        src, dst = prefill.kv.block_table(rid), self.kv.block_table(rid)
        if rid in prefill.keys:
            self.keys[rid] = prefill.keys[rid]
        n = cdiv(prefill.tracks[rid].prompt_len, self.bs)
        first = self.sched.get_request(rid).cached_blocks
        for s_plane, d_plane in zip(src.depth, dst.depth):
            for sb, db in zip(s_plane[first:n], d_plane[first:n]):
                self.looped[db] = list(prefill.looped[sb])
        for sb, db in zip(src.flat[first:n], dst.flat[first:n]):
            self.flat[db] = list(prefill.flat[sb])

    # ------------------------------------------------------------------ execution
    def step(self) -> ScheduledBatch | None:
        """schedule(); run the batch; retire batches so at most a random lag stay in flight."""
        out = self.last = self.sched.schedule()
        self.apply_moves(out)
        for rid in out.preempted:
            assert self.sched.get_request(rid).status is RequestStatus.WAITING
        for rid in out.freed:
            assert not self.kv.has(rid)
        self.preempted += out.preempted
        if out.batch is not None:
            self.batches.append(out.batch)
            self.pipeline.append((out.batch, self.execute(out.batch)))
        lag = self.rng.randint(0, self.max_lag) if out.batch is not None else 0
        while len(self.pipeline) > lag:
            self.retire()
        return out.batch

    def retire(self) -> None:
        batch, result = self.pipeline.pop(0)
        events = self.sched.update(batch, result)
        for rid in events.finished:
            t = self.tracks[rid]
            assert t.n_out <= t.max_tokens
            self.finished[rid] = t.n_out
        self.transferring += events.transferring

    def execute(self, batch: ScheduledBatch) -> BatchResult:
        res = {}
        for item in batch.items:
            rid = item.request_id
            st = self.sched.get_request(rid)
            assert st is not None and st.status is RequestStatus.ACTIVE, f"{rid} scheduled while {st and st.status}"
            t = self.tracks[rid]
            pos = item.positions
            assert list(pos) == sorted(set(pos)) and pos, f"{rid}: rows not ascending: {pos}"
            assert pos[-1] <= t.prompt_len + t.max_tokens - 2, f"{rid}: position {pos[-1]} past the last token"
            assert pos[-1] < self.kv.capacity(rid), f"{rid}: position {pos[-1]} has no KV block"
            assert set(item.logits_positions) <= set(pos)
            res[rid] = {Operation.PRELUDE: self._prelude, Operation.RECURRENT: self._recurrent,
                        Operation.CODA: self._coda}[batch.operation](rid, t, item)
        return BatchResult(res)

    def _context(self, rid: str, plane: list[int], pool: dict, upto: int, what: str) -> None:
        if not self.check_context:
            return
        for q in range(upto + 1):
            m = self.read(plane, pool, q)
            assert m == self.marker(rid, q), f"{rid}: {what} reads position {q}, finds {m}"

    def _prelude(self, rid: str, t: Track, item: BatchItem) -> ItemResult:
        pos = item.positions
        if t.cursor == 0:  # the first PRELUDE starts after the cached prefix, every loop of it skipped
            t.cursor = self.sched.get_request(rid).cached_blocks * self.bs
        assert pos == tuple(range(t.cursor, t.cursor + len(pos))), f"{rid}: prelude {pos} at cursor {t.cursor}"
        assert pos[-1] < t.prompt_len + t.n_out + t.drafts, f"{rid}: prelude of a token not produced yet"
        table = self.kv.block_table(rid)
        for p in pos:
            t.depth[p] = 0
            t.exited.discard(p)
            t.exit_at[p] = self.exit_depth(self.rng, t.min_loops, t.max_loops)
            if table.flat:
                self.write(table.flat, self.flat, rid, p)
        if table.flat:
            self._context(rid, table.flat, self.flat, pos[-1], "prelude")
        t.cursor = pos[-1] + 1
        return ItemResult()

    def _recurrent(self, rid: str, t: Track, item: BatchItem) -> ItemResult:
        d = item.depth
        assert 1 <= d <= t.max_loops, f"{rid}: loop {d} outside 1..{t.max_loops}"
        if item.work_key is WorkKey.SPECULATIVE:
            assert (d <= self.spec.draft_loops) == item.draft, f"{rid}: draft flag wrong at depth {d}"
        table = self.kv.block_table(rid)
        k = min(d, table.num_planes)  # one plane per depth, or a single shared one (last_loop KV)
        plane = table.depth[k - 1]
        for p in item.positions:
            assert p not in t.exited, f"{rid}: position {p} loops after its final exit"
            assert t.depth[p] == d - 1, f"{rid}: position {p} runs loop {d} after loop {t.depth[p]}"
            t.depth[p] = d
            self.write(plane, self.looped, rid, p)
        self._context(rid, plane, self.looped, item.positions[-1], f"loop {d}")
        exited = tuple(p for p in item.positions if t.exit_at[p] <= d)
        for p in exited:
            t.exited.add(p)
            for deeper in table.depth[k:]:  # last-exited rule
                self.write(deeper, self.looped, rid, p)
        return ItemResult(exited=exited)

    def _coda(self, rid: str, t: Track, item: BatchItem) -> ItemResult:
        pos = item.positions
        for p in pos:
            ok = p in t.exited or (item.draft and t.depth[p] >= self.spec.draft_loops)
            assert ok, f"{rid}: coda of position {p} before its loops finished (depth {t.depth[p]})"
        table = self.kv.block_table(rid)
        if table.flat:
            for p in pos:
                self.write(table.flat, self.flat, rid, p)
            self._context(rid, table.flat, self.flat, pos[-1], "coda")
        if not item.logits_positions:
            return ItemResult()
        if item.draft:
            t.drafts += 1
            return ItemResult(sampled=(1,))
        n = self.rng.randint(1, len(item.logits_positions)) if item.verify else 1
        n = min(n, t.max_tokens - t.n_out)
        assert n >= 1, f"{rid}: asked for a token past max_tokens"
        if item.verify:
            assert t.drafts == len(pos) and pos[0] == t.prompt_len + t.n_out - 1
            t.cursor = pos[0] + n  # rows past the accepted prefix are re-run next round
        t.drafts = 0
        t.n_out += n
        finished = t.n_out >= t.max_tokens or self.rng.random() < self.finish_p
        return ItemResult(sampled=(1,) * n, finished=finished)

    # ------------------------------------------------------------------ driving
    def drain(self, max_steps: int = 50_000) -> int:
        """Step (retiring everything at the end) until the scheduler holds nothing."""
        steps = 0
        while self.sched.has_unfinished() or self.pipeline:
            retired = bool(self.pipeline)
            if self.step() is None and not retired and self.sched.has_unfinished():
                # nothing ran, nothing is in flight: only the PD peer can unblock it now
                # (blocks held by TRANSFERRING requests, or RECEIVING ones whose KV has not landed)
                left = [st for st in map(self.sched.get_request, self.tracks) if st]
                assert any(st.status is RequestStatus.TRANSFERRING or
                           (st.status is RequestStatus.RECEIVING and not st.kv_landed) for st in left), \
                    f"no progress: {self.sched.stats()}"
                return steps
            check_invariants(self.sched)
            steps += 1
            assert steps < max_steps, f"did not drain: {self.sched.stats()}"
        return steps
