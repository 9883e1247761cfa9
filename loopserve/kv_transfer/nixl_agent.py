"""Worker side of the KV connector: NIXL agents that READ paged KV blocks between engines.

Pull model (as vLLM's NixlConnector): every engine registers its block-major pools once (DRAM
or VRAM, from the tensors' device). A decode engine adds each prefill engine as a peer at
handshake: agent metadata, a compatibility check that refuses any KV layout mismatch, and one
prepared descriptor list per side (one descriptor per block, both pools). Per request only
block ids travel: one READ covers the prompt's blocks on the flat plane and every depth plane,
its notification names the request. Pairs are ordered by local block id and NIXL merges
descriptors adjacent on both sides, so a run of consecutive ids moves as one region.

The serving (prefill) side never loads the reader's metadata; it only polls notifications:
`read` (the READ landed), and the reader's `release` / `renew` messages for leases.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import uuid
from dataclasses import asdict, dataclass

import numpy as np
import torch

from loopserve.intmath import cdiv
from loopserve.kv_cache import BlockTable
from loopserve.kv_transfer.connector import NOTIFY_KINDS, KVConnector, check_compat

log = logging.getLogger(__name__)
POOLS = ("looped", "flat")  # descriptor order: looped blocks first, then flat
CPU_UCX_ENV = {"UCX_TLS": "tcp,cma", "UCX_NET_DEVICES": "lo"}  # shared memory alone fails here
# UCX turns cuda_ipc GET off where it sees no NVLink (one GPU, PCIe peers) and READs of VRAM
# then go through host memory over TCP: 0.5 GB/s on an H200, 1.5 TB/s with GET on.
GPU_UCX_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


class NixlUnavailableError(RuntimeError):
    """NIXL is missing or its UCX backend cannot start: PD transfer is impossible here."""


class UnknownPeerError(LookupError):
    """A READ names an engine this worker has not shaken hands with."""


class KVTransferError(RuntimeError):
    """NIXL refused an operation (closed worker, a READ that could not be posted)."""


@dataclass(frozen=True)
class PoolLayout:
    """Where one pool lives: block b is bytes [base + b*block_bytes, +block_bytes)."""

    base: int
    block_bytes: int
    num_blocks: int
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"

    def descriptors(self) -> np.ndarray:
        """One (address, length, device) row per block."""
        addr = self.base + self.block_bytes * np.arange(self.num_blocks, dtype=np.uint64)
        rows = np.empty((self.num_blocks, 3), dtype=np.uint64)
        rows[:, 0], rows[:, 1], rows[:, 2] = addr, self.block_bytes, self.device_id
        return rows


@dataclass(frozen=True)
class ReadStats:
    """NIXL telemetry of one finished READ (only with capture_telemetry=True)."""

    descriptors: int  # after NIXL's merge of adjacent blocks
    bytes: int
    seconds: float


@dataclass
class _Peer:
    agent_name: str
    layouts: dict[str, PoolLayout]
    dlist: object  # nixl_prepped_dlist_handle over the peer's blocks


@dataclass
class _Read:
    handle: object  # nixl_xfer_handle
    nbytes: int


def _import_nixl():
    """NIXL's Python API from whichever wheel is installed (nixl meta, nixl-cu13, nixl-cu12)."""
    errors = []
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(mod)
        except ImportError as e:
            errors.append(f"{mod}: {e}")
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise NixlUnavailableError("NIXL is not importable (pip install nixl); PD KV transfer cannot start: "
                               + "; ".join(errors))


def _check_pools(pools: dict[str, torch.Tensor], block_size: int) -> None:
    if unknown := sorted(set(pools) - set(POOLS)):
        raise ValueError(f"pools: unknown pool names {unknown}; expected a subset of {list(POOLS)}")
    if "looped" not in pools:
        raise ValueError("pools: 'looped' is required (the depth planes live there)")
    first = pools["looped"]
    for name, t in pools.items():
        if t.dim() != 6 or t.shape[2] != 2:
            raise ValueError(f"pools[{name!r}] must be [num_blocks, layers, 2, block_size, kv_heads, head_dim], "
                             f"got shape {list(t.shape)}")
        if t.shape[3] != block_size:
            raise ValueError(f"pools[{name!r}] holds {t.shape[3]} tokens per block but block_size is {block_size}")
        if not t.is_contiguous():
            raise ValueError(f"pools[{name!r}] must be contiguous (one byte range per block)")
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"pools[{name!r}] is {t.dtype} on {t.device} but pools['looped'] is "
                             f"{first.dtype} on {first.device}; both must match")


