"""Width-aware batch formation: decode batches as wide as lockstep once groups out of phase
converge, and no ready item waits longer than the stated bound (docs/scheduler.md)."""

import pytest

from loopserve.scheduler import WorkKey
from tests.scheduler.decode_width import POLICY_CONFIG, measure
from tests.scheduler.fake_engine import FakeEngine
from tests.scheduler.helpers import add, make_scheduler

W = 12  # SchedulerConfig.max_wait_steps default


def wait_bound(groups: int, plans: int) -> int:
    """Steps an item of a group of `plans` plans may be passed over while `groups` groups hold
    work: W until it is overdue, then its group's turn (round robin: within `groups` steps)
    for each of the group's plans holding older work, its own last."""
    return W + plans * groups - 1


@pytest.mark.parametrize("policy", list(POLICY_CONFIG))
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("c", [8, 24])
def test_decode_batches_are_as_wide_as_lockstep(policy, adaptive, c):
    # 64-token prompts, 128 tokens a batch: prompts enter two at a time, so decode starts in
    # c/2 groups out of phase (the old order kept them apart: 0.45 of lockstep at C = 64)
    w = measure(c, adaptive, policy, prompt_len=64, steps=60, settle=30, seed=c, budget=128)
    assert w.ratio >= (0.8 if adaptive else 0.95), f"{policy}: {w.ratio:.2f} of lockstep, rows {w.rows}"
    if policy != "no_refill":  # its cohorts wait for older ones by design
        assert w.max_wait <= wait_bound(1, 3)  # decode alone once the prompts are done


CASES = {  # config, groups that can hold work at once
    "refill": ({}, 4),  # decode, and the three PROMPT_ATOMIC lanes
    "split": ({"split_prefill": True, "prefill_chunk_size": 8}, 3),  # decode, PROMPT_PRELUDE, PROMPT_RECURRENT
    "speculative": ({"speculative": {"num_draft_tokens": 3, "draft_loops": 1}}, 5),
    "mixed": ({"policy": "mixed", "split_prefill": True, "prefill_chunk_size": 8}, 1),
}
PROMPT_KEYS = {WorkKey.PROMPT_ATOMIC, WorkKey.PROMPT_PRELUDE, WorkKey.PROMPT_RECURRENT}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lag", [0, 1])
def test_no_item_waits_past_the_bound_while_prompts_stream_in(case, lag):
    cfg, groups = CASES[case]
    sched = make_scheduler(blocks=2500, max_num_seqs=48, max_num_batched_tokens=256, **cfg)
    e = FakeEngine(sched, seed=7 + lag, finish_p=0.0, max_lag=lag)
    for i in range(16):
        add(e, f"d{i}", prompt_len=1 + i % 5, max_tokens=40, min_loops=1, max_loops=4)
    steps = worst_decode = worst_prompt = 0
    for n in range(160):
        if n % 4 == 0:  # a prompt every 4 steps, lengths and depths varied
            add(e, f"p{n}", prompt_len=9 + n % 23, max_tokens=2, min_loops=1, max_loops=2 + n % 3)
        e.step()
        steps += 1
        for (key, _), lane in sched.queues.lanes.items():
            for st in lane:
                passed = steps - st.ready_step
                if key in PROMPT_KEYS and case != "mixed":
                    worst_prompt = max(worst_prompt, passed)
                else:
                    worst_decode = max(worst_decode, passed)
    e.drain()
    assert set(e.finished) == set(e.tracks)
    plans = 1 if case == "mixed" else 3
    assert worst_decode <= wait_bound(groups, plans), (worst_decode, wait_bound(groups, plans))
    assert worst_prompt <= groups - 1  # a prompt lane is a group alone: round robin only
    assert worst_decode > 0
