"""Reference attention in plain PyTorch: gather each segment's context by block table.

Decode batches (one row per segment) are gathered and attended in one batched call; other
batches go segment by segment through SDPA with a position mask. fp32 accumulation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loopserve.model.attention.base import write_kv
from loopserve.model.batch import AttnMetadata
from loopserve.model.layers import Rotation
from loopserve.model.paged_kv import dequantize


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    vis = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        vis &= k_pos[None, :] > q_pos[:, None] - window
    return vis


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal-by-position GQA attention in fp32 (plain einsum). q [n, Hq, D]; k, v [m, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    scores = scores.masked_fill(~_visible(q_pos, k_pos, window)[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), vf).to(q.dtype)


def _read(ctx: torch.Tensor, dtype: torch.dtype, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered blocks [..., 2, bs, Hkv, D] in `dtype`, dequantized by (k_scale, v_scale)."""
    if kv_scale is None:
        return ctx.to(dtype)
    return dequantize(ctx, kv_scale.view(2, 1, 1, 1), dtype)


class TorchAttention:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttnMetadata, scale: float, window: int | None = None,
                rot: Rotation | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        if rot is not None:
            q, k = rot(q), rot(k)
        write_kv(cache, meta, k, v, kv_scale)
        if len(meta.seg_bounds) == q.shape[0]:
            return self._decode(q, cache, meta, scale, window, kv_scale)
        out = torch.empty_like(q)
        for s, (a, b) in enumerate(meta.seg_bounds):
            n = meta.seg_num_blocks[s]
            if a == b or n == 0:
                continue
            ctx = _read(cache[meta.block_tables[s, :n].long()], q.dtype, kv_scale)  # [n, 2, bs, Hkv, D]
            keys = ctx[:, 0].reshape(-1, *ctx.shape[-2:]).transpose(0, 1)  # [Hkv, L, D]
            vals = ctx[:, 1].reshape(-1, *ctx.shape[-2:]).transpose(0, 1)
            mask = _visible(meta.positions[a:b], torch.arange(keys.shape[1], device=q.device), window)
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], keys[None], vals[None],
                                               attn_mask=mask[None, None], scale=scale, enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, scale: float,
                window: int | None, kv_scale: torch.Tensor | None) -> torch.Tensor:
        """One row per segment: gather every segment's blocks at once, batched attention."""
        s_n, hq, d = q.shape
        nb = max(meta.seg_num_blocks)
        kv = _read(cache[meta.block_tables[:, :nb].long()], torch.float32, kv_scale)  # [S, nb, 2, bs, Hkv, D]
        hkv = kv.shape[-2]
        k = kv[:, :, 0].reshape(s_n, -1, hkv, d)
        v = kv[:, :, 1].reshape(s_n, -1, hkv, d)
        vis = _visible(meta.positions, torch.arange(k.shape[1], device=q.device), window)  # [S, L]
        qg = q.float().view(s_n, hkv, hq // hkv, d)
        scores = torch.einsum("skgd,slkd->skgl", qg, k) * scale
        scores = scores.masked_fill(~vis[:, None, None, :], float("-inf"))
        out = torch.einsum("skgl,slkd->skgd", torch.softmax(scores, dim=-1), v)
        return out.reshape(s_n, hq, d).to(q.dtype)
