"""The exact work items a request goes through: atomic and split prefill, decode, speculation."""

from loopserve.scheduler import Operation, SpeculativeConfig, WorkKey
from tests.scheduler.helpers import add, engine_for

P, R, C = Operation.PRELUDE, Operation.RECURRENT, Operation.CODA
K = WorkKey


def trace(engine, rid):
    return [(b.operation, i) for b in engine.batches for i in b.items if i.request_id == rid]


def shape(engine, rid):
    return [(op, i.work_key, i.positions, i.depth, i.logits_positions) for op, i in trace(engine, rid)]


def test_atomic_prefill_then_decode_at_fixed_depth():
    e = engine_for()
    add(e, 0, prompt_len=3, max_tokens=3, min_loops=2, max_loops=2)
    e.drain()
    A, rows = K.PROMPT_ATOMIC, (0, 1, 2)
    decode = lambda p: [(P, K.DECODE_PRELUDE, (p,), 0, ()), (R, K.DECODE_RECURRENT, (p,), 1, ()),
                        (R, K.DECODE_RECURRENT, (p,), 2, ()), (C, K.DECODE_CODA, (p,), 0, (p,))]
    assert shape(e, "r0") == [
        (P, A, rows, 0, ()), (R, A, rows, 1, ()), (R, A, rows, 2, ()), (C, A, rows, 0, (2,)),
        *decode(3), *decode(4),
    ]
    assert e.finished == {"r0": 3}


def test_atomic_coda_is_last_position_only_without_coda_kv():
    e = engine_for(coda_writes_kv=False)
    add(e, 0, prompt_len=4, max_tokens=1, min_loops=1, max_loops=1)
    e.drain()
    assert shape(e, "r0")[-1] == (C, K.PROMPT_ATOMIC, (3,), 0, (3,))


def test_split_prefill_chunks_each_get_a_coda_with_coda_kv():
    e = engine_for(split_prefill=True, prefill_chunk_size=3)
    add(e, 0, prompt_len=7, max_tokens=2, min_loops=1, max_loops=1)
    e.drain()
    chunk = lambda rows, logits: [(P, K.PROMPT_PRELUDE, rows, 0, ()), (R, K.PROMPT_RECURRENT, rows, 1, ()),
                                  (C, K.DECODE_CODA, rows, 0, logits)]
    assert shape(e, "r0") == [
        *chunk((0, 1, 2), ()), *chunk((3, 4, 5), ()), *chunk((6,), (6,)),
        (P, K.DECODE_PRELUDE, (7,), 0, ()), (R, K.DECODE_RECURRENT, (7,), 1, ()),
        (C, K.DECODE_CODA, (7,), 0, (7,)),
    ]


def test_split_prefill_without_coda_kv_codas_only_the_last_position():
    e = engine_for(split_prefill=True, prefill_chunk_size=3, coda_writes_kv=False)
    add(e, 0, prompt_len=7, max_tokens=1, min_loops=1, max_loops=1)
    e.drain()
    codas = [s for s in shape(e, "r0") if s[0] is C]
    assert codas == [(C, K.DECODE_CODA, (6,), 0, (6,))]
    assert [s[2] for s in shape(e, "r0") if s[0] is P] == [(0, 1, 2), (3, 4, 5), (6,)]


def test_chunks_shrink_to_the_remaining_budget():
    e = engine_for(split_prefill=True, prefill_chunk_size=4, max_num_batched_tokens=6)
    add(e, 0, prompt_len=8, max_tokens=1, max_loops=1)
    add(e, 1, prompt_len=8, max_tokens=1, max_loops=1)
    e.step()
    first = e.batches[0]
    assert [i.positions for i in first.items] == [(0, 1, 2, 3), (0, 1)]
    e.drain()
    assert all(b.num_rows <= 6 for b in e.batches)


