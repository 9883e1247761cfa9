import pytest
from hypothesis import given, settings, strategies as st

from loopserve.kv_cache import KVCacheManager, KVCapacityError, KVLayout, BlockPool


def make(incremental=False, blocks=16, flat=8, bs=4):
    return KVCacheManager(KVLayout(bs, blocks, flat, has_flat=flat > 0), incremental=incremental)


def test_full_reservation_covers_every_plane():
    m = make()
    assert m.allocate("a", 9, 3)
    t = m.block_table("a")
    assert t.num_planes == 3 and all(len(p) == 3 for p in t.depth) and len(t.flat) == 3
    assert m.capacity("a") == 12
    assert m.usage().looped.used == 9 and m.usage().flat.used == 3
    with pytest.raises(RuntimeError, match="fully reserved"):
        m.allocate("a", 13, 3)
    m.check()


def test_usage_counts_blocks_per_plane_across_loop_counts():
    m = make(blocks=32)
    assert m.allocate("three", 5, 3) and m.allocate("one", 9, 1)
    assert m.usage().planes == (2 + 3, 2, 2) and sum(m.usage().planes) == m.usage().looped.used
    m.free("one")
    assert m.usage().planes == (2, 2, 2)
    m.free("three")
    assert m.usage().planes == ()


def test_never_fits_error_names_request_and_blocks():
    m = make(blocks=8)
    with pytest.raises(KVCapacityError) as e:
        m.allocate("req-7", 20, 4)
    msg = str(e.value)
    assert "req-7" in msg and "20 looped KV blocks" in msg and "num_blocks (8)" in msg
    assert m.usage().used_blocks == 0


def test_short_now_allocates_nothing():
    m = make(blocks=8)
    assert m.allocate("a", 16, 1)  # 4 blocks
    assert not m.allocate("b", 8, 3)  # 6 > 4 free
    assert not m.has("b") and m.usage().looped.used == 4
    m.check()


def test_incremental_growth_and_free_returns_all():
    m = make(incremental=True)
    assert m.allocate("a", 1, 2)
    assert m.allocate("a", 4, 2)  # same block
    assert m.usage().looped.used == 2
    assert m.allocate("a", 5, 2)
    assert m.usage().looped.used == 4 and len(m.block_table("a").flat) == 2
    new_looped, new_flat = m.pop_new_blocks()
    assert len(new_looped) == 4 and len(new_flat) == 2 and m.pop_new_blocks() == ([], [])
    assert m.free("a") and not m.free("a")
    assert m.usage().used_blocks == 0
    m.check()


def test_no_flat_pool_for_models_without_boundary_layers():
    m = make(flat=0)
    assert m.allocate("a", 8, 4)
    assert m.block_table("a").flat == [] and m.usage().flat.total == 0
    m.check()


def test_pool_rejects_double_free():
    p = BlockPool("x", 4)
    ids = p.allocate(2)
    p.free(ids)
    with pytest.raises(RuntimeError, match="freed more often"):
        p.free(ids[:1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 30), st.integers(1, 4)), max_size=40))
def test_random_alloc_free_keeps_accounting(ops):
    m = make(incremental=True, blocks=24, flat=8)
    for is_alloc, rid, ntok, planes in ops:
        name = f"r{rid}"
        if is_alloc:
            if m.has(name):
                planes = m.block_table(name).num_planes
            try:
                m.allocate(name, ntok, planes)
            except KVCapacityError:
                pass
        else:
            m.free(name)
        m.check()
    for rid in range(6):
        m.free(f"r{rid}")
    assert m.usage().used_blocks == 0
    m.check()


def runs(ids: list[int]) -> int:
    """Runs of adjacent ascending ids (what one NIXL descriptor or one memset covers)."""
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


def read_runs(local: list[list[int]], remote: list[list[int]], n: int) -> int:
    """Descriptors of a READ of blocks 0..n-1 of every plane as the connector posts it: pairs
    sorted by the local id, a run going on while both sides' ids step by one."""
    pairs = sorted((a, b) for lp, rp in zip(local, remote) for a, b in zip(lp[:n], rp[:n]))
    return sum(1 for i, (a, b) in enumerate(pairs)
               if i == 0 or (a, b) != (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1))


def test_planes_stay_runs_of_adjacent_blocks_after_the_pool_cycles():
    """A freed table's blocks go back tail first, plane by plane interleaved; the next table
    of its size must still get its blocks as one run of adjacent ids, dealt round robin over
    the planes (block i of plane k the (i * planes + k)-th), not ids stepping down by the
    plane count."""
    planes, per_plane = 4, 8
    m = make(blocks=4 * planes * per_plane, flat=4 * per_plane, bs=4)
    for rid in "abcd":  # the pool, full
        assert m.allocate(rid, 4 * per_plane, planes)
    for step in range(12):  # churn: one table freed and one of its size taken, round robin
        rid = "abcd"[step % 4]
        m.free(rid)
        assert m.allocate(rid, 4 * per_plane, planes)
        t = m.block_table(rid)
        dealt = [p[i] for i in range(per_plane) for p in t.depth]
        assert runs(dealt) == 1 and runs(t.flat) == 1, (step, t)
    m.check()


@pytest.mark.parametrize("n,extra,bs", [(9, 0, 4), (9, 1, 4), (9, 3, 4), (65, 1, 16), (256, 1, 16)])
def test_a_handoff_read_is_one_descriptor_when_the_sides_differ_in_length(n, extra, bs):
    """The prefill side holds the prompt's n blocks per plane, the decode side n + extra (room
    for the tokens to come): the READ of blocks 0..n-1 of every plane is one run on both sides,
    also after the pools cycled (1040- and 4096-token prompts at block 16 among the cases)."""
    planes = 4
    blocks = 3 * planes * (n + extra)
    prefill, decode = (make(blocks=blocks, flat=3 * (n + extra), bs=bs) for _ in range(2))
    for side, length in ((prefill, n), (decode, n + extra)):
        for rid in ("w1", "w2"):  # the pools past their first cycle
            assert side.allocate(rid, bs * (n // 2 + 1), planes)
        side.free("w1")
        assert side.allocate("r", bs * length, planes)
        side.free("w2")
    local, remote = decode.block_table("r").depth, prefill.block_table("r").depth
    assert read_runs(local, remote, n) == 1