def layout_compat(pools: dict[str, torch.Tensor], block_size: int) -> dict:
    """What the tensors themselves say a peer must match: dtype, block size, per-block shapes."""
    return {
        "block_size": block_size,
        "kv_dtype": str(pools["looped"].dtype).removeprefix("torch."),
        **{f"{name}_block_shape": list(pools[name].shape[1:]) if name in pools else None for name in POOLS},
    }


class NixlKVWorker(KVConnector):
    """One engine's NIXL agent over its KV pools (see the module doc for the protocol).

    `compat` adds engine-level facts (model name, loop bounds ...) to the layout facts the
    pools imply; a peer must match every key. Not thread-safe: callers serialise calls.
    """

    def __init__(self, engine_id: str, pools: dict[str, torch.Tensor | None], block_size: int,
                 compat: dict | None = None, capture_telemetry: bool = False,
                 progress_thread: bool = True) -> None:
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.engine_id = engine_id
        self.block_size = block_size
        self.pools = {k: v for k, v in pools.items() if v is not None}
        _check_pools(self.pools, block_size)
        derived = layout_compat(self.pools, block_size)
        for key in derived.keys() & (compat or {}).keys():
            if compat[key] != derived[key]:
                raise ValueError(f"compat[{key!r}] is {compat[key]!r} but the pools say {derived[key]!r}")
        self.compat = {**(compat or {}), **derived}
        self.capture_telemetry = capture_telemetry
        self.read_stats: dict[str, ReadStats] = {}  # filled by poll() when capturing telemetry
        device = self.pools["looped"].device
        for k, v in (CPU_UCX_ENV if device.type == "cpu" else GPU_UCX_ENV).items():
            os.environ.setdefault(k, v)
        self.progress_thread = progress_thread
        self.agent = self._start_agent(f"{engine_id}#{uuid.uuid4().hex[:8]}", capture_telemetry,
                                       progress_thread)
        self._notes: dict[str, list[bytes]] = {}  # fetched by progress(), not yet polled
        self.agent_name = self.agent.name
        mem_type, dev = ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)
        self.layouts = {name: PoolLayout(t.data_ptr(), t[0].numel() * t.element_size(), t.shape[0], dev, mem_type)
                        for name, t in self.pools.items()}
        self._regs = [self.agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), dev, "")], mem_type)
                      for t in self.pools.values()]
        self._offsets = self._block_offsets(self.layouts)
        self._dlist = self._prep(self.layouts, "NIXL_INIT_AGENT")
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[str, _Read] = {}
        self._closed = False

    @staticmethod
    def _start_agent(name: str, capture_telemetry: bool, progress_thread: bool):
        agent_cls, config_cls = _import_nixl()
        env = {k: os.environ.get(k) for k in CPU_UCX_ENV}
        try:
            agent = agent_cls(name, config_cls(backends=["UCX"], capture_telemetry=capture_telemetry,
                                               enable_prog_thread=progress_thread))
        except Exception as e:  # noqa: BLE001 - the bindings raise their own error types
            raise NixlUnavailableError(f"NIXL agent {name!r} could not start its UCX backend ({env}): {e}") from e
        if "UCX" not in agent.backends:
            raise NixlUnavailableError(f"NIXL agent {name!r} has no UCX backend (plugins found: {agent.plugin_list})")
        return agent

    @staticmethod
    def _block_offsets(layouts: dict[str, PoolLayout]) -> dict[str, int]:
        """Index of each pool's block 0 in the concatenated per-block descriptor list."""
        offsets, n = {}, 0
        for name in POOLS:
            if name in layouts:
                offsets[name], n = n, n + layouts[name].num_blocks
        return offsets

    def _prep(self, layouts: dict[str, PoolLayout], agent_name: str):
        rows = np.concatenate([layouts[name].descriptors() for name in POOLS if name in layouts])
        return self.agent.prep_xfer_dlist(agent_name, rows, layouts["looped"].mem_type)

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"NIXL worker {self.engine_id!r} is closed")

    # ------------------------------------------------------------------ handshake
    def handshake_info(self) -> dict:
        """Everything a reader needs once: agent metadata, compat facts, where the blocks are."""
        self._check_open()
        return {
            "engine_id": self.engine_id,
            "agent_name": self.agent_name,
            "agent_metadata": self.agent.get_agent_metadata(),
            "compat": self.compat,
            "pools": {name: asdict(lay) for name, lay in self.layouts.items()},
        }

    def add_peer(self, info: dict) -> None:
        """Accept a peer whose blocks this engine will READ; refuse any compat mismatch.

        Adding a known engine id again (it restarted: new agent, new memory) replaces it.
        """
        self._check_open()
        if missing := sorted({"engine_id", "agent_name", "agent_metadata", "compat", "pools"} - set(info)):
            raise ValueError(f"handshake info lacks {missing}")
        peer = info["engine_id"]
        check_compat(self.engine_id, self.compat, peer, info["compat"])
        if peer in self._peers:
            self._drop_peer(peer)
        layouts = {name: PoolLayout(**lay) for name, lay in info["pools"].items()}
        name = self.agent.add_remote_agent(info["agent_metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[peer] = _Peer(name, layouts, self._prep(layouts, name))
        log.info("%s: added KV peer %s (agent %s)", self.engine_id, peer, name)

    def _drop_peer(self, peer: str) -> None:
        p = self._peers.pop(peer)
        p.dlist.release()
        self.agent.remove_remote_agent(p.agent_name)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    # ------------------------------------------------------------------ reads (decode side)
    def _block_ids(self, request_id: str, side: str, table: BlockTable, layouts: dict[str, PoolLayout],
                   n: int, first: int = 0) -> np.ndarray:
        """Descriptor indices of blocks first..n-1 of every plane of `table`, range-checked."""
        planes = [("looped", f"depth[{d}]", ids) for d, ids in enumerate(table.depth)]
        if "flat" in layouts:
            planes.append(("flat", "flat", table.flat))
        elif table.flat:
            raise ValueError(f"{request_id}: {side} table has flat blocks but there is no flat pool")
        offsets = self._block_offsets(layouts)
        out = []
        for pool, plane, ids in planes:
            if len(ids) < n:
                raise ValueError(f"{request_id}: {side} table {plane} has {len(ids)} blocks, "
                                 f"fewer than the {n} the read covers")
            a = np.asarray(ids[first:n], dtype=np.int64)
            limit = layouts[pool].num_blocks
            bad = a[(a < 0) | (a >= limit)]
            if bad.size:
                raise ValueError(f"{request_id}: {side} table {plane} block id {int(bad[0])} is outside "
                                 f"the {pool} pool [0, {limit})")
            out.append(a + offsets[pool])
        return np.concatenate(out)

    def _check_no_repeats(self, request_id: str, local: np.ndarray) -> None:
        """Two planes reading into one local block would race; the scheduler never allows it."""
        uniq, counts = np.unique(local, return_counts=True)
        if (counts > 1).any():
            idx = int(uniq[counts > 1][0])
            pool = max((o, p) for p, o in self._offsets.items() if o <= idx)[1]
            raise ValueError(f"{request_id}: local {pool} block {idx - self._offsets[pool]} "
                             f"appears twice in the local table")

    def start_read(self, request_id: str, peer_engine_id: str, remote_table: BlockTable | dict,
                   local_table: BlockTable | dict, num_tokens: int, first_block: int = 0) -> int:
        """Post one READ of the blocks covering `num_tokens` positions on every plane, from
        block `first_block` on (the reader's prefix cache holds the ones before).

        Returns the bytes it moves; completion is reported by `poll()`, and the peer gets a
        `read` notification naming the request.
        """
        self._check_open()
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} already has a READ in flight")
        if peer_engine_id not in self._peers:
            raise UnknownPeerError(f"{request_id}: unknown peer engine {peer_engine_id!r}: no handshake was "
                                   f"made with it (known peers: {sorted(self._peers)})")
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"{request_id}: num_tokens must be an integer >= 1, got {num_tokens!r}")
        remote_t, local_t = (t if isinstance(t, BlockTable) else BlockTable.from_dict(t)
                             for t in (remote_table, local_table))
        if remote_t.num_planes != local_t.num_planes or not local_t.num_planes:
            raise ValueError(f"{request_id}: remote table has {remote_t.num_planes} depth planes and local "
                             f"table {local_t.num_planes}; they must be equal and >= 1")
        peer = self._peers[peer_engine_id]
        n = cdiv(num_tokens, self.block_size)
        if not isinstance(first_block, int) or not 0 <= first_block < n:
            raise ValueError(f"{request_id}: first_block must be in [0, {n}), got {first_block!r}")
        remote = self._block_ids(request_id, "remote", remote_t, peer.layouts, n, first_block)
        local = self._block_ids(request_id, "local", local_t, self.layouts, n, first_block)
        self._check_no_repeats(request_id, local)
        order = np.argsort(local, kind="stable")  # adjacent on both sides -> NIXL merges them
        notif = json.dumps({"kind": "read", "ids": [request_id]}).encode()
        try:
            handle = self.agent.make_prepped_xfer("READ", self._dlist, local[order].astype(np.int32),
                                                  peer.dlist, remote[order].astype(np.int32), notif)
        except Exception as e:  # noqa: BLE001 - the bindings raise their own error types
            raise KVTransferError(f"{request_id}: NIXL refused the READ from {peer_engine_id!r}: {e}") from e
        if self.agent.transfer(handle) == "ERR":
            handle.release()
            raise KVTransferError(f"{request_id}: NIXL could not post the READ from {peer_engine_id!r}")
        pools = [p for p in POOLS if p in self.layouts]
        nbytes = sum((n - first_block) * self.layouts[p].block_bytes * (local_t.num_planes if p == "looped" else 1) for p in pools)
        self._inflight[request_id] = _Read(handle, nbytes)
        return nbytes

    def poll(self) -> tuple[list[str], list[str]]:
        """Non-blocking: (READs done, READs failed) since the last call."""
        self._check_open()
        done, failed = [], []
        for rid, read in list(self._inflight.items()):
            try:
                state = self.agent.check_xfer_state(read.handle)
            except Exception as e:  # noqa: BLE001 - e.g. the peer disconnected mid-READ
                log.warning("%s: READ of %s failed: %s", self.engine_id, rid, e)
                state = "ERR"
            if state == "PROC":
                continue
            if state == "DONE" and self.capture_telemetry:
                t = self.agent.get_xfer_telemetry(read.handle)
                self.read_stats[rid] = ReadStats(t.descCount, t.totalBytes, t.xferDuration / 1e6)
            self._release(rid, read)
            (done if state == "DONE" else failed).append(rid)
        return done, failed

    def _release(self, rid: str, read: _Read) -> None:
        del self._inflight[rid]
        try:
            read.handle.release()
        except Exception as e:  # noqa: BLE001 - NIXL keeps it in its leak list, freed at agent teardown
            log.warning("%s: could not release the READ handle of %s: %s", self.engine_id, rid, e)

    def notify(self, peer_engine_id: str, kind: str, request_ids: list[str]) -> bool:
        """Tell a prefill peer about requests without a transfer: `release` (will not read them)
        or `renew` (still going to). Best effort: False, logged, if it could not be sent."""
        self._check_open()
        if kind not in ("release", "renew"):
            raise ValueError(f"notify kind must be 'release' or 'renew', got {kind!r}")
        if not request_ids:
            return True
        peer = self._peers.get(peer_engine_id)
        if peer is None:
            log.warning("%s: cannot %s %s: unknown peer %r", self.engine_id, kind, request_ids, peer_engine_id)
            return False
        try:
            self.agent.send_notif(peer.agent_name, json.dumps({"kind": kind, "ids": list(request_ids)}).encode())
        except Exception as e:  # noqa: BLE001 - the peer is gone; its leases run out on their own
            log.warning("%s: %s to %s failed: %s", self.engine_id, kind, peer_engine_id, e)
            return False
        return True

    # ------------------------------------------------------------------ notifications (prefill side)
    def progress(self) -> None:
        """Drive UCX once (sends queued notifications, serves peers' READs). Without a progress
        thread the owner calls this, or poll/poll_notifications, every tick of its loop."""
        self._check_open()
        for sender, msgs in self.agent.get_new_notifs().items():
            self._notes.setdefault(sender, []).extend(msgs)

    def poll_notifications(self) -> dict[str, list[str]]:
        """Request ids per kind (`read`, `release`, `renew`) received since the last call."""
        self.progress()
        notes, self._notes = self._notes, {}
        out: dict[str, list[str]] = {k: [] for k in NOTIFY_KINDS}
        for sender, msgs in notes.items():
            for m in msgs:
                try:
                    note = json.loads(m)
                    out[note["kind"]].extend(note["ids"])
                except (ValueError, KeyError, TypeError):
                    log.warning("%s: ignoring malformed notification from %s: %r", self.engine_id, sender, m)
        return out

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release every NIXL resource; idempotent. READs still in flight are cancelled."""
        if self._closed:
            return
        self._closed = True
        for rid, read in list(self._inflight.items()):
            self._release(rid, read)
        steps = [lambda p=p: self._drop_peer(p) for p in list(self._peers)]
        steps += [self._dlist.release] + [lambda r=r: self.agent.deregister_memory(r) for r in self._regs]
        for step in steps:  # keep going: one failure must not leak the rest
            try:
                step()
            except Exception as e:  # noqa: BLE001
                log.warning("%s: NIXL teardown step failed: %s", self.engine_id, e)
        self._regs = []
