"""The shared state slab and the host-side exit decision the runner relies on."""

import torch
from hypothesis import given, settings, strategies as st

from loopserve.engine.state_store import SINK, ZERO, StateStore
from loopserve.model.exit_rule import exit_mask, exit_without_score


@settings(max_examples=300, deadline=None)
@given(depth=st.integers(1, 8), lo=st.integers(1, 8), hi=st.integers(1, 8),
       thr=st.sampled_from([0.0, 0.3, 0.5, 0.99, 1.0, 1.5]), score=st.floats(0.0, 1.0))
def test_host_exit_decision_is_exit_mask_whenever_it_claims_to_know(depth, lo, hi, thr, score):
    hi = max(hi, lo)
    known = exit_without_score(depth, lo, hi, thr)
    got = bool(exit_mask(torch.tensor([depth]), torch.tensor([score]), torch.tensor([lo]),
                         torch.tensor([hi]), torch.tensor([thr]))[0])
    if known is None:
        assert lo <= depth < hi and thr < 1.0  # only adaptive exit needs the score
    else:
        assert known == got


def test_slab_keeps_rows_across_growth_and_reuses_dropped_ones():
    s = StateStore(4, torch.float32, torch.device("cpu"), capacity=2)
    want = {}
    for r in range(6):  # 6 requests x 3 rows: grows 2 -> 4 -> 8 -> 16 -> 32 rows
        rid = f"r{r}"
        rows = torch.tensor(s.rows([(rid, [0, 1, 2])], assign=True))
        want[rid] = torch.randn(3, 4)
        s.put(rows, want[rid], torch.full((3,), float(r)))
    assert s.rows_in_use == 18 and s.capacity >= 18
    rows = torch.tensor(s.rows([("r5", [2, 0]), ("r0", [1])]))
    h, a = s.get(rows)
    torch.testing.assert_close(h, torch.stack([want["r5"][2], want["r5"][0], want["r0"][1]]))
    assert a.tolist() == [5.0, 5.0, 0.0]
    # re-assigning known positions keeps their rows; only new positions take rows
    before = s.rows([("r1", [0, 1, 2])])
    assert s.rows([("r1", [1, 2, 3])], assign=True)[:2] == before[1:]
    assert s.rows_in_use == 19
    cap = s.capacity
    for rid in want:
        s.drop(rid)
    assert s.rows_in_use == 0 and "r1" not in s
    s.rows([("x", list(range(cap)))], assign=True)  # every row is free again: no growth
    assert s.capacity == cap and len(set(s.rows([("x", list(range(cap)))]))) == cap
    assert not {ZERO, SINK} & set(s.rows([("x", list(range(cap)))]))  # the reserved rows stay out


def test_slab_grown_inside_inference_mode_takes_tokens_outside_it():
    """The runner grows the slab inside inference_mode; the engine keeps sampled ids in it
    outside (keep_tokens): a grown slab must accept both (a 257-byte prompt crashed here)."""
    s = StateStore(4, torch.float32, torch.device("cpu"), capacity=2)
    with torch.inference_mode():
        rows = s.rows([("a", list(range(5)))], assign=True)  # grows past the 2 initial rows
        s.put(torch.tensor(rows), torch.ones(5, 4), torch.ones(5))
    s.put_tokens(torch.tensor(rows[:2]), torch.tensor([7, 9]))
    s.put(torch.tensor(rows[2:3]), torch.zeros(1, 4), torch.zeros(1))
    assert s.embed_ids(torch.tensor([-1, 3, -1]), torch.tensor([rows[0], rows[2], rows[1]])).tolist() == [7, 3, 9]
