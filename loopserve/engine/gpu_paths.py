"""GpuPaths: the GPU feature switches of engine config, resolved for one engine's device.

EngineConfig says what is asked ("auto", None: on for a CUDA device); this says what runs.
The model runner applies them (`ModelRunner.use_paths`); the engine reads `defer_readback`
to know whether a CODA's sampled ids are read back at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.engine.config import EngineConfig


@dataclass(frozen=True)
class GpuPaths:
    fuse_elementwise: bool  # torch.compile the elementwise kernels (process-wide)
    fused_loop_rows: int  # decode batches up to this many rows run the fused loop kernel; 0: off
    fused_loop_required: bool  # fused_loop='on': a model without the kernel is an error
    cuda_graphs: bool  # decode-shaped batches replay captured graphs
    # A CODA's sampled ids stay on the device for the next PRELUDE; a prefill engine hands its
    # request over right after the CODA, so it has nothing to overlap and reads back at once.
    defer_readback: bool

    @classmethod
    def resolve(cls, config: EngineConfig, device: torch.device) -> GpuPaths:
        cuda = device.type == "cuda"
        fused = config.fused_loop == "on" or (config.fused_loop == "auto" and cuda)
        defer = config.defer_readback if config.defer_readback is not None else cuda
        return cls(
            fuse_elementwise=config.fuse_elementwise and cuda,
            fused_loop_rows=config.fused_loop_rows if fused else 0,
            fused_loop_required=config.fused_loop == "on",
            cuda_graphs=config.cuda_graphs and cuda,
            defer_readback=defer and config.scheduler.role != "prefill",
        )
