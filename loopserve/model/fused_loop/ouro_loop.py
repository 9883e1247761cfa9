"""OuroFusedLoop: an Ouro model's RECURRENT Operation as one persistent kernel (kernel.py)
for decode-shaped batches, with the layers' weights stacked so the kernel indexes them by
layer.

Stacking re-points every layer's parameters at their slice of one [L, ...] tensor per kind
(as `MergedLinear` does per layer), so state_dict names, in-place checkpoint loads and the
unfused path see the same storage; if any parameter is replaced (`.to()`, a new load), the
next call stacks again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from loopserve.intmath import cdiv
from loopserve.model.attention.triton_backend import _INTERPRET as INTERPRET
from loopserve.model.attention.triton_backend import _MAX_SPLITS, _num_sms, _pow2_floor
from loopserve.model.batch import LoopState, ModelBatch
from loopserve.model.fused_loop.kernel import PHASES_PER_LAYER, ouro_loop_kernel
from loopserve.model.paged_kv import PagedKVCache

_ROW_TILES = (16, 8, 4)  # GEMV tile heights, taller first
_NUM_STAGES = 3  # software-pipelining depth of the kernel's loops: the measured configuration


def row_tile(n: int, programs: int) -> int:
    """The GEMV tile height that leaves the busiest program the fewest rows (ties: taller,
    which reads more bytes per K chunk)."""
    return min(_ROW_TILES, key=lambda bn: cdiv(cdiv(n, bn), programs) * bn)


def num_splits(rows: int, kv_heads: int, programs: int, max_context_len: int, min_len: int) -> int:
    """KV splits per (row, head): enough items to cover the programs, ≥ min_len positions
    each (the kernel's KV tile: a split's tiles are one dependent L2/DRAM chain, and the
    merge reads every split's partials in one step, so splits are cheap here)."""
    want = programs // max(rows * kv_heads, 1)
    return max(1, min(_pow2_floor(want), _pow2_floor(max(max_context_len // min_len, 1)), _MAX_SPLITS))


@dataclass
class _Stacked:
    qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [L, H, Hq D]
    gate_up: torch.Tensor  # [L, 2 I, H]
    down: torch.Tensor  # [L, H, I]
    norms: torch.Tensor  # [L, 4 H]: input_layernorm(_2), post_attention_layernorm(_2)
    ptrs: list[int]


class OuroFusedLoop:
    """`num_programs`: the persistent grid (default: one program per SM, all resident at
    once; on the interpreter 1). `use_barrier` False launches one phase at a time (the
    interpreter needs that: its programs run one after another)."""

    def __init__(self, model, max_rows: int = 8, num_programs: int | None = None,
                 use_barrier: bool | None = None, block_k: int = 512, num_warps: int = 16,
                 phase_times: bool = False) -> None:
        cfg = model.config
        if cfg.num_attention_heads % cfg.kv_heads or cfg.hd % 2:
            raise ValueError(f"fused loop needs Hq % Hkv == 0 and an even head_dim, got Hq="
                             f"{cfg.num_attention_heads}, Hkv={cfg.kv_heads}, head_dim={cfg.hd}")
        dev = next(model.parameters()).device
        if dev.type != "cuda" and not INTERPRET:
            raise ValueError(f"the fused loop runs on CUDA (or on CPU under TRITON_INTERPRET=1); the model is on {dev}")
        if not 1 <= max_rows <= 64:
            raise ValueError(f"max_rows={max_rows} must be in [1, 64]")
        self.model = model
        self.n_phases = PHASES_PER_LAYER * cfg.num_hidden_layers + 1  # the kernel's phase span of a whole loop
        self.max_rows = max_rows
        self.num_programs = num_programs
        self.use_barrier = (not INTERPRET) if use_barrier is None else use_barrier
        if self.use_barrier and INTERPRET:
            raise ValueError("use_barrier needs concurrent programs; the Triton interpreter runs them in turn")
        self.block_k = block_k
        self.num_warps = num_warps
        if phase_times and INTERPRET:
            raise ValueError("phase_times reads the GPU's clock (PTX): not under the Triton interpreter")
        # when set, each launch fills last_phase_times [phases, programs, 3] (ns; kernel.py's _stamp)
        self.phase_times = phase_times
        self.last_phase_times: torch.Tensor | None = None
        self._stacked: _Stacked | None = None
        self._grids: dict[int, int] = {}  # padded rows -> the barrier grid that fits
        self.runs = 0  # loops run (launches, when not replayed from a graph)

    # ------------------------------------------------------------------ weights
    def _params(self) -> list[torch.Tensor]:
        out = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                    m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight,
                    layer.input_layernorm.weight, layer.input_layernorm_2.weight,
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm_2.weight]
        return out

    @torch.no_grad()
    def _stack(self) -> _Stacked:
        layers = self.model.model.layers
        w0 = layers[0].self_attn.q_proj.weight
        for layer in layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                if lin.bias is not None:
                    raise ValueError("the fused loop has no linear biases (Ouro has none)")
            for norm in (layer.input_layernorm, layer.input_layernorm_2, layer.post_attention_layernorm,
                         layer.post_attention_layernorm_2):
                if norm.eps != self.model.config.rms_norm_eps:
                    raise ValueError(f"norm eps {norm.eps} != rms_norm_eps {self.model.config.rms_norm_eps}")

        def stack(parts_of) -> torch.Tensor:
            """One [L, ...] tensor of each layer's parts concatenated; the parts become views."""
            parts0 = parts_of(layers[0])
            shape = (sum(p.shape[0] for p in parts0), *parts0[0].shape[1:])
            buf = torch.empty((len(layers), *shape), dtype=w0.dtype, device=w0.device)
            for i, layer in enumerate(layers):
                parts = parts_of(layer)
                buf[i].copy_(torch.cat([p.data for p in parts]))
                for p, view in zip(parts, buf[i].split([p.shape[0] for p in parts])):
                    p.data = view
            return buf

        def stack_merged(merged_of) -> torch.Tensor:
            """The same for a MergedLinear, which adopts its slice (so it does not merge again)."""
            m0 = merged_of(layers[0])
            buf = torch.empty((len(layers), sum(m0.sizes), m0.parts[0].in_features), dtype=w0.dtype,
                              device=w0.device)
            for i, layer in enumerate(layers):
                merged_of(layer).adopt(buf[i])
            return buf

        st = _Stacked(
            qkv=stack_merged(lambda y: y.self_attn.qkv),
            o=stack(lambda y: [y.self_attn.o_proj.weight]),
            gate_up=stack_merged(lambda y: y.mlp.gate_up),
            down=stack(lambda y: [y.mlp.down_proj.weight]),
            norms=stack(lambda y: [n.weight for n in (
                y.input_layernorm, y.input_layernorm_2, y.post_attention_layernorm, y.post_attention_layernorm_2)]),
            ptrs=[])
        st.ptrs = [p.data_ptr() for p in self._params()]
        return st

    def stacked(self) -> _Stacked:
        if self._stacked is None or self._stacked.ptrs != [p.data_ptr() for p in self._params()]:
            self._stacked = None  # drop the old stack before building the new one
            self._stacked = self._stack()
        return self._stacked

    # ------------------------------------------------------------------ launch
    def applies(self, batch: ModelBatch, kv: PagedKVCache) -> bool:
        """Decode-shaped (one row per segment), at most max_rows rows (the constructor checked
        that the model is where the kernel runs)."""
        t = batch.num_rows
        return 0 < t <= self.max_rows and len(batch.attn.seg_bounds) == t

    def __call__(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> tuple[LoopState, torch.Tensor]:
        n_phases, dev = self.n_phases, state.hidden.device

        def launch(progs: int, spans: list[tuple[int, int]], warmup: bool = False):
            """Every span's launch on one workspace (warmup: compile only, return the kernel)."""
            args, consts, outs = self.launch_args(batch, state, kv, progs, run=not warmup)
            if warmup:
                return ouro_loop_kernel.warmup(*args, *spans[0], grid=(progs,), **consts)
            for lo, hi in spans:
                ouro_loop_kernel[(progs,)](*args, lo, hi, **consts)
            return outs

        if not self.use_barrier:
            out, rem_out, score = launch(self.num_programs or (1 if INTERPRET else _num_sms(dev)),
                                         [(p, p + 1) for p in range(n_phases)])
        else:
            everything = [(0, n_phases)]
            rows = triton.next_power_of_2(batch.num_rows)
            out, rem_out, score = launch(
                self._resident_grid(rows, dev, lambda progs: launch(progs, everything, warmup=True)), everything)
        self.runs += 1
        return LoopState(out, rem_out), score

    def launch_args(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache, progs: int,
                    run: bool = True) -> tuple[tuple, dict, tuple[torch.Tensor, ...]]:
        """The kernel's arguments but the phase span, its constexprs and launch options, and its
        outputs (normed hidden, Π(1-σ), score), on a fresh workspace for a `progs`-program grid
        (run False: only to compile, so the counters are not zeroed nor phase times kept)."""
        m, cfg = self.model, self.model.config
        st = self.stacked()
        hidden = state.hidden
        dev = hidden.device
        t, h, inter = batch.num_rows, cfg.hidden_size, cfg.intermediate_size
        hq, hkv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.hd
        bb = triton.next_power_of_2(t)
        nqkv = (hq + 2 * hkv) * d
        out = torch.empty_like(hidden)
        rem_out = torch.empty(t, dtype=torch.float32, device=dev)
        score = torch.empty(t, dtype=torch.float32, device=dev)
        rot = m.rope(batch.positions)
        cache, meta, gate = kv.looped, batch.attn, m.model.early_exit_gate
        block_g, block_d = triton.next_power_of_2(hq // hkv), triton.next_power_of_2(d)
        block_n = max(16, min(64, 4096 // (block_g * block_d)))  # attention's KV tile
        splits = num_splits(t, hkv, progs, meta.max_context_len, block_n)
        sizes = [2 * bb * h, bb * h, bb * nqkv, bb * 2 * inter, splits * t * hq * d, splits * t * hq,
                 splits * t * hq, bb * hq * d, progs * bb * h, 1 + t * hkv]
        ws = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
        xres, delta, qkv, gu, acc, m_part, l_part, merged, scratch, count = ws.split(sizes)
        count = count.view(torch.int32)  # the grid barrier's counter, then the merge tickets
        if run:
            count.zero_()
        times = None
        if run and self.phase_times:
            times = self.last_phase_times = torch.full((self.n_phases, progs, 3), -1, dtype=torch.int64, device=dev)
        bn = {kind: row_tile(n, progs) for kind, n in (("qkv", nqkv), ("o", h), ("gate_up", 2 * inter), ("down", h))}
        args = (hidden, hidden.stride(0), out, state.aux, rem_out, score,
                meta.positions, meta.slot_mapping, meta.block_tables, meta.block_tables.stride(0),
                rot.cos, rot.sin, rot.cos.stride(0), cache, kv.scales["looped"] if kv.quantized else cache,
                *cache.stride(),
                st.qkv, st.o, st.gate_up, st.down, st.norms, m.model.norm.weight, gate.weight, gate.bias,
                xres, delta, qkv, gu, acc, m_part, l_part, merged, scratch, bb * h, count, times,
                t, splits, m.model.layers[0].self_attn.scale * math.log2(math.e), cfg.rms_norm_eps)
        consts = dict(
            L=cfg.num_hidden_layers, H=h, I=inter, HQ=hq, HKV=hkv, HEAD_D=d, PAGE=meta.block_size,
            BLOCK_B=bb, BLOCK_H=triton.next_power_of_2(h), BLOCK_G=block_g,
            BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
            BN_QKV=bn["qkv"], BN_O=bn["o"], BN_GU=bn["gate_up"], BN_DOWN=bn["down"], BK=self.block_k,
            PHASES=PHASES_PER_LAYER, USE_BARRIER=self.use_barrier, TIMING=times is not None,
            KV_FP8=kv.quantized, num_warps=self.num_warps, num_stages=_NUM_STAGES)
        return args, consts, (out, rem_out, score)

    def _resident_grid(self, rows: int, dev: torch.device, compile_for) -> int:
        """The barrier's grid: `num_programs`, or one program per SM — if the compiled kernel's
        registers, shared memory and threads let the GPU hold them all at once (a program that
        cannot be resident would leave the others spinning forever)."""
        if rows in self._grids:
            return self._grids[rows]
        sms = _num_sms(dev)
        progs = self.num_programs or sms
        fits = sms * resident_per_sm(compile_for(progs), self.num_warps, dev)
        if progs > fits:
            raise RuntimeError(f"the fused loop kernel's {progs} programs do not fit on the GPU at once "
                               f"({fits} do): lower num_warps or block_k")
        self._grids[rows] = progs
        return progs


def resident_per_sm(kernel, num_warps: int, dev: torch.device) -> int:
    """Programs of a compiled Triton kernel one SM holds at once (registers are allocated per
    warp in units of 256)."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(dev)
    regs_per_warp = cdiv(kernel.n_regs * 32, 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(regs_per_warp * num_warps, 1)
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // max(kernel.metadata.shared, 1)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
    return min(by_regs, by_smem, by_threads, 32)
