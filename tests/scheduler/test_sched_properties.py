"""Property tests: random arrivals, priorities, aborts, preemptions, async retire delays and
PD handoffs, for every policy. Invariants hold after every step and every request finishes or
is aborted (no livelock). The fake engine checks KV contents and row states throughout."""

import pytest
from hypothesis import given, settings, strategies as st

from loopserve.scheduler.invariants import check_invariants
from tests.scheduler.fake_engine import FakeEngine
from tests.scheduler.helpers import POLICY_CONFIGS, add, make_scheduler

CONFIGS = {
    **{name: (kw, False, 200) for name, kw in POLICY_CONFIGS.items()},
    "refill-incremental": ({}, True, 30),
    "priority-offload-incremental": ({"policy": "priority", "preemption_mode": "offload"}, True, 30),
    "priority-keep-split-incremental": ({"policy": "priority", "split_prefill": True,
                                         "prefill_chunk_size": 4}, True, 30),
    "mixed-incremental": ({"policy": "mixed", "split_prefill": True, "prefill_chunk_size": 3}, True, 30),
}

# add: prompt_len, max_tokens, min_loops, extra loops, priority, greedy, one shared KV plane,
# prompt tokens (None: prefix caching off; equal values share prefixes)
request = st.tuples(st.just("add"), st.integers(1, 9), st.integers(1, 6), st.integers(1, 2),
                    st.integers(0, 1), st.integers(-2, 2), st.booleans(), st.booleans(),
                    st.sampled_from([None, 0, 1]))
ops = st.lists(st.one_of(request, st.tuples(st.just("step"), st.integers(1, 4)),
                         st.tuples(st.just("abort"), st.integers(0, 30))), min_size=1, max_size=60)


def engine(cfg: str, seed: int, lag: int, role: str = "colocated") -> FakeEngine:
    kw, incremental, blocks = CONFIGS[cfg]
    sched = make_scheduler(blocks=blocks, incremental=incremental, max_num_seqs=3,
                           max_num_batched_tokens=8, role=role, **kw)
    return FakeEngine(sched, seed=seed, finish_p=0.1, max_lag=lag)


def apply(e: FakeEngine, op: tuple, ids: list[str]) -> None:
    if op[0] == "add":
        _, plen, max_tokens, lo, extra, prio, greedy, one_plane, prompt = op
        ids.append(add(e, len(ids), plen, max_tokens, lo, lo + extra, prio, greedy, 1 if one_plane else None,
                       None if one_plane else prompt))  # one shared plane: never cached (Dory last_loop)
    elif op[0] == "step":
        for _ in range(op[1]):
            e.step()
            check_invariants(e.sched)
    elif ids:
        e.abort(ids[op[1] % len(ids)])


def check_drained(e: FakeEngine, ids: list[str]) -> None:
    e.drain()
    assert set(e.finished) | e.aborted == set(ids), "a request neither finished nor was aborted"
    assert not set(e.finished) & e.aborted
    assert e.sched.kv.usage().used_blocks == 0 and not e.sched.admission_slots


def run_colocated(cfg: str, script: list, seed: int, lag: int) -> None:
    e = engine(cfg, seed, lag)
    ids: list[str] = []
    for op in script:
        apply(e, op, ids)
        check_invariants(e.sched)
    check_drained(e, ids)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@settings(max_examples=50, deadline=None)
@given(script=ops, seed=st.integers(0, 10**6), lag=st.integers(0, 2))
def test_random_workloads_keep_invariants_and_drain(cfg, script, seed, lag):
    run_colocated(cfg, script, seed, lag)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", list(CONFIGS))
@settings(max_examples=400, deadline=None)
@given(script=ops, seed=st.integers(0, 10**6), lag=st.integers(0, 2))
def test_random_workloads_keep_invariants_and_drain_long(cfg, script, seed, lag):
    run_colocated(cfg, script, seed, lag)


