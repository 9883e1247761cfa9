"""Physical KV storage: block-major pools, so one block of one plane is one contiguous region.

looped: [num_blocks, L_looped, 2, block_size, Hkv, D]  (blocks of every loop-depth plane)
flat:   [num_flat_blocks, L_flat, 2, block_size, Hkv, D]  (non-looped layers; None if none)

The pools hold the model dtype, or FP8 (e4m3fn) with a static scale per layer and per K/V
(`scales`: stored = clamp(x / scale, ±448), read back as stored * scale); every depth plane
of a layer shares its scale, so the last-exited copy and every transfer move bytes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.model.batch import device_tensor


_MAX_MEMSETS = 8  # more runs than this: one index_fill instead of many launches
# copy_slots_looped gathers its sources into a temporary before the scatter: at most this many
# bytes at a time (a 4K-token prompt exiting at loop 1 fills ~12K slots, 2.3 GB on Ouro-1.4B,
# more than a pool sized from free memory leaves spare).
_COPY_CHUNK_BYTES = 256 << 20


def _runs(ids: list[int], limit: int) -> list[tuple[int, int]] | None:
    """The distinct ids as half-open runs [a, b) of consecutive values, or None past `limit` runs."""
    runs: list[tuple[int, int]] = []
    for i in sorted(set(ids)):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        elif len(runs) == limit:
            return None
        else:
            runs.append((i, i + 1))
    return runs


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value: writes clamp to it (the format has no inf)
# kv_cache_dtype (EngineConfig) -> the pools' storage dtype; "auto" stores the model dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": FP8}
# The static scale of every layer's K and V: vLLM's default for a checkpoint without KV
# scales. Fixed, so every engine of a model holds the same bytes for the same K/V (PD, prefix
# caching); docs/design.md ("FP8 KV cache") says why it suffices and what it costs.
FP8_KV_SCALE = 1.0


@dataclass(frozen=True)
class KVSpec:
    num_flat_layers: int
    num_looped_layers: int
    num_kv_heads: int
    head_dim: int

    def block_bytes(self, block_size: int, storage: torch.dtype) -> tuple[int, int]:
        """(looped, flat) bytes of one block of each pool: what a memory budget is divided by
        (FP8 storage: one byte per element, half of bf16's)."""
        per_layer = 2 * block_size * self.num_kv_heads * self.head_dim * storage.itemsize
        return self.num_looped_layers * per_layer, self.num_flat_layers * per_layer

    def blocks_for_budget(self, budget_bytes: int, block_size: int, storage: torch.dtype,
                          max_loops: int) -> int:
        """The largest `num_blocks` whose looped pool plus the engine's default flat pool
        (num_blocks // max_loops + 1 blocks, when the model has flat layers) fit in
        `budget_bytes` (ValueError when not even one block does)."""
        looped, flat = self.block_bytes(block_size, storage)

        def fits(n: int) -> bool:
            return n * looped + (n // max_loops + 1) * flat <= budget_bytes

        n = max((budget_bytes - flat) * max_loops // (looped * max_loops + flat), 0)  # within a block or two
        while fits(n + 1):
            n += 1
        while n and not fits(n):
            n -= 1
        if n < 1:
            raise ValueError(f"budget_bytes={budget_bytes} holds no KV block ({looped} looped + {flat} flat "
                             f"bytes of {storage} at block_size={block_size})")
        return n


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., D] in storage FP8: x / scale clamped to ±FP8_MAX, rounded to nearest."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored FP8 back to `dtype` (x * scale in fp32)."""
    return (x.float() * scale).to(dtype)


class PagedKVCache:
    """`kv_dtype`: the storage dtype when it differs from the model's `dtype` (FP8), else None."""

    def __init__(self, spec: KVSpec, block_size: int, num_blocks: int, num_flat_blocks: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        if kv_dtype not in (None, FP8):
            raise ValueError(f"kv_dtype must be None (the model dtype) or {FP8}, got {kv_dtype}")
        self.spec = spec
        self.block_size = block_size
        storage = kv_dtype or dtype
        shape = (2, block_size, spec.num_kv_heads, spec.head_dim)
        self.looped = torch.zeros(num_blocks, spec.num_looped_layers, *shape, dtype=storage, device=device)
        self.flat = (
            torch.zeros(num_flat_blocks, spec.num_flat_layers, *shape, dtype=storage, device=device)
            if spec.num_flat_layers
            else None
        )
        # [layers, 2] fp32 per pool: (k_scale, v_scale) of each layer; None for unquantized pools
        self.scales: dict[str, torch.Tensor] | None = None if kv_dtype is None else {
            kind: torch.full((n, 2), FP8_KV_SCALE, dtype=torch.float32, device=device)
            for kind, n in (("looped", spec.num_looped_layers), ("flat", spec.num_flat_layers)) if n}

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def layer_scale(self, kind: str, layer: int) -> torch.Tensor | None:
        """[2] fp32 (k_scale, v_scale) of one layer of an FP8 pool; None when unquantized."""
        return None if self.scales is None else self.scales[kind][layer]

    def scale_list(self) -> dict[str, list[list[float]]] | None:
        """The scales as plain numbers (the KV compatibility two engines must share)."""
        return None if self.scales is None else {k: v.tolist() for k, v in self.scales.items()}

    def pool(self, kind: str) -> torch.Tensor:
        t = self.looped if kind == "looped" else self.flat
        if t is None:
            raise ValueError(f"this model has no {kind} KV pool")
        return t

    def layer_view(self, kind: str, layer: int) -> torch.Tensor:
        """[num_blocks, 2, block_size, Hkv, D] strided view of one layer."""
        return self.pool(kind)[:, layer]

    def _bytes(self, kind: str) -> torch.Tensor:
        """A pool as raw bytes (same storage): moves and zeroing copy bytes whatever the
        storage dtype (torch has no index_copy_ / index_fill_ for FP8 on CPU)."""
        return self.pool(kind).view(torch.uint8)

    def zero_blocks(self, kind: str, block_ids: list[int]) -> None:
        """Zero fresh blocks (no stale K/V is ever readable): a few runs of consecutive ids (a
        long prompt's blocks from a fresh pool) as memsets, a scattered list as one index_fill
        (an indexed kernel: 9 ms for an 8k prompt's 6 GiB on the H200). All-zero bytes are 0.0
        in every storage dtype."""
        pool = self._bytes(kind)
        runs = _runs(block_ids, _MAX_MEMSETS)
        if runs is None:
            pool.index_fill_(0, device_tensor(block_ids, torch.long, pool.device), 0)
            return
        for a, b in runs:
            pool[a:b].zero_()

    def copy_slots_looped(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every looped layer's K/V from src to dst slots (the last-exited fill)."""
        bs = self.block_size
        pool = self._bytes("looped")
        slot_bytes = pool[0, :, :, 0].numel()
        step = max(1, _COPY_CHUNK_BYTES // slot_bytes)
        for i in range(0, len(src_slots), step):
            src, dst = src_slots[i:i + step], dst_slots[i:i + step]
            pool[dst // bs, :, :, dst % bs] = pool[src // bs, :, :, src % bs]

    def gather_blocks(self, kind: str, block_ids: list[int]) -> torch.Tensor:
        """The blocks' bytes on the host (offload); `scatter_blocks` puts them back."""
        idx = device_tensor(block_ids, torch.long, self.looped.device)
        return self._bytes(kind).index_select(0, idx).cpu()

    def scatter_blocks(self, kind: str, block_ids: list[int], data: torch.Tensor) -> None:
        idx = device_tensor(block_ids, torch.long, self.looped.device)
        self._bytes(kind).index_copy_(0, idx, data.to(self.looped.device))
