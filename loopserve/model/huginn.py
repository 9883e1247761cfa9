"""Huginn-style recurrent-depth model (`RavenForCausalLM` key names).

PRELUDE = embed·scale → prelude layers (flat KV plane) → state x0 ‖ injection e;
RECURRENT = x ← adapter([x, e]) → core layers (the depth's KV plane);
CODA = ln_f → coda layers (flat plane) → ln_f → lm_head.
"""

from __future__ import annotations

import torch
from torch import nn

from loopserve.model.base import LoopedModel, LoopParams
from loopserve.model.batch import LoopState, ModelBatch
from loopserve.model.config import HuginnConfig
from loopserve.model.layers import Attend, RMSNorm, Rope, Rotation, swiglu
from loopserve.model.paged_kv import KVSpec, PagedKVCache

_M = 2147483647  # 2^31 - 1: products of two residues fit in int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    for mult in (48271, 69621, 40692):
        x = (x * mult) % _M
        x = x ^ (x >> 11)
    return x


def seeded_normal(seeds: torch.Tensor, positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Standard normals [T, dim] that are a pure function of (seed, position, channel).

    A counter-based hash (no generator state), so a row's initial state never depends on
    which rows share its batch, on the device, or on whether it was prefilled elsewhere.
    """
    ch = torch.arange(dim, device=seeds.device, dtype=torch.int64)[None, :]
    base = _mix(seeds[:, None] % _M + 1)
    base = _mix((base + positions[:, None] * 7919) % _M)
    u1 = (_mix((base + ch * 104729) % _M).double() + 0.5) / _M
    u2 = (_mix((base + ch * 104729 + 15485863) % _M).double() + 0.5) / _M
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)).float()


class HuginnAttention(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
        self.Wqkv = nn.Linear(cfg.n_embd, (self.h + 2 * self.hkv) * self.hd, bias=False)
        if cfg.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.h, self.hd))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.scale = self.hd ** -0.5

    def forward(self, x: torch.Tensor, rot: Rotation, attend: Attend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.Wqkv(x).split([self.h * self.hd, self.hkv * self.hd, self.hkv * self.hd], -1)
        q, k, v = q.view(t, self.h, self.hd), k.view(t, self.hkv, self.hd), v.view(t, self.hkv, self.hd)
        if hasattr(self, "qk_bias"):
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        return self.proj(attend(q, k, v, rot).reshape(t, -1))


class GatedMLP(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 2 * cfg.intermediate_size, bias=False)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(swiglu(*self.fc(x).chunk(2, dim=-1)))


class SandwichBlock(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        e, eps = cfg.n_embd, cfg.norm_eps
        self.norm_1, self.attn, self.norm_2 = RMSNorm(e, eps), HuginnAttention(cfg), RMSNorm(e, eps)
        self.mlp, self.norm_3, self.norm_4 = GatedMLP(cfg), RMSNorm(e, eps), RMSNorm(e, eps)

    def forward(self, x: torch.Tensor, rot: Rotation, attend: Attend) -> torch.Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), rot, attend) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class HuginnModel(LoopedModel):
    coda_writes_kv = True

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.config = cfg
        e = cfg.n_embd
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab, e),
            prelude=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_prelude)),
            adapter=nn.Linear(2 * e, e, bias=cfg.bias),
            core_block=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_recurrent_block)),
            coda=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_coda)),
            ln_f=RMSNorm(e, cfg.norm_eps),
        ))
        self.lm_head = nn.Linear(e, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.rope = Rope(cfg.head_dim, cfg.rope_base, interleaved=True)
        self.kv_spec = KVSpec(cfg.n_layers_in_prelude + cfg.n_layers_in_coda,
                              cfg.n_layers_in_recurrent_block, cfg.kv_heads, cfg.head_dim)
        self.state_dim = 2 * e
        self.vocab_size = cfg.vocab
        self.max_loops = cfg.loop_max
        thr = 1.0 if cfg.exit_threshold is None else cfg.exit_threshold
        self.default_loop_params = LoopParams(cfg.min_loops, cfg.loop_max, thr)
        self.embed_scale = float(cfg.init_values.get("embed_scale", 1.0))
        self.state_std = float(cfg.init_values.get("std", 0.02))

    # -- shared pieces (paged path and dense reference) ---------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(token_ids)
        return x * self.embed_scale if self.embed_scale != 1 else x

    def initial_state(self, seeds: torch.Tensor, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.config.state_init == "zero":
            return torch.zeros_like(like)
        z = seeded_normal(seeds, positions, like.shape[-1]).clamp_(-3, 3)
        return (z * self.state_std * self.embed_scale).to(like.dtype)

    def prefix_cache_seeded(self) -> bool | None:
        """A seeded random initial state makes every token's K/V depend on the request's seed."""
        return self.config.state_init != "zero"

    def loop_input(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.transformer.adapter(torch.cat([x, e], dim=-1))

    @staticmethod
    def convergence(x_new: torch.Tensor, x_old: torch.Tensor) -> torch.Tensor:
        diff = (x_new.float() - x_old.float()).norm(dim=-1)
        return 1.0 - diff / x_new.float().norm(dim=-1).clamp_min(1e-12)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(x)).float()

    # -- Operations ------------------------------------------------------------------------
    def prelude(self, batch: ModelBatch, kv: PagedKVCache) -> LoopState:
        x, rot = self.embed(batch.token_ids), self.rope(batch.positions)
        for i, blk in enumerate(self.transformer.prelude):
            x = blk(x, rot, self.paged_attend(batch, kv, "flat", i, blk.attn.scale))
        x0 = self.initial_state(batch.seeds, batch.positions, x)
        return LoopState(torch.cat([x0, x], dim=-1), torch.zeros(x.shape[0], device=x.device))

    def recurrent(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> tuple[LoopState, torch.Tensor]:
        x_old, e = state.hidden.chunk(2, dim=-1)
        x, rot = self.loop_input(x_old, e), self.rope(batch.positions)
        for j, blk in enumerate(self.transformer.core_block):
            x = blk(x, rot, self.paged_attend(batch, kv, "looped", j, blk.attn.scale))
        return LoopState(torch.cat([x, e], dim=-1), state.aux), self.convergence(x, x_old)

    def coda(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> torch.Tensor:
        x = self.transformer.ln_f(state.hidden[:, : self.config.n_embd])
        base, rot = self.config.n_layers_in_prelude, self.rope(batch.positions)
        for i, blk in enumerate(self.transformer.coda):
            x = blk(x, rot, self.paged_attend(batch, kv, "flat", base + i, blk.attn.scale))
        return self.head(x.index_select(0, batch.logits_indices))
