"""Triton kernels: paged, causal-by-position GQA attention over segments, and the split-KV merge.

One program owns a tile of BQ consecutive rows of one segment and one KV head; its BLOCK_M
score rows are (row, q-head of the group) pairs, so every K/V tile it gathers from the paged
cache serves all Hq/Hkv query heads at once. Programs are numbered in "virtual tiles":
segment s owns tiles seg_starts[s] // BQ + s + i for i < cdiv(len_s, BQ); these ranges are
disjoint and increasing in s, so the grid is T // BQ + S on the host (no device sync) and each
program finds its segment by binary search. Programs past a segment's rows do no work.

With SPLIT, the KV range of a tile is cut into `num_splits` chunks (flash-decoding) so that
small decode batches still fill the GPU; each chunk writes (max, sum, unnormalised acc) and
`_merge_splits_kernel` combines them. Scores live in the log2 domain (exp2). DOT_DTYPE is the
storage dtype, or fp32 when q and the cache differ; "ieee" keeps fp32 dots out of TF32 (it
does not change bf16/fp16 dots).

An FP8 cache (KV_FP8) is read as stored (e4m3 converts exactly to bf16/fp16/fp32) and dots in
q's dtype; its per-layer k_scale folds into the score scale and v_scale into the output, so
dequantizing costs two scalar loads per program.

`_decode_fma_kernel` serves FP8 decode batches with G = 1 instead (no tl.dot; its docstring
says why), writing the same split partials.
"""

from __future__ import annotations

import triton
import triton.language as tl


FP8_MAX = tl.constexpr(448.0)  # paged_kv.FP8_MAX (a jit global must be a tl.constexpr object)


@triton.jit
def kv_scales(KVScale, KV_FP8: tl.constexpr):
    """(k_scale, v_scale) of an FP8 cache's layer; 1.0 for a cache in the model dtype."""
    if KV_FP8:
        return tl.load(KVScale), tl.load(KVScale + 1)
    return 1.0, 1.0


@triton.jit
def _e4m3_rounded(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32: the
    magic-number add drops all but 3 mantissa bits of x's binade (binade 2^-6 below it: the
    subnormals' step 2^-9). The conversion to FP8 that follows is then exact; the Triton
    interpreter's own rounding halves a value whose rounding carries into the exponent (0.49
    -> 0.25) and flushes subnormals, while Hopper's cvt agrees with torch either way."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(e + 20)
    r = (x + magic) - magic
    return tl.where(r == 0.0, x * 0.0, r)  # keep the sign of a zero, as torch does


@triton.jit
def to_cache(x, scale, dtype: tl.constexpr, KV_FP8: tl.constexpr):
    """x in the cache's storage: FP8 bit for bit as paged_kv.quantize (x / scale clamped to
    ±448, nearest e4m3), else cast."""
    if KV_FP8:
        x = _e4m3_rounded(tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX))
    return x.to(dtype)


