"""Prefix caching in the block accounting: keys, sharing by reference count, LRU eviction."""

import pytest
from hypothesis import given, settings, strategies as st

from loopserve.kv_cache import KVCacheManager, KVLayout, hash_blocks

BS = 4


def make(blocks=24, flat=8):
    return KVCacheManager(KVLayout(BS, blocks, flat, has_flat=flat > 0), incremental=True)


def test_keys_chain_the_prefix_and_the_cache_key():
    a = hash_blocks(list(range(10)), BS, ("m", 1))
    assert len(a) == 2  # the partial third block has no key
    assert hash_blocks(list(range(8)) + [99], BS, ("m", 1)) == a
    assert hash_blocks([7] + list(range(1, 10)), BS, ("m", 1))[1] != a[1]  # parent differs
    assert hash_blocks(list(range(10)), BS, ("m", 2)) != a  # loop configuration differs
    assert hash_blocks(list(range(10)), BS, ("m", 1)) == a  # stable


def _run(m, rid, tokens, planes=3, cached=True):
    """Admit like the scheduler: start from the cached prefix, then index the prompt's blocks."""
    keys = hash_blocks(tokens, BS, ("m", planes))
    prefix = m.cached_prefix(keys, len(tokens))
    assert m.allocate(rid, len(tokens), planes, prefix)
    if cached:
        m.cache_blocks(rid, keys, len(prefix))
    return prefix


def test_hit_shares_every_plane_and_the_flat_block():
    m = make()
    prompt = list(range(13))
    assert _run(m, "a", prompt) == []
    hit = _run(m, "b", prompt)
    a, b = m.block_table("a"), m.block_table("b")
    assert len(hit) == 3  # (13 - 1) // 4: the last token's block is never a hit
    assert all(pa[:3] == pb[:3] for pa, pb in zip(a.depth, b.depth)) and a.flat[:3] == b.flat[:3]
    assert a.depth[0][3] != b.depth[0][3]
    assert all(m.looped.refs(x) == 2 for x in b.depth[1][:3])
    assert m.exclusive_blocks("b") == (3, 1)
    m.check()


def test_usage_per_plane_counts_a_shared_block_once():
    m = make()
    prompt = list(range(13))
    _run(m, "a", prompt)
    _run(m, "b", prompt)  # shares 3 of its 4 blocks on every plane
    assert m.usage().planes == (5, 5, 5) and sum(m.usage().planes) == m.usage().looped.used


def test_last_token_always_runs():
    m = make()
    prompt = list(range(8))
    _run(m, "a", prompt)
    assert len(_run(m, "b", prompt)) == 1  # two full blocks cached, only the first may hit
    m.check()


def test_freed_cached_blocks_count_free_and_still_hit():
    m = make()
    prompt = list(range(9))
    _run(m, "a", prompt)
    m.free("a")
    assert m.usage().used_blocks == 0 and len(m.prefix) == 2
    assert len(_run(m, "b", prompt)) == 2
    m.free("b")
    m.check()


def test_eviction_is_lru_and_tail_first():
    m = make(blocks=12, flat=4)  # 4 logical blocks of 3 planes
    _run(m, "old", list(range(8)))  # 2 blocks cached
    m.free("old")
    _run(m, "new", list(range(100, 108)))
    m.free("new")
    assert len(m.prefix) == 4
    assert m.allocate("x", 4, 3)  # takes one logical block: the LRU one, old's tail
    assert m.cached_prefix(hash_blocks(list(range(8)) + [0], BS, ("m", 3)), 9) != []
    assert len(m.prefix) == 3
    assert m.allocate("y", 4, 3)  # then old's head
    assert len(m.prefix) == 2 and m.cached_prefix(hash_blocks(list(range(8)) + [0], BS, ("m", 3)), 9) == []
    m.free("x")
    assert len(_run(m, "z", list(range(100, 109)), cached=False)) == 2  # new's blocks survived
    m.check()


def test_hit_of_unreferenced_blocks_needs_no_extra_room():
    m = make(blocks=12, flat=4)
    prompt = list(range(13))
    _run(m, "a", prompt)  # all 4 logical blocks
    m.free("a")
    keys = hash_blocks(prompt, BS, ("m", 3))
    prefix = m.cached_prefix(keys, 13)
    assert m.shortfall("b", 13, 3, prefix) == (0, 0)
    assert m.allocate("b", 13, 3, prefix) and m.usage().looped.free == 0
    m.check()


def test_prefix_must_start_a_new_table():
    m = make()
    _run(m, "a", list(range(9)))
    prefix = m.cached_prefix(hash_blocks(list(range(9)), BS, ("m", 3)), 9)
    with pytest.raises(ValueError, match="new table"):
        m.allocate("a", 12, 3, prefix)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 2), st.integers(1, 20)),
                max_size=40))
def test_random_shared_prefixes_keep_accounting(ops):
    m = make(blocks=30, flat=10)
    for is_alloc, rid, base, n in ops:
        name = f"r{rid}"
        if is_alloc and not m.has(name):
            tokens = [base] * n
            keys = hash_blocks(tokens, BS, ("m", 3))
            prefix = m.cached_prefix(keys, n)
            if m.allocate(name, n, 3, prefix):
                m.cache_blocks(name, keys, len(prefix))
        elif not is_alloc:
            m.free(name)
        m.check()
    for rid in range(6):
        m.free(f"r{rid}")
    assert m.usage().used_blocks == 0
    m.check()
