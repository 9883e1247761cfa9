"""EngineConfig embeds SchedulerConfig: flat keys (YAML `engine:` sections, keyword arguments)
and the nested `scheduler` section give one config; unknown keys and bad values are named."""

from __future__ import annotations

import pytest
import torch

from loopserve.engine.config import GPU_FEATURES, GPU_PATHS_OFF, EngineConfig
from loopserve.engine.gpu_paths import GpuPaths
from loopserve.engine.llm import make_config
from loopserve.scheduler import SchedulerConfig, SpeculativeConfig
from loopserve.scheduler.policy import POLICIES


def test_flat_and_nested_scheduler_keys_give_one_config():
    flat = EngineConfig(max_num_seqs=4, policy="priority", speculative={"num_draft_tokens": 2})
    nested = EngineConfig(scheduler={"max_num_seqs": 4, "policy": "priority",
                                     "speculative": {"num_draft_tokens": 2}})
    given = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, policy="priority",
                                                   speculative=SpeculativeConfig(num_draft_tokens=2)))
    assert flat == nested == given
    assert flat.scheduler.speculative == SpeculativeConfig(num_draft_tokens=2, draft_loops=1)
    assert EngineConfig(**flat.model_dump()) == flat  # dumps are nested and load back
    assert EngineConfig(split_prefill=True, max_num_batched_tokens=100).scheduler.prefill_chunk_size == 100


def test_overrides_merge_scheduler_keys_one_by_one():
    base = EngineConfig(max_num_seqs=4, policy="priority")
    assert make_config(base, max_num_batched_tokens=64).scheduler == SchedulerConfig(
        max_num_seqs=4, policy="priority", max_num_batched_tokens=64)
    assert make_config(base, scheduler={"max_num_seqs": 2}).scheduler.policy == "priority"
    assert make_config({"scheduler": {"max_num_seqs": 2}}, max_num_seqs=3).scheduler.max_num_seqs == 3


@pytest.mark.parametrize("kw, loc", [
    (dict(blok_size=4), "blok_size"),
    (dict(scheduler={"max_num_seq": 4}), "scheduler.max_num_seq"),
    (dict(coda_writes_kv=False), "coda_writes_kv"),  # the model's, not a setting
])
def test_unknown_keys_are_named(kw, loc):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert loc in str(e.value) and "Extra inputs are not permitted" in str(e.value)


def test_the_models_coda_writes_kv_cannot_be_set():
    with pytest.raises(ValueError, match="scheduler.coda_writes_kv comes from the model"):
        EngineConfig(scheduler={"coda_writes_kv": False})


def test_unknown_policy_names_the_field_and_every_registered_policy():
    with pytest.raises(ValueError) as e:
        EngineConfig(policy="fifo")
    msg = str(e.value)
    assert "scheduler.policy" in msg and "'fifo'" in msg and all(name in msg for name in POLICIES), msg


@pytest.mark.parametrize("kw, needles", [
    (dict(speculative={"num_draft_tokens": 17}), ["scheduler.speculative.num_draft_tokens", "less than or equal to 16"]),
    (dict(speculative={"num_draft_tokens": 5}, max_num_batched_tokens=4),
     ["speculative.num_draft_tokens (5)", "max_num_batched_tokens (4)"]),
])
def test_draft_length_bounds_name_the_field_and_limit(kw, needles):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert all(n in str(e.value) for n in needles), str(e.value)


@pytest.mark.parametrize("device, on", [("cpu", False), ("cuda", True)])
def test_gpu_paths_are_on_by_default_for_cuda_only(device, on):
    """The defaults resolve to the GPU paths on a CUDA device (what scripts/gpu_check.sh checks)
    and to none on the CPU; a prefill engine reads its samples back at once."""
    paths = GpuPaths.resolve(EngineConfig(), torch.device(device))
    assert (paths.cuda_graphs, paths.defer_readback, paths.fused_loop_rows > 0) == (on, on, on)
    assert paths.fused_loop_rows == EngineConfig().fused_loop_rows if on else paths.fused_loop_rows == 0
    assert not GpuPaths.resolve(EngineConfig(role="prefill"), torch.device(device)).defer_readback
    off = GpuPaths.resolve(EngineConfig(**GPU_PATHS_OFF), torch.device(device))
    assert (off.cuda_graphs, off.defer_readback, off.fused_loop_rows) == (False, False, 0)
    if on:  # GPU_FEATURES, as the GPU tests give them, are the CUDA defaults
        assert GpuPaths.resolve(EngineConfig(**GPU_FEATURES), torch.device(device)) == paths