pd_ops = st.lists(st.one_of(request, st.tuples(st.sampled_from(["step_p", "step_d", "land"]), st.integers(1, 4)),
                            st.tuples(st.just("abort"), st.integers(0, 30))), min_size=1, max_size=60)


class PDPair:
    """A prefill and a decode engine with the handoff between them (KV read, then confirm)."""

    def __init__(self, cfg: str, seed: int, lag: int) -> None:
        self.p = engine(cfg, seed, lag, role="prefill")
        self.d = engine(cfg, seed + 1, lag, role="decode")
        self.ids: list[str] = []
        self.handed = 0  # p.transferring[:handed] have blocks on the decode side
        self.reading: list[str] = []  # KV read in flight

    def hand_over(self) -> None:
        while self.handed < len(self.p.transferring):
            rid = self.p.transferring[self.handed]
            t = self.p.tracks[rid]
            if self.p.sched.get_request(rid) is None:  # aborted on the prefill side meanwhile
                self.handed += 1
                continue
            req = self.p.sched.get_request(rid).request
            if not self.d.sched.add_receiving(req, t.prompt_len):
                return
            self.d.track(rid, t.prompt_len, t.max_tokens, t.min_loops, t.max_loops, n_out=1)
            self.d.read_kv_from(self.p, rid)
            self.reading.append(rid)
            self.handed += 1

    def land(self, n: int) -> None:
        for rid in self.reading[:n]:
            if self.d.sched.get_request(rid) is not None:
                assert self.d.sched.kv_received(rid)
            if self.p.sched.get_request(rid) is not None:
                assert self.p.sched.transfer_done(rid)
        del self.reading[:n]

    def apply(self, op: tuple) -> None:
        if op[0] == "step_p":
            apply(self.p, ("step", op[1]), self.ids)
        elif op[0] == "step_d":
            apply(self.d, ("step", op[1]), self.ids)
        elif op[0] == "land":
            self.land(op[1])
        elif op[0] == "abort" and self.ids:
            rid = self.ids[op[1] % len(self.ids)]
            self.p.abort(rid)
            self.d.abort(rid)
        else:
            apply(self.p, op, self.ids)
        self.hand_over()
        for e in (self.p, self.d):
            check_invariants(e.sched)

    def drain(self) -> None:
        for _ in range(10_000):
            self.p.drain()
            self.hand_over()
            self.land(len(self.reading))
            self.d.drain()
            if not (self.p.sched.has_unfinished() or self.d.sched.has_unfinished()):
                break
        done = set(self.p.finished) | set(self.d.finished) | self.p.aborted | self.d.aborted
        assert done == set(self.ids)
        for e in (self.p, self.d):
            assert e.sched.kv.usage().used_blocks == 0 and not e.sched.admission_slots
        for rid in self.d.finished:
            assert rid in self.p.transferring  # decode only finishes what prefill handed over


@pytest.mark.parametrize("cfg", ["refill", "priority", "refill-incremental", "mixed-incremental"])
@settings(max_examples=50, deadline=None)
@given(script=pd_ops, seed=st.integers(0, 10**6), lag=st.integers(0, 2))
def test_random_pd_handoffs_keep_invariants_and_drain(cfg, script, seed, lag):
    pair = PDPair(cfg, seed, lag)
    for op in script:
        pair.apply(op)
    pair.drain()


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_shared_prompts_hit_the_prefix_cache(cfg):
    """Requests over one prompt, arriving while earlier ones run: later ones start from the
    cached blocks (the fake engine checks their content and that nobody writes into them)."""
    script = [op for i in range(8) for op in (("add", 9, 3, 1, 1, -(i % 3), True, False, 0), ("step", 3))]
    e = engine(cfg, seed=1, lag=1)
    ids: list[str] = []
    for op in script:
        apply(e, op, ids)
    check_drained(e, ids)
    assert e.sched.kv.prefix_stats.hits > 0