@triton.jit
def _segment_of(SegStarts, num_segs, pid, BQ: tl.constexpr):
    """Largest s with SegStarts[s] // BQ + s <= pid (tile bases strictly increase in s)."""
    lo = 0
    hi = num_segs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        base = tl.load(SegStarts + mid) // BQ + mid
        if base <= pid:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def kv_tile(Cache, Table, kpos, kv_hi, d, d_mask, sc_blk, sc_kv, sc_off, sc_d, PAGE: tl.constexpr):
    """(k, v, in_range) of positions kpos (< kv_hi) of one head through a block table."""
    in_range = kpos < kv_hi
    blk = tl.load(Table + kpos // PAGE, mask=in_range, other=0).to(tl.int64)
    kv_off = blk * sc_blk + (kpos % PAGE) * sc_off
    kv_mask = in_range[:, None] & d_mask[None, :]
    k = tl.load(Cache + kv_off[:, None] + d[None, :] * sc_d, mask=kv_mask, other=0.0)
    v = tl.load(Cache + sc_kv + kv_off[:, None] + d[None, :] * sc_d, mask=kv_mask, other=0.0)
    return k, v, in_range


@triton.jit
def _paged_attn_kernel(Q, Cache, KVScale, Out, MPart, LPart, SegStarts, BlockTables, Positions,
                       num_segs, num_rows, num_splits, qk_scale, window,
                       sq_t, sq_h, sq_d, so_t, so_h, so_d,
                       sc_blk, sc_kv, sc_off, sc_h, sc_d, s_bt,
                       G: tl.constexpr, HQ: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
                       BQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seg = _segment_of(SegStarts, num_segs, pid, BQ)
    seg_start = tl.load(SegStarts + seg)
    seg_end = tl.load(SegStarts + seg + 1)
    row0 = seg_start + (pid - (seg_start // BQ + seg)) * BQ

    m_idx = tl.arange(0, BLOCK_M)
    qi = m_idx // G
    head = kvh * G + m_idx % G
    row = row0 + qi
    valid = (qi < BQ) & (row < seg_end)
    pos = tl.load(Positions + row, mask=valid, other=-1)
    kv_hi = tl.max(pos, axis=0) + 1  # positions ascend within a segment; -1 rows add nothing
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(tl.min(tl.where(valid, pos, kv_hi), axis=0) - window + 1, 0)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_hi = tl.minimum(kv_hi, kv_lo + chunk)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_D
    q = tl.load(Q + row[:, None].to(tl.int64) * sq_t + head[:, None] * sq_h + d[None, :] * sq_d,
                mask=valid[:, None] & d_mask[None, :], other=0.0)
    q = q.to(DOT_DTYPE)
    k_scale, v_scale = kv_scales(KVScale, KV_FP8)
    qk_scale = qk_scale * k_scale
    k_base = Cache + kvh * sc_h
    table = BlockTables + seg.to(tl.int64) * s_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k, v, in_range = kv_tile(k_base, table, kpos, kv_hi, d, d_mask, sc_blk, sc_kv, sc_off, sc_d, PAGE)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * qk_scale
        visible = (kpos[None, :] <= pos[:, None]) & in_range[None, :]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: keep zeros
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                               input_precision="ieee")
        m_i = m_new

    acc = acc * v_scale
    o_mask = valid[:, None] & d_mask[None, :]
    if SPLIT:
        part = (split * num_rows + row).to(tl.int64) * HQ + head
        tl.store(MPart + part, m_i, mask=valid)
        tl.store(LPart + part, l_i, mask=valid)
        tl.store(Out + part[:, None] * HEAD_D + d[None, :], acc, mask=o_mask)
    else:
        out = acc / tl.where(valid, l_i, 1.0)[:, None]  # rows past the segment have l = 0
        tl.store(Out + row[:, None].to(tl.int64) * so_t + head[:, None] * so_h + d[None, :] * so_d,
                 out.to(Out.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_fma_kernel(Q, Cache, KVScale, Out, MPart, LPart, SegStarts, BlockTables, Positions,
                       num_rows, num_splits, qk_scale, window,
                       sq_t, sq_h, sq_d, so_t, so_h, so_d,
                       sc_blk, sc_kv, sc_off, sc_h, sc_d, s_bt,
                       HQ: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       SPLIT: tl.constexpr, KV_FP8: tl.constexpr):
    """Decode rows (one per segment) with one query head per KV head (G = 1, Ouro), without
    tl.dot: q.k as fp32 FMAs and a row reduction, p.v likewise. Grid (segments, HQ, splits).
    Why: on an H100 with an FP8 cache, `_paged_attn_kernel` pads the one row to 16 and stages
    the converted K/V through shared memory for the MMA, reading K/V at 0.42-0.53 of the copy
    rate; this reads it at 0.70 (BLOCK_N 128, 4 warps, 3 stages; docs/benchmarks.md). Same
    metadata, window, scales and split partials (merged by `_merge_splits_kernel`)."""
    seg = tl.program_id(0)
    head = tl.program_id(1)  # = the KV head
    split = tl.program_id(2)
    row = tl.load(SegStarts + seg)
    pos = tl.load(Positions + row)
    kv_hi = pos + 1
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(pos - window + 1, 0)
    if SPLIT:  # a split past the range reads nothing: m = -inf, l = 0, acc = 0 (the merge skips it)
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_hi = tl.minimum(kv_hi, kv_lo + chunk)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_D
    k_scale, v_scale = kv_scales(KVScale, KV_FP8)
    q = tl.load(Q + row.to(tl.int64) * sq_t + head * sq_h + d * sq_d, mask=d_mask, other=0.0)
    q = q.to(tl.float32) * (qk_scale * k_scale)
    k_base = Cache + head * sc_h
    table = BlockTables + seg.to(tl.int64) * s_bt

    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):  # [kv_lo, kv_hi) is exactly what the row sees
        kpos = n0 + tl.arange(0, BLOCK_N)
        k, v, in_range = kv_tile(k_base, table, kpos, kv_hi, d, d_mask, sc_blk, sc_kv, sc_off, sc_d, PAGE)
        s = tl.where(in_range, tl.sum(q[None, :] * k.to(tl.float32), axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every tile holds a position in range
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new

    acc = acc * v_scale
    if SPLIT:
        part = (split * num_rows + row).to(tl.int64) * HQ + head
        tl.store(MPart + part, m_i)
        tl.store(LPart + part, l_i)
        tl.store(Out + part * HEAD_D + d, acc, mask=d_mask)
    else:
        tl.store(Out + row.to(tl.int64) * so_t + head * so_h + d * so_d,
                 (acc / l_i).to(Out.dtype.element_ty), mask=d_mask)


@triton.jit
def _merge_splits_kernel(Acc, MPart, LPart, Out, num_rows, num_splits, so_t, so_h, so_d,
                         HQ: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (sp * num_rows + row) * HQ + head
    sp_mask = sp < num_splits
    m = tl.load(MPart + part, mask=sp_mask, other=float("-inf"))
    l = tl.load(LPart + part, mask=sp_mask, other=0.0)
    acc = tl.load(Acc + part[:, None] * HEAD_D + d[None, :],
                  mask=sp_mask[:, None] & (d < HEAD_D)[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # the split holding the row's own position is finite
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(Out + row * so_t + head * so_h + d * so_d, out.to(Out.dtype.element_ty), mask=d < HEAD_D)
