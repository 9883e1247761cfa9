"""One Ouro loop (every layer, the shared norm, the exit gate) for a decode batch in one
persistent Triton kernel.

At decode batch sizes a loop is ~270 small launches (four GEMVs, norms, RoPE, attention, its
merge per layer), each paying a DRAM ramp-up and tail plus the gap to the next; here one grid
of `num_programs` programs (one per SM on a GPU) walks the loop's 5·L + 1 phases and meets at
a grid barrier (an atomic counter) between them:

  per layer l   0 qkv:    x' = x + rms(δ)·w_post2[l-1]; h = rms(x')·w_in[l];   QKV = Wqkv[l] h
                1 attn:   RoPE(q, k); the split owning the new position writes k, v to the
                          cache; flash-decoding partials per (row, kv head, split)
                          (the last split of each (row, kv head) merges them)
                2 o:      δ = Wo[l] o
                3 gateup: x'' = x' + rms(δ)·w_in2[l]; h = rms(x'')·w_post[l]; GU = Wgu[l] h
                4 down:   δ = Wdown[l] (silu(GU_gate)·GU_up), SwiGLU applied as the GEMV reads GU
  final         out = rms(x + rms(δ)·w_post2[L-1])·w_norm; the exit gate; Π(1-σ) and score

The qkv and gate/up GEMVs' input vector (the norm) is built by every program that has
tiles, into its own scratch row (a few KiB from L2, cheaper than another barrier); the o
GEMV reads the merged attention, the down GEMV applies SwiGLU to GU as it reads it; program 0 also writes the residual,
ping-ponging between two buffers so no program reads a row being rewritten. Every program
must be resident at once for the barrier to complete: the launcher uses at most one program
per SM. Without USE_BARRIER the host launches one phase at a time (the CPU twin under
TRITON_INTERPRET=1, whose programs run one after another, and an A/B mode on the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loopserve.model.attention.triton_kv_write import _rotated
from loopserve.model.attention.triton_paged_attn import kv_scales, kv_tile, to_cache

PHASES_PER_LAYER = 5  # the kernel's PHASES argument


@triton.jit
def _grid_barrier(Count, target):
    """Every program's writes so far are visible to every program after this."""
    tl.debug_barrier()
    tl.atomic_add(Count, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(Count, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(Count, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(Times, ph, pid, num_progs, j: tl.constexpr, TIMING: tl.constexpr):
    """Times[ph, pid, j] = the GPU's nanosecond clock (%globaltimer), when TIMING: where a
    phase's time goes (j 0: start, 1: input vector built, 2: work done, before the barrier)."""
    if TIMING:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([1], tl.int32)],
                                      dtype=tl.int64, is_pure=False, pack=1)
        tl.store(Times + (ph * num_progs + pid) * 3 + j + tl.arange(0, 1), t)


@triton.jit
def _rms(x, mask, n, eps):
    """x · rsqrt(mean(x²) + eps) over the masked last axis (fp32)."""
    ss = tl.sum(tl.where(mask, x * x, 0.0), axis=1) / n
    return x * tl.rsqrt(ss + eps)[:, None]


@triton.jit
def _add_norm(X, s_x, Delta, W1, W2, XOut, Scratch, num_rows, H, eps, has_delta, write_x,
              BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """x' = x + rms(δ)·w1 (x when not has_delta); Scratch = rms(x')·w2; XOut = x' if write_x."""
    b = tl.arange(0, BLOCK_B)
    c = tl.arange(0, BLOCK_H)
    mask = (b < num_rows)[:, None] & (c < H)[None, :]
    x = tl.load(X + b[:, None] * s_x + c[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if has_delta:
        d = tl.load(Delta + b[:, None] * H + c[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        w1 = tl.load(W1 + c, mask=c < H, other=0.0).to(tl.float32)
        x = x + _rms(d, mask, H, eps) * w1[None, :]
    if write_x:
        tl.store(XOut + b[:, None] * H + c[None, :], x, mask=mask)
    w2 = tl.load(W2 + c, mask=c < H, other=0.0).to(tl.float32)
    tl.store(Scratch + b[:, None] * H + c[None, :], _rms(x, mask, H, eps) * w2[None, :], mask=mask)
    tl.debug_barrier()  # the GEMV's threads read other threads' scratch entries


@triton.jit
def _w_chunk(rows, k, K, n_mask):
    """W[n, k] of a tile's rows (`rows`: their row pointers), streamed past L1."""
    return tl.load(rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _gemv(W, N, K, Xs, Y, num_rows, pid, num_progs,
          BLOCK_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XSRC: tl.constexpr):
    """Y[b, :N] = W[N, K] · x[b, :K] for b < num_rows (x: _x_chunk of Xs); tiles of BN rows,
    grid-strided. fp32 FMAs into a [BN, BK] accumulator per row, reduced once per tile; the
    next K chunk of W and of x are loaded before the current ones are used, so two chunks of
    W are in flight per program. (The variants tried beside it, and which measured slower:
    docs/design.md, "GEMVs".)"""
    kk = tl.arange(0, BK)
    for t in range(pid, tl.cdiv(N, BN), num_progs):
        n = t * BN + tl.arange(0, BN)
        n_mask = n < N
        rows = W + n[:, None].to(tl.int64) * K
        b_idx = tl.arange(0, BLOCK_B)
        acc = tl.zeros([BLOCK_B, BN], tl.float32)
        for r in tl.static_range(BLOCK_B):
            acc2 = tl.zeros([BN, BK], tl.float32)
            w = _w_chunk(rows, kk, K, n_mask)
            x = _x_chunk(Xs, r, kk, K, (kk < K) & (kk * 0 + r < num_rows), XSRC)
            for k0 in range(0, K, BK):
                k_next = k0 + BK + kk
                w_next = _w_chunk(rows, k_next, K, n_mask)
                x_next = _x_chunk(Xs, r, k_next, K, (k_next < K) & (k_next * 0 + r < num_rows), XSRC)
                acc2 += w.to(tl.float32) * x[None, :]
                w = w_next
                x = x_next
            acc = tl.where(b_idx[:, None] == r, acc + tl.sum(acc2, axis=1)[None, :], acc)
        tl.store(Y + b_idx[:, None] * N + n[None, :], acc, mask=(b_idx < num_rows)[:, None] & n_mask[None, :])


@triton.jit
def _attention(QKV, Cache, KVScale, Positions, Slots, Tables, s_tab, Cos, Sin, s_cos, Acc, MPart,
               LPart, Tickets, Merged, layer, num_rows, num_splits, qk_scale, pid, num_progs,
               sc_blk, sc_kv, sc_off, sc_h, sc_d,
               HQ: tl.constexpr, HKV: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
               KV_FP8: tl.constexpr):
    """Flash-decoding partials (unnormalised acc, max, sum in the log2 domain) of every
    (row, kv head, split); the split holding a row's position first writes its k, v. The
    last split of a (row, kv head) to finish (a ticket per pair, counting on over layers)
    merges them into Merged: once, where every o-phase program merging all of them for
    itself read the same lines at once (L2 slice hot spot: 13-47 us a phase). An FP8 cache:
    k, v quantized on the write; k_scale folded into the scores, v_scale into the partials."""
    G: tl.constexpr = HQ // HKV
    NQKV: tl.constexpr = (HQ + 2 * HKV) * HEAD_D
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_D
    g = tl.arange(0, BLOCK_G)
    g_mask = g < G
    pair = d % (HEAD_D // 2)
    k_scale, v_scale = kv_scales(KVScale, KV_FP8)
    for item in range(pid, num_rows * HKV * num_splits, num_progs):
        split = item % num_splits
        kvh = (item // num_splits) % HKV
        row = item // (num_splits * HKV)
        pos = tl.load(Positions + row)
        slot = tl.load(Slots + row).to(tl.int64)
        kv_hi = pos + 1
        chunk = tl.cdiv(tl.cdiv(kv_hi, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(kv_hi, lo + chunk)
        cos = tl.load(Cos + row * s_cos + pair, mask=d_mask, other=0.0)
        sin = tl.load(Sin + row * s_cos + pair, mask=d_mask, other=0.0)
        base = QKV + row * NQKV
        head = kvh * G + g
        q = _rotated(base, HEAD_D, 1, head, d, g_mask[:, None] & d_mask[None, :], cos, sin,
                     HEAD_D // 2, False)
        cache = Cache + kvh * sc_h
        if (pos >= lo) & (pos < hi) & (slot >= 0):
            one = tl.arange(0, 1)
            k_new = _rotated(base + HQ * HEAD_D + kvh * HEAD_D, HEAD_D, 1, one, d, d_mask[None, :],
                             cos, sin, HEAD_D // 2, False)
            v_new = tl.load(base + (HQ + HKV) * HEAD_D + kvh * HEAD_D + d, mask=d_mask, other=0.0)
            dst = cache + (slot // PAGE) * sc_blk + (slot % PAGE) * sc_off + d * sc_d
            tl.store(dst[None, :], to_cache(k_new, k_scale, Cache.dtype.element_ty, KV_FP8),
                     mask=d_mask[None, :])
            tl.store(dst + sc_kv, to_cache(v_new, v_scale, Cache.dtype.element_ty, KV_FP8), mask=d_mask)
            tl.debug_barrier()  # this program reads the slot back below
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            k, v, in_range = kv_tile(cache, Tables + row * s_tab, kpos, hi, d, d_mask, sc_blk, sc_kv, sc_off,
                                     sc_d, PAGE)
            k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * (qk_scale * k_scale)
            s = tl.where(in_range[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        acc = acc * v_scale
        part = (split * num_rows + row) * HQ + head
        tl.store(MPart + part, m_i, mask=g_mask)
        tl.store(LPart + part, l_i, mask=g_mask)
        tl.store(Acc + part[:, None] * HEAD_D + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
        tl.debug_barrier()  # every thread's partials stored before the ticket releases them
        ticket = tl.atomic_add(Tickets + row * HKV + kvh, 1, sem="acq_rel", scope="gpu")
        if ticket == (layer + 1) * num_splits - 1:
            _merge(Acc, MPart, LPart, Merged, row, head, g_mask, d, d_mask, num_rows, num_splits, HQ, HEAD_D,
                   BLOCK_S)


@triton.jit
def _merge(Acc, MPart, LPart, Merged, row, head, g_mask, d, d_mask, num_rows, num_splits,
           HQ: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merged[row, h·D + d] = the attention output of (row, h) for the heads h of one kv
    head, merged over every split's partials."""
    sp = tl.arange(0, BLOCK_S)
    sp_mask = sp < num_splits
    part = (sp[:, None] * num_rows + row) * HQ + head[None, :]  # [S, G]
    mask = sp_mask[:, None] & g_mask[None, :]
    m = tl.load(MPart + part, mask=mask, other=0.0, cache_modifier=".cg")
    m = tl.where(sp_mask[:, None], m, float("-inf"))  # the split holding the row's position is finite
    lsum = tl.load(LPart + part, mask=mask, other=0.0, cache_modifier=".cg")
    acc = tl.load(Acc + part[:, :, None] * HEAD_D + d[None, None, :], mask=mask[:, :, None] & d_mask[None, None, :],
                  other=0.0, cache_modifier=".cg")
    w = tl.exp2(m - tl.max(m, axis=0)[None, :])
    den = tl.where(g_mask, tl.sum(lsum * w, axis=0), 1.0)
    out = tl.sum(acc * w[:, :, None], axis=0) / den[:, None]
    tl.store(Merged + row * HQ * HEAD_D + head[:, None] * HEAD_D + d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])


X_OWN = tl.constexpr(0) # a GEMV's input: this program's scratch row
X_SHARED = tl.constexpr(1) # ... a buffer other programs wrote (read past L1, which may hold an old layer's lines)
X_SWIGLU = tl.constexpr(2) # ... silu(gate)·up of [gate | up] rows 2K wide, other programs'


@triton.jit
def _x_chunk(Xs, rows, k, K, mask, SRC: tl.constexpr):
    """A GEMV's input at (rows, k) from the source SRC (X_OWN, X_SHARED, X_SWIGLU)."""
    if SRC == X_SWIGLU:
        gate = tl.load(Xs + rows * 2 * K + k, mask=mask, other=0.0, cache_modifier=".cg")
        up = tl.load(Xs + rows * 2 * K + K + k, mask=mask, other=0.0, cache_modifier=".cg")
        return gate * tl.sigmoid(gate) * up
    elif SRC == X_SHARED:
        return tl.load(Xs + rows * K + k, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return tl.load(Xs + rows * K + k, mask=mask, other=0.0)


@triton.jit
def _exit_gate(Scratch, Out, WGate, BGate, RemIn, RemOut, Score, num_rows, H,
               BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """Out = the normed hidden (model dtype); gate logit on it; Π(1-σ) and score 1 - Π(1-σ)."""
    b = tl.arange(0, BLOCK_B)
    c = tl.arange(0, BLOCK_H)
    rows = b < num_rows
    mask = rows[:, None] & (c < H)[None, :]
    h = tl.load(Scratch + b[:, None] * H + c[None, :], mask=mask, other=0.0)
    h = h.to(Out.dtype.element_ty)
    tl.store(Out + b[:, None] * H + c[None, :], h, mask=mask)
    w = tl.load(WGate + c, mask=c < H, other=0.0).to(tl.float32)
    logit = tl.sum(h.to(tl.float32) * w[None, :], axis=1) + tl.load(BGate).to(tl.float32)
    logit = logit.to(Out.dtype.element_ty).to(tl.float32)  # the reference's gate output dtype
    rem = tl.load(RemIn + b, mask=rows, other=1.0) * (1.0 - tl.sigmoid(logit))
    tl.store(RemOut + b, rem, mask=rows)
    tl.store(Score + b, 1.0 - rem, mask=rows)


@triton.jit
def ouro_loop_kernel(
        Hidden, s_hid, Out, RemIn, RemOut, Score,
        Positions, Slots, Tables, s_tab, Cos, Sin, s_cos,
        Cache, KVScales, sc_blk, sc_layer, sc_kv, sc_off, sc_h, sc_d,
        Wqkv, Wo, Wgu, Wdown, Norms, WNorm, WGate, BGate,
        Xres, Delta, QKV, GU, Acc, MPart, LPart, Merged, Scratch, s_scr, Count, Times,
        num_rows, num_splits, qk_scale, eps, phase_lo, phase_hi,
        L: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
        HQ: tl.constexpr, HKV: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr,
        BK: tl.constexpr, PHASES: tl.constexpr, USE_BARRIER: tl.constexpr, TIMING: tl.constexpr,
        KV_FP8: tl.constexpr):
    """Phases [phase_lo, phase_hi) of one loop (see the module docstring). Norms is
    [L, 4, H]: input_layernorm, input_layernorm_2, post_attention_layernorm(_2). KVScales:
    [L, 2] fp32 (k_scale, v_scale) of an FP8 cache (KV_FP8). Times:
    [phases, programs, 3] int64 when TIMING (see _stamp)."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    NQ: tl.constexpr = HQ * HEAD_D
    NQKV: tl.constexpr = (HQ + 2 * HKV) * HEAD_D
    scratch = Scratch + pid * s_scr
    xa = Xres  # the residual a layer's attention half reads (and its MLP half writes)
    xb = Xres + BLOCK_B * H  # ... and the other way round
    for ph in range(phase_lo, phase_hi):
        layer = ph // PHASES
        kind = ph % PHASES
        lw = layer.to(tl.int64)
        _stamp(Times, ph, pid, num_progs, 0, TIMING)
        if layer == L:
            if pid == 0:
                _add_norm(xa, H, Delta, Norms + (L - 1) * 4 * H + 3 * H, WNorm, xa, scratch,
                          num_rows, H, eps, True, False, BLOCK_B, BLOCK_H)
                _exit_gate(scratch, Out, WGate, BGate, RemIn, RemOut, Score, num_rows, H, BLOCK_B, BLOCK_H)
                _stamp(Times, ph, pid, num_progs, 2, TIMING)
        elif kind == 0:
            if pid < tl.cdiv(NQKV, BN_QKV):
                if layer == 0:
                    _add_norm(Hidden, s_hid, Delta, Norms, Norms, xb, scratch, num_rows, H, eps,
                              False, pid == 0, BLOCK_B, BLOCK_H)
                else:
                    _add_norm(xa, H, Delta, Norms + (lw - 1) * 4 * H + 3 * H, Norms + lw * 4 * H, xb,
                              scratch, num_rows, H, eps, True, pid == 0, BLOCK_B, BLOCK_H)
                _stamp(Times, ph, pid, num_progs, 1, TIMING)
                _gemv(Wqkv + lw * NQKV * H, NQKV, H, scratch, QKV, num_rows, pid, num_progs,
                      BLOCK_B, BN_QKV, BK, X_OWN)
                _stamp(Times, ph, pid, num_progs, 2, TIMING)
        elif kind == 1:
            _attention(QKV, Cache + lw * sc_layer, KVScales + lw * 2, Positions, Slots, Tables, s_tab,
                       Cos, Sin, s_cos,
                       Acc, MPart, LPart, Count + 1, Merged, layer, num_rows, num_splits, qk_scale, pid, num_progs,
                       sc_blk, sc_kv, sc_off, sc_h, sc_d, HQ, HKV, HEAD_D, PAGE,
                       BLOCK_G, BLOCK_N, BLOCK_D, BLOCK_S, KV_FP8)
            _stamp(Times, ph, pid, num_progs, 2, TIMING)
        elif kind == 2:
            if pid < tl.cdiv(H, BN_O):
                _stamp(Times, ph, pid, num_progs, 1, TIMING)
                _gemv(Wo + lw * H * NQ, H, NQ, Merged, Delta, num_rows, pid, num_progs,
                      BLOCK_B, BN_O, BK, X_SHARED)
                _stamp(Times, ph, pid, num_progs, 2, TIMING)
        elif kind == 3:
            if pid < tl.cdiv(2 * I, BN_GU):
                _add_norm(xb, H, Delta, Norms + lw * 4 * H + H, Norms + lw * 4 * H + 2 * H, xa, scratch,
                          num_rows, H, eps, True, pid == 0, BLOCK_B, BLOCK_H)
                _stamp(Times, ph, pid, num_progs, 1, TIMING)
                _gemv(Wgu + lw * (2 * I) * H, 2 * I, H, scratch, GU, num_rows, pid, num_progs,
                      BLOCK_B, BN_GU, BK, X_OWN)
                _stamp(Times, ph, pid, num_progs, 2, TIMING)
        else:
            if pid < tl.cdiv(H, BN_DOWN):
                _stamp(Times, ph, pid, num_progs, 1, TIMING)
                _gemv(Wdown + lw * H * I, H, I, GU, Delta, num_rows, pid, num_progs,
                      BLOCK_B, BN_DOWN, BK, X_SWIGLU)
                _stamp(Times, ph, pid, num_progs, 2, TIMING)
        if USE_BARRIER:
            if ph + 1 < phase_hi:
                _grid_barrier(Count, (ph - phase_lo + 1) * num_progs)
