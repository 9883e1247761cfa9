"""Dory (transformers' `DoryForCausalLM` key names): an nGPT-style looped model.

PRELUDE = embed_tokens → input layers (flat KV plane, flat index = layer index) → state
(h ‖ input_hidden = norm(h));
RECURRENT (one loop) = h ← norm(h) + input_hidden → recurrent layers (looped pool, layer j);
no exit gate (score 0: a fixed loop count per request);
CODA = output layers (flat plane, flat index n_input + j) → norm → DoryLMHead.

KV modes (`recurrent_kv_cache_mode`): "per_loop" keeps one looped plane per loop (like Ouro);
"last_loop" keeps ONE plane that every loop writes and reads: each loop overwrites the
current tokens' slots, so later tokens see the last loop's K/V (transformers' semantics as
long as a prompt is processed in one piece). `kv_planes` / `plane_of_depth` tell the
engine how many planes a request holds and which plane loop d uses.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from loopserve.model.base import LoopedModel, LoopParams
from loopserve.model.batch import LoopState, ModelBatch
from loopserve.model.config import DoryConfig
from loopserve.model.layers import Attend, MergedLinear, Rope, Rotation
from loopserve.model.paged_kv import KVSpec, PagedKVCache


_PAIR = re.compile(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")


def checkpoint_key(key: str) -> str:
    """A Dory checkpoint name -> transformers' DoryForCausalLM state_dict name: the same
    renames as transformers' "dory" conversion mapping. Covers the original two-block
    layout (`backbone.layers.{2i}.mixer.*` attention, `{2i+1}.mixer.*` mlp, `attn_alpha`,
    `mlp_alpha`), `save_pretrained`'s (`backbone.`, `embeddings`, `g_proj`) and
    state_dict names (unchanged)."""
    if (m := _PAIR.search(key)) is not None:
        index, name = int(m[1]), m[2]
        name = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(name, ("self_attn", "mlp")[index % 2])
        key = key[: m.start()] + f"layers.{index // 2}.{name}" + key[m.end():]
    key = re.sub(r"\.self_attn\.g_proj\.", ".self_attn.gate_proj.", key)
    key = re.sub(r"^backbone\.", "model.", key)
    return re.sub(r"\.embeddings\.", ".embed_tokens.", key)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit-sphere projection (no weight), computed in fp32 like DoryL2Norm."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class DoryAttention(nn.Module):
    def __init__(self, cfg: DoryConfig, layer_idx: int) -> None:
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        e, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(e, self.h * self.hd, bias=b)
        self.k_proj = nn.Linear(e, self.hkv * self.hd, bias=b)
        self.v_proj = nn.Linear(e, self.hkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.h * self.hd, e, bias=b)
        self.gate_proj = nn.Linear(e, self.h * self.hd, bias=False)
        ir = cfg.initializer_range
        self.sqk = nn.Parameter(torch.full((self.h * self.hd,), ir))
        self.s_gate = nn.Parameter(torch.full((self.h * self.hd,), ir))
        self.sqk_scale = self.hd ** 0.5 / ir
        self.s_gate_scale = e ** 0.25 / ir
        self.scale = self.hd ** -0.5
        self.window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None
        self.qkvg = MergedLinear(self.q_proj, self.k_proj, self.v_proj, self.gate_proj)

    def forward(self, x: torch.Tensor, rot: Rotation, attend: Attend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v, gate = self.qkvg(x)
        q = rot(l2norm(q.view(t, self.h, self.hd)))
        k = rot(l2norm(k.view(t, self.hkv, self.hd)))
        v = v.view(t, self.hkv, self.hd)
        q = q * (self.sqk * self.sqk_scale).view(self.h, self.hd).square()
        o = attend(q, k, v).reshape(t, -1)
        o = o * torch.sigmoid(gate * (self.s_gate * self.s_gate_scale).square())
        return self.o_proj(l2norm(o))


class DoryMLP(nn.Module):
    def __init__(self, cfg: DoryConfig) -> None:
        super().__init__()
        e, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(e, i, bias=b)
        self.up_proj = nn.Linear(e, i, bias=b)
        self.down_proj = nn.Linear(i, e, bias=b)
        self.suv_gate = nn.Parameter(torch.ones(i))
        self.suv_up = nn.Parameter(torch.ones(i))
        self.suv_scale = e ** 0.5
        self.gate_up = MergedLinear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        gate = gate * (self.suv_gate * self.suv_scale)
        up = up * (self.suv_up * self.suv_scale)
        return self.down_proj(l2norm(F.silu(gate) * up))


class DoryDecoderLayer(nn.Module):
    """Sandwich layer on the unit sphere: residual = interpolation at rate |λ·scale|."""

    def __init__(self, cfg: DoryConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_type = cfg.layer_types[layer_idx]
        self.self_attn = DoryAttention(cfg, layer_idx)
        self.mlp = DoryMLP(cfg)
        ir = cfg.initializer_range
        self.lambda_1 = nn.Parameter(torch.full((cfg.hidden_size,), ir))
        self.lambda_2 = nn.Parameter(torch.full((cfg.hidden_size,), ir))
        self.lambda_scale = cfg.ngpt_alpha_init / ir

    def forward(self, x: torch.Tensor, rot: Rotation, attend: Attend) -> torch.Tensor:
        x = l2norm(x)
        a = l2norm(self.self_attn(x, rot, attend))
        x = x + (self.lambda_1 * self.lambda_scale).abs() * (a - x)
        x = l2norm(x)
        m = l2norm(self.mlp(x))
        return x + (self.lambda_2 * self.lambda_scale).abs() * (m - x)


class DoryLMHead(nn.Linear):
    def __init__(self, cfg: DoryConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logit_scale = nn.Parameter(torch.full((cfg.vocab_size,), cfg.initializer_range))
        self.logit_scale_factor = 1 / cfg.initializer_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).float() * (self.logit_scale.float() * self.logit_scale_factor)


class _DoryBody(nn.Module):
    def __init__(self, cfg: DoryConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DoryDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))


class DoryModel(LoopedModel):
    def __init__(self, cfg: DoryConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _DoryBody(cfg)
        self.lm_head = DoryLMHead(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ropes = nn.ModuleDict({t: Rope(cfg.head_dim, cfg.rope_theta(t), interleaved=False)
                                    for t in sorted(set(cfg.layer_types))})
        self.kv_spec = KVSpec(cfg.n_input_layers + cfg.n_output_layers, cfg.n_recurrent_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.coda_writes_kv = cfg.n_output_layers > 0
        self.state_dim = 2 * cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_loops = cfg.loop_max
        thr = 1.0 if cfg.exit_threshold is None else cfg.exit_threshold
        self.default_loop_params = LoopParams(cfg.min_loops, cfg.loop_max, thr)
        self.last_loop_kv = cfg.recurrent_kv_cache_mode == "last_loop"

    @staticmethod
    def rename_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {checkpoint_key(k): v for k, v in tensors.items()}

    @property
    def input_layers(self) -> list[DoryDecoderLayer]:
        return list(self.model.layers[: self.config.n_input_layers])

    @property
    def recurrent_layers(self) -> list[DoryDecoderLayer]:
        n_in = self.config.n_input_layers
        return list(self.model.layers[n_in:n_in + self.config.n_recurrent_layers])

    @property
    def output_layers(self) -> list[DoryDecoderLayer]:
        return list(self.model.layers[self.config.n_input_layers + self.config.n_recurrent_layers:])

    # -- KV planes (the engine/scheduler must use these) ----------------------------------
    def kv_planes(self, max_loops: int) -> int:
        """Looped KV planes a request running up to `max_loops` loops holds."""
        return 1 if self.last_loop_kv else max_loops

    def plane_of_depth(self, depth: int) -> int:
        """1-based plane that loop `depth` writes and reads."""
        return 1 if self.last_loop_kv else depth

    def prefix_cache_seeded(self) -> bool | None:
        """last_loop: a prompt token's loop-d attention reads the earlier prompt tokens' loop-d
        K/V, but a finished prefix's one plane holds only its last loop's, so a cached prefix
        would change the tokens after it: never cached."""
        return None if self.last_loop_kv else False

    # -- shared pieces (paged path and dense reference) -----------------------------------
    def rotations(self, positions: torch.Tensor) -> dict[str, Rotation]:
        """RoPE angles per layer type, once per Operation."""
        return {t: rope(positions) for t, rope in self.ropes.items()}

    @staticmethod
    def run_layer(layer: DoryDecoderLayer, x: torch.Tensor, rots: dict[str, Rotation],
                  attend: Attend) -> torch.Tensor:
        return layer(x, rots[layer.attention_type], attend)

    @staticmethod
    def loop_input(h: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        return l2norm(h) + inp

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(l2norm(h))

    def _attend(self, batch: ModelBatch, kv: PagedKVCache, kind: str, idx: int, layer: DoryDecoderLayer) -> Attend:
        a = layer.self_attn
        return self.paged_attend(batch, kv, kind, idx, a.scale, a.window)

    # -- Operations ------------------------------------------------------------------------
    def prelude(self, batch: ModelBatch, kv: PagedKVCache) -> LoopState:
        h, rots = self.model.embed_tokens(batch.token_ids), self.rotations(batch.positions)
        for i, layer in enumerate(self.input_layers):
            h = self.run_layer(layer, h, rots, self._attend(batch, kv, "flat", i, layer))
        return LoopState(torch.cat([h, l2norm(h)], dim=-1), torch.zeros(h.shape[0], device=h.device))

    def recurrent(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> tuple[LoopState, torch.Tensor]:
        h, inp = state.hidden.chunk(2, dim=-1)
        h, rots = self.loop_input(h, inp), self.rotations(batch.positions)
        for j, layer in enumerate(self.recurrent_layers):
            h = self.run_layer(layer, h, rots, self._attend(batch, kv, "looped", j, layer))
        score = torch.zeros(h.shape[0], device=h.device, dtype=torch.float32)
        return LoopState(torch.cat([h, inp], dim=-1), state.aux), score

    def coda(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> torch.Tensor:
        h = state.hidden[:, : self.config.hidden_size]
        base, rots = self.config.n_input_layers, self.rotations(batch.positions)
        for j, layer in enumerate(self.output_layers):
            h = self.run_layer(layer, h, rots, self._attend(batch, kv, "flat", base + j, layer))
        return self.head(h.index_select(0, batch.logits_indices))
