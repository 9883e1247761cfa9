"""Reference attention in plain PyTorch: gather each segment's context by block table."""

from __future__ import annotations

import torch

from loopserve.model.attention.base import write_kv
from loopserve.model.batch import AttnMetadata


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal-by-position GQA attention in fp32. q [n, Hq, D]; k, v [m, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), vf).to(q.dtype)


class TorchAttention:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttnMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        write_kv(cache, meta, k, v)
        out = torch.empty_like(q)
        bs = meta.block_size
        for s, (a, b) in enumerate(meta.seg_bounds):
            if a == b:
                continue
            n = meta.seg_num_blocks[s]
            blocks = meta.block_tables[s, :n].long()
            ctx = cache[blocks]  # [n, 2, bs, Hkv, D]
            keys = ctx[:, 0].reshape(n * bs, *ctx.shape[-2:])
            vals = ctx[:, 1].reshape(n * bs, *ctx.shape[-2:])
            k_pos = torch.arange(n * bs, device=q.device)
            out[a:b] = attend(q[a:b], keys, vals, meta.positions[a:b], k_pos, scale, window)
        return out
