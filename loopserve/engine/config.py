"""Engine configuration: one validated object per engine (YAML or Python)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loopserve.scheduler.config import SchedulerConfig

# Scheduler keys an engine config may also give flat (YAML `engine:` sections, keyword
# arguments): every SchedulerConfig field but the model's coda_writes_kv.
SCHEDULER_KEYS = frozenset(SchedulerConfig.model_fields) - {"coda_writes_kv"}

# The model every entry point defaults to (EngineConfig, the embedded cluster, `loopserve
# generate`): the shipped trained checkpoint, so a default run answers rather than prints noise.
DEFAULT_MODEL = "tiny-ouro-chains"

# The GPU paths (see EngineConfig) asked for explicitly: what the defaults resolve to on CUDA,
# given as such by the GPU tests and benchmarks so that they hold whatever the defaults are.
GPU_FEATURES: dict[str, object] = {"cuda_graphs": True, "fused_loop": "auto", "defer_readback": True}
# The same paths off: eager launches, each sample read back at once (the GPU tests' and
# benchmarks' baseline).
GPU_PATHS_OFF: dict[str, object] = {"cuda_graphs": False, "fused_loop": "off", "defer_readback": False}


class EngineConfig(BaseModel):
    """Everything one EngineCore needs. Unknown keys are errors (they are usually typos)."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL  # a name in loopserve/model/configs/ or checkpoints/, or an HF-format directory
    tokenizer: str | None = None  # a tokenizers JSON file; None = byte tokenizer
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    seed: int = 0  # weights seed for random-initialised models; default sampling seed base
    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: int = Field(512, ge=1)
    num_flat_blocks: int | None = Field(None, ge=1)  # default: num_blocks // max_loops + 1
    max_model_len: int = Field(1024, ge=2)
    # What the KV pools store: "auto" the model dtype; "fp8_e4m3" FP8 (e4m3fn) with a static
    # scale per layer and per K/V: half the bytes of bf16 per block (on the PD wire too), so
    # twice the blocks fit a memory budget; accuracy bound in docs/design.md ("FP8 KV cache").
    # PD engines and prefix-cache keys must agree on it.
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    # Reuse the K/V of full prompt blocks whose prefix (and loop configuration) was computed
    # before, on every plane; off for models where a prefix's K/V is not enough (Dory last_loop).
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    # The GPU paths below are on by default for a CUDA device (GpuPaths.resolve; off on CPU):
    # scripts/gpu_check.sh passed with them on at the commit recorded in docs/benchmarks.md.
    # defer_readback (None: on for CUDA): a CODA's sampled ids stay on the device for the next
    # PRELUDE; the host reads them once that is launched (no GPU idle between a token's sample
    # and its next loop). A stop token is then seen one PRELUDE late (its work is dropped). No
    # effect with role='prefill'.
    defer_readback: bool | None = None
    cuda_graphs: bool = True  # on CUDA with the Triton backend: decode steps replay graphs
    fuse_elementwise: bool = True  # on CUDA: torch.compile norms, RoPE, SwiGLU (one kernel each)
    # Ouro decode batches of up to fused_loop_rows rows: each loop is one persistent kernel
    # (auto: on CUDA; on: also on CPU under TRITON_INTERPRET=1, the CPU twin). One row: on the
    # H200 and H100 it beats the per-layer kernels at batch 1 only (docs/benchmarks.md)
    fused_loop: Literal["auto", "on", "off"] = "auto"
    fused_loop_rows: int = Field(1, ge=1, le=64)

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        return nest_scheduler_keys(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if "coda_writes_kv" in self.scheduler.model_fields_set:
            raise ValueError("scheduler.coda_writes_kv comes from the model; remove it")
        return self


def nest_scheduler_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """Engine config data with its flat scheduler keys moved into `scheduler`, over what that
    holds (left as they are when `scheduler` is no mapping: validation names both)."""
    flat = {k: v for k, v in data.items() if k in SCHEDULER_KEYS}
    nested = data.get("scheduler", {})
    if isinstance(nested, SchedulerConfig):
        nested = nested.model_dump(exclude_unset=True)
    if not isinstance(nested, Mapping):
        return dict(data)
    out = {k: v for k, v in data.items() if k not in SCHEDULER_KEYS}
    if flat or "scheduler" in data:
        out["scheduler"] = {**nested, **flat}
    return out


def merge_engine_data(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` over `base` (engine config data, flat or nested); scheduler keys one by one."""
    base, overrides = nest_scheduler_keys(base), nest_scheduler_keys(overrides)
    merged = {**base, **overrides}
    if isinstance(base.get("scheduler"), Mapping) and isinstance(overrides.get("scheduler"), Mapping):
        merged["scheduler"] = {**base["scheduler"], **overrides["scheduler"]}
    return merged


def given_scheduler_keys(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The scheduler keys engine config data gives, flat or nested."""
    nested = nest_scheduler_keys(data).get("scheduler", {})
    return nested if isinstance(nested, Mapping) else {}
