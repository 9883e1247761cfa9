"""Ouro-style looped model (`OuroForCausalLM` key names).

PRELUDE = embedding; RECURRENT = every layer (the depth's KV plane) → shared norm → exit
gate, score 1 − Π(1 − σ(gate)); CODA = lm_head on the exit loop's normed hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loopserve.model.base import LoopedModel, LoopParams
from loopserve.model.batch import LoopState, ModelBatch
from loopserve.model.config import OuroConfig
from loopserve.model.layers import (Attend, MergedLinear, RMSNorm, Rope, Rotation, add_rms_norm,
                                    exit_gate_update, swiglu)
from loopserve.model.paged_kv import KVSpec, PagedKVCache


class OuroAttention(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.kv_heads, cfg.hd
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)
        self.scale = self.hd ** -0.5
        self.qkv = MergedLinear(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rot: Rotation, attend: Attend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x)
        o = attend(q.view(t, self.h, self.hd), k.view(t, self.hkv, self.hd), v.view(t, self.hkv, self.hd), rot)
        return self.o_proj(o.reshape(t, -1))


class OuroMLP(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = MergedLinear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(*self.gate_up(x)))


class OuroDecoderLayer(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn, self.mlp = OuroAttention(cfg), OuroMLP(cfg)
        self.input_layernorm, self.input_layernorm_2 = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm, self.post_attention_layernorm_2 = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, rot: Rotation, attend: Attend, normed: torch.Tensor | None = None,
                next_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x out, next_norm(x out)); `normed` is input_layernorm(x) when the layer before
        computed it in its last kernel (one kernel per layer fewer)."""
        a = self.self_attn(self.input_layernorm(x) if normed is None else normed, rot, attend)
        x, h = add_rms_norm(x, a, self.input_layernorm_2, self.post_attention_layernorm)
        return add_rms_norm(x, self.mlp(h), self.post_attention_layernorm_2, next_norm)


class _OuroBody(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)


class OuroModel(LoopedModel):
    coda_writes_kv = False

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _OuroBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(cfg.hd, cfg.rope_theta, interleaved=False)
        self.kv_spec = KVSpec(0, cfg.num_hidden_layers, cfg.kv_heads, cfg.hd)
        self.state_dim = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_loops = cfg.loop_max
        thr = cfg.early_exit_threshold if cfg.exit_threshold is None else cfg.exit_threshold
        self.default_loop_params = LoopParams(cfg.min_loops, cfg.loop_max, thr)
        self.fused_loop = None  # OuroFusedLoop when decode loops run as one kernel

    def use_fused_loop(self, max_rows: int) -> bool:
        if max_rows == 0:
            self.fused_loop = None
        else:
            from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop  # Triton: only when asked
            self.fused_loop = OuroFusedLoop(self, max_rows)
            # Stack the weights now: stacking later moves them, freeing the storage that CUDA
            # graphs of the per-layer path captured before (an illegal memory access on replay).
            self.fused_loop.stacked()
        return True

    def end_of_loop(self, h: torch.Tensor, remaining: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exit gate on the normed hidden: (new Π(1-σ), score = 1 - Π(1-σ))."""
        return exit_gate_update(self.model.early_exit_gate(h).squeeze(-1), remaining)

    def run_layers(self, h: torch.Tensor, rot: Rotation, attend_of: Callable[[int, OuroDecoderLayer], Attend]) -> torch.Tensor:
        """One loop over the layer stack, then the shared norm (paged path and dense
        reference); each layer's last kernel also computes the next norm."""
        layers, normed = self.model.layers, None
        for j, layer in enumerate(layers):
            nxt = layers[j + 1].input_layernorm if j + 1 < len(layers) else self.model.norm
            h, normed = layer(h, rot, attend_of(j, layer), normed, nxt)
        return normed

    def prelude(self, batch: ModelBatch, kv: PagedKVCache) -> LoopState:
        h = self.model.embed_tokens(batch.token_ids)
        return LoopState(h, torch.ones(h.shape[0], device=h.device))

    def recurrent(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> tuple[LoopState, torch.Tensor]:
        if self.fused_loop is not None and self.fused_loop.applies(batch, kv):
            return self.fused_loop(batch, state, kv)
        h = self.run_layers(state.hidden, self.rope(batch.positions),
                            lambda j, layer: self.paged_attend(batch, kv, "looped", j, layer.self_attn.scale))
        remaining, score = self.end_of_loop(h, state.aux)
        return LoopState(h, remaining), score

    def coda(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> torch.Tensor:
        return self.lm_head(state.hidden.index_select(0, batch.logits_indices)).float()
