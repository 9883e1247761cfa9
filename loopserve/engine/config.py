"""Engine configuration: one validated object per engine (YAML or Python)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: int = Field(3, ge=1, le=16)
    draft_loops: int = Field(1, ge=1)


# The GPU paths that are off by default (see EngineConfig): the settings that turn them all on,
# as the GPU tests, the GPU benchmarks and scripts/gpu_check.sh run them.
GPU_FEATURES: dict[str, object] = {"cuda_graphs": True, "fused_loop": "auto", "defer_readback": True}


class EngineConfig(BaseModel):
    """Everything one EngineCore needs. Unknown keys are errors (they are usually typos)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny-ouro"  # a name in loopserve/model/configs/ or a Hugging Face-format directory
    tokenizer: str | None = None  # a tokenizers JSON file; None = byte tokenizer
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    seed: int = 0  # weights seed for random-initialised models; default sampling seed base
    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: int = Field(512, ge=1)
    num_flat_blocks: int | None = Field(None, ge=1)  # default: num_blocks // max_loops + 1
    max_model_len: int = Field(1024, ge=2)
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    policy: Literal["refill", "no_refill", "priority", "mixed"] = "refill"
    split_prefill: bool = False
    prefill_chunk_size: int | None = Field(None, ge=1)
    incremental_kv: bool = False
    preemption_mode: Literal["keep", "offload"] = "keep"
    speculative: SpeculativeConfig | None = None
    async_scheduling: bool = False
    # GPU paths below are off by default until scripts/gpu_check.sh has passed with them on, on
    # a GPU, at a commit recorded in docs/benchmarks.md (GPU_FEATURES turns them all on).
    # defer_readback: a CODA's sampled ids stay on the device for the next PRELUDE; the host
    # reads them once that is launched (no GPU idle between a token's sample and its next
    # loop). A stop token is then seen one PRELUDE late (its work is dropped). No effect with
    # role='prefill'.
    defer_readback: bool = False
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    max_waiting: int = Field(4096, ge=1)
    cuda_graphs: bool = False  # on CUDA with the Triton backend: decode steps replay graphs
    fuse_elementwise: bool = True  # on CUDA: torch.compile norms, RoPE, SwiGLU (one kernel each)
    # Ouro decode batches of up to fused_loop_rows rows: each loop is one persistent kernel
    # (auto: on CUDA; on: also on CPU under TRITON_INTERPRET=1, the CPU twin). One row: on the
    # H200 and H100 it beats the per-layer kernels at batch 1 only (docs/benchmarks.md)
    fused_loop: Literal["auto", "on", "off"] = "off"
    fused_loop_rows: int = Field(1, ge=1, le=64)

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.split_prefill and self.prefill_chunk_size is None:
            self.prefill_chunk_size = min(256, self.max_num_batched_tokens)
        # A verify round runs its num_draft_tokens rows in one batch; more never fit and the
        # request would wait forever.
        if self.speculative and self.speculative.num_draft_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"speculative.num_draft_tokens ({self.speculative.num_draft_tokens}) must be <= "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        return self