def test_exited_rows_drop_out_of_later_loops():
    e = engine_for(seed=3)
    add(e, 0, prompt_len=12, max_tokens=1, min_loops=1, max_loops=4)
    e.drain()
    loops = [i for op, i in trace(e, "r0") if op is R]
    assert [i.depth for i in loops] == list(range(1, len(loops) + 1))
    assert all(set(b.positions) < set(a.positions) for a, b in zip(loops, loops[1:]))
    assert len(loops[0].positions) == 12 and len(loops) >= 2  # random exits really happened


def test_long_atomic_prompt_runs_alone_over_the_budget():
    e = engine_for(max_num_batched_tokens=4)
    add(e, 0, prompt_len=9, max_tokens=2)
    add(e, 1, prompt_len=2, max_tokens=2)
    e.drain()
    over = [b for b in e.batches if b.num_rows > 4]
    assert over and all(len(b.items) == 1 and b.items[0].work_key is K.PROMPT_ATOMIC for b in over)
    assert set(e.finished) == {"r0", "r1"}


def spec_engine(**kw):
    return engine_for(speculative=SpeculativeConfig(num_draft_tokens=3, draft_loops=1), **kw)


def test_speculative_round_drafts_shallow_then_verifies_at_full_depth():
    e = spec_engine(seed=1)
    add(e, 0, prompt_len=2, max_tokens=9, min_loops=3, max_loops=3)
    e.drain()
    spec = [(op, i) for op, i in trace(e, "r0") if i.work_key is K.SPECULATIVE]
    first = [(op, i.positions, i.depth, i.logits_positions, i.draft, i.verify) for op, i in spec[:11]]
    assert first == [
        (P, (2,), 0, (), True, False), (R, (2,), 1, (), True, False), (C, (2,), 0, (2,), True, False),
        (P, (3,), 0, (), True, False), (R, (3,), 1, (), True, False), (C, (3,), 0, (3,), True, False),
        (P, (4,), 0, (), True, False), (R, (4,), 1, (), True, False), (C, (4,), 0, (4,), True, False),
        (R, (2, 3, 4), 2, (), False, False), (R, (2, 3, 4), 3, (), False, False),
    ]
    verify = spec[11][1]
    assert spec[11][0] is C and verify.verify and verify.positions == verify.logits_positions == (2, 3, 4)
    # the next round starts after the emitted tokens; rounds shrink near max_tokens, then plain decode
    starts = [i.positions[0] for op, i in spec if op is P and i.draft]
    assert starts[3] in (3, 4, 5)
    assert e.finished == {"r0": 9}
    assert max(i.positions[-1] for _, i in trace(e, "r0")) <= 2 + 9 - 2


def test_speculation_skips_rows_that_exit_during_the_draft():
    e = spec_engine(seed=5)
    add(e, 0, prompt_len=1, max_tokens=30, min_loops=1, max_loops=4)
    e.drain()
    verify_loops = [i for op, i in trace(e, "r0") if op is R and not i.draft]
    assert any(len(i.positions) < 3 for i in verify_loops if i.depth == 2)


def test_plain_decode_for_sampling_requests_and_when_draft_is_full_depth():
    e = spec_engine()
    add(e, "sampled", prompt_len=2, max_tokens=5, greedy=False)
    add(e, "shallow", prompt_len=2, max_tokens=5, min_loops=1, max_loops=1)
    e.drain()
    assert not any(i.work_key is K.SPECULATIVE for b in e.batches for i in b.items)
    assert e.finished == {"sampled": 5, "shallow": 5}


def test_one_shared_plane_allocates_a_single_depth_plane():
    e = engine_for(max_lag=0)
    add(e, 0, prompt_len=5, max_tokens=3, min_loops=3, max_loops=3, num_planes=1)
    e.step()
    table = e.sched.kv.block_table("r0")
    assert table.num_planes == 1 and e.sched.kv.usage().looped.used == len(table.flat) == 4
    e.drain()
    assert [i.depth for b in e.batches for i in b.items if b.operation is R][:3] == [1, 2, 3]
    assert e.finished == {"r0": 3}
