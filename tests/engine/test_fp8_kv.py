"""The FP8 KV cache (issue 42, kv_cache_dtype="fp8_e4m3") on the CPU torch path: what the pools
store and cost, the teacher-forced logprob gap to the fp32 dense reference within the stated
bound (tests/fp8_accuracy.py), and every path that moves K/V bytes (prefix caching, offload,
the PD READ) equal to the same FP8 engine without it. Mismatched KV dtypes are refused at the
NIXL handshake. The Triton kernels' FP8 paths: tests/model (interpreter) and tests/gpu."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from loopserve.engine.config import EngineConfig
from loopserve.kv_transfer.connector import KVCompatError
from loopserve.kv_transfer.nixl_agent import NixlKVWorker
from loopserve.model.paged_kv import FP8, FP8_KV_SCALE
from tests.engine.conftest import make_engine, model_for, run_pd, run_to_completion, workload
from tests.engine.test_equivalence import CONFIGS
from tests.engine.test_prefix_caching import serve, shared_prefix_workload
from tests.fp8_accuracy import BOUNDS, fixed_depth, prompt, run_engine, teacher_forced_gap
from tests.real_shapes import LONG_PROMPTS, MAX_MODEL_LEN, check_lengths_exceed_capacities

FP8_KV = {"kv_cache_dtype": "fp8_e4m3"}


def test_config_default_and_refusal():
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValidationError, match="kv_cache_dtype") as e:
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert "'auto' or 'fp8_e4m3'" in str(e.value)


def test_pools_store_one_byte_per_element_with_a_scale_per_layer_and_kv(family):
    e = make_engine(family, **FP8_KV)
    kv, spec = e.runner.kv, e.model.kv_spec
    assert kv.looped.dtype == FP8 and kv.looped.element_size() == 1
    assert (kv.flat is None) == (spec.num_flat_layers == 0)
    assert kv.scales["looped"].shape == (spec.num_looped_layers, 2)
    assert bool((kv.scales["looped"] == FP8_KV_SCALE).all())
    assert make_engine(family).runner.kv.scales is None  # "auto": the model dtype, no scales
    # a memory budget holds twice the blocks of bf16 (four times fp32's)
    bf16, fp8 = spec.block_bytes(16, torch.bfloat16), spec.block_bytes(16, FP8)
    assert fp8 == (bf16[0] // 2, bf16[1] // 2)
    budget = 3 << 30
    n16 = spec.blocks_for_budget(budget, 16, torch.bfloat16, 4)
    n8 = spec.blocks_for_budget(budget, 16, FP8, 4)
    assert abs(n8 - 2 * n16) <= 2  # the flat pool rounds (num_blocks // max_loops + 1)
    looped, flat = fp8
    assert n8 * looped + (n8 // 4 + 1) * flat <= budget < (n8 + 1) * looped + ((n8 + 1) // 4 + 1) * flat
    with pytest.raises(ValueError, match="budget_bytes=10 holds no KV block"):
        spec.blocks_for_budget(10, 16, FP8, 4)


def test_teacher_forced_logprob_gap_within_the_bound(family):
    """Prompts past the state slab's initial rows and the default max_model_len, decoded
    together; the same run with the model dtype's KV is the harness's own check (fp32 == fp32)."""
    check_lengths_exceed_capacities()
    m = model_for(family)
    loops = m.default_loop_params.max_loops
    reqs = {f"r{n}": (prompt(n, n, m.vocab_size), fixed_depth(8, n, loops)) for n in (1, 9, 40, *LONG_PROMPTS[:2])}
    gaps = {}
    for kvd in ("auto", "fp8_e4m3"):
        e = make_engine(family, kv_cache_dtype=kvd, block_size=16, max_model_len=MAX_MODEL_LEN)
        gaps[kvd] = teacher_forced_gap(m, reqs, run_engine(e, reqs))
    print(f"{family}: teacher-forced logprob gap, fp32 KV {gaps['auto']}, FP8 KV {gaps['fp8_e4m3']}")
    assert gaps["auto"].max < 1e-3
    bound = BOUNDS[family]
    assert gaps["fp8_e4m3"].max <= bound.max and gaps["fp8_e4m3"].mean <= bound.mean, gaps["fp8_e4m3"]
    assert gaps["fp8_e4m3"].mean > 10 * gaps["auto"].mean  # the KV really is rounded to FP8


@pytest.mark.parametrize("cfg", ["refill", "preempt-incremental"])
def test_prefix_caching_on_equals_off(family, cfg):
    """Cached FP8 blocks (shared, evicted, and with offload preemption swapped out and back)
    give the outputs of computing them again."""
    work = shared_prefix_workload()
    if cfg != "refill":
        work = [(rid, p, replace(sp, priority=-int(rid[1:]))) for rid, p, sp in work]
    _, want, want_depths = serve(family, work, False, **CONFIGS[cfg], **FP8_KV)
    engine, got, depths = serve(family, work, True, **CONFIGS[cfg], **FP8_KV)
    assert got == want and depths == want_depths
    assert engine.stats().prefix_cache.hits > 0
    if cfg != "refill":
        assert engine.counters.preemptions > 0


def test_offload_equals_no_preemption(family):
    """Offload moves FP8 blocks to the host and back as bytes: the outputs of a run that never
    preempts."""
    work = [(rid, p, replace(sp, priority=-int(rid[1:]))) for rid, p, sp in workload(seed=1)]
    runs = {}
    for cfg in ("refill", "preempt-incremental"):
        e = make_engine(family, **CONFIGS[cfg], **FP8_KV)
        for rid, p, sp in work[:8]:
            e.add_request(p, sp, request_id=rid)
        runs[cfg] = run_to_completion(e, arrivals=work[8:])
        if cfg != "refill":
            assert e.counters.preemptions > 0
    assert runs["preempt-incremental"] == runs["refill"]


def test_pd_equals_colocated(family):
    """1P1D, both FP8: the READ moves one byte per element (half of bf16's on the wire), and
    the decode side continues exactly as one colocated FP8 engine."""
    work = workload(seed=7, n=6)
    colocated = make_engine(family, **FP8_KV)
    for rid, p, sp in work:
        colocated.add_request(p, sp, request_id=rid)
    want, _ = run_to_completion(colocated)
    p, d = make_engine(family, role="prefill", **FP8_KV), make_engine(family, role="decode", **FP8_KV)
    assert p.kv_compat()["kv_cache_dtype"] == "fp8_e4m3"
    for rid, prompt_ids, sp in work:
        p.add_request(prompt_ids, sp, request_id=rid)
    assert run_pd(p, d).tokens == want
    w = NixlKVWorker(f"fp8-{uuid.uuid4().hex[:6]}", {"looped": p.runner.kv.looped, "flat": p.runner.kv.flat},
                     p.config.block_size, p.kv_compat())
    try:
        assert w.layouts["looped"].block_bytes == p.model.kv_spec.block_bytes(p.config.block_size, FP8)[0]
        assert w.compat["kv_dtype"] == "float8_e4m3fn"
    finally:
        w.close()


def test_handshake_refuses_mismatched_kv_dtypes():
    """An FP8 prefill engine and a decode engine in the model dtype never exchange blocks."""
    p = make_engine("tiny-ouro", role="prefill", **FP8_KV)
    d = make_engine("tiny-ouro", role="decode")
    workers = [NixlKVWorker(f"{name}-{uuid.uuid4().hex[:6]}", {"looped": e.runner.kv.looped},
                            e.config.block_size, e.kv_compat()) for name, e in (("pe", p), ("de", d))]
    try:
        with pytest.raises(KVCompatError, match="kv_cache_dtype is 'fp8_e4m3' on 'pe-.*' but 'auto' on 'de-"):
            workers[1].add_peer(workers[0].handshake_info())
        with pytest.raises(KVCompatError, match="kv_dtype is 'float8_e4m3fn' on 'pe-.*' but 'float32'"):
            workers[1].add_peer(workers[0].handshake_info())
    finally:
        for w in workers:
            w.close()


def test_prefix_keys_name_the_kv_dtype():
    """A router must not send an FP8 worker's cached prefix to a bf16 worker (or back)."""
    ids, sp = list(range(1, 30)), fixed_depth(1, 0, 2)
    fp8 = make_engine("tiny-ouro", **FP8_KV).prefix_keyer
    auto = make_engine("tiny-ouro").prefix_keyer
    assert fp8.keys(ids, sp, 0) != auto.keys(ids, sp, 0)
