"""Worker side of the KV connector: NIXL agents that READ paged KV blocks between engines.

Pull model (as vLLM's NixlConnector): every engine registers its block-major pools once; a
decode engine adds each prefill engine as a peer at handshake (agent metadata plus a
compatibility check), prepares one descriptor list per side once (one descriptor per block,
both pools), and per request READs the prompt's blocks of every plane with one transfer whose
notification names the request. NIXL merges descriptors of adjacent blocks, so runs of
consecutive block ids move as one region.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)
POOLS = ("looped", "flat")


class KVCompatError(ValueError):
    """Two engines' KV layouts differ; they must not exchange blocks."""


class NixlUnavailableError(RuntimeError):
    pass


def _import_nixl():
    """NIXL's Python API from whichever wheel is installed (nixl meta, nixl-cu13, nixl-cu12)."""
    import importlib

    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(mod)
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise NixlUnavailableError("NIXL is not installed (pip install nixl); PD KV transfer cannot start")


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)


class NixlKVWorker:
    def __init__(self, engine_id: str, pools: dict[str, torch.Tensor | None], block_size: int,
                 compat: dict | None = None) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.pools = {k: v for k, v in pools.items() if v is not None}
        self.compat = dict(compat or {}, block_size=block_size)
        on_cpu = all(not t.is_cuda for t in self.pools.values())
        if on_cpu:  # UCX over loopback TCP + cross-memory attach; shared memory alone fails here
            os.environ.setdefault("UCX_TLS", "tcp,cma")
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        agent_cls, config_cls = _import_nixl()
        try:
            self.agent = agent_cls(engine_id, config_cls(backends=["UCX"]))
        except Exception as e:  # noqa: BLE001 - NIXL raises plain exceptions
            raise NixlUnavailableError(f"NIXL agent {engine_id!r} could not start the UCX backend: {e}") from e
        self._layout = {}  # pool -> (base address, block bytes, num blocks, device id, mem type)
        regs = []
        for name in POOLS:
            t = self.pools.get(name)
            if t is None:
                continue
            mem_type, dev = _mem(t)
            block_bytes = t[0].numel() * t.element_size()
            self._layout[name] = (t.data_ptr(), block_bytes, t.shape[0], dev, mem_type)
            regs.append((name, self.agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), dev, "")], mem_type)))
        self._regs = regs
        self._offsets, descs = self._descs(self._layout)
        mem_type = next(iter(self._layout.values()))[4]
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem_type)
        self._peers: dict[str, tuple[str, object, dict]] = {}  # engine id -> (agent, prepped, offsets)
        self._inflight: dict[str, object] = {}

    @staticmethod
    def _descs(layout: dict) -> tuple[dict[str, int], list[tuple[int, int, int]]]:
        """One descriptor per block, pools concatenated; offsets[pool] = index of its block 0."""
        offsets, descs = {}, []
        for name in POOLS:
            if name not in layout:
                continue
            base, bb, n, dev, _ = layout[name]
            offsets[name] = len(descs)
            descs.extend((base + i * bb, bb, dev) for i in range(n))
        return offsets, descs

    # ------------------------------------------------------------------ handshake
    def handshake_info(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "agent_metadata": self.agent.get_agent_metadata(),
            "compat": self.compat,
            "layout": {k: list(v) for k, v in self._layout.items()},
        }

    def add_peer(self, info: dict) -> None:
        """Accept a peer whose blocks this engine will READ; refuse any layout mismatch."""
        theirs, ours = info["compat"], self.compat
        for key in sorted(set(theirs) | set(ours)):
            if theirs.get(key) != ours.get(key):
                raise KVCompatError(
                    f"KV layout mismatch with {info['engine_id']!r}: {key} is "
                    f"{theirs.get(key)!r} there and {ours.get(key)!r} here"
                )
        layout = {k: tuple(v) for k, v in info["layout"].items()}
        for name, (_, bb, *_rest) in layout.items():
            if name not in self._layout or self._layout[name][1] != bb:
                here = self._layout.get(name, (None, None))[1]
                raise KVCompatError(f"KV layout mismatch with {info['engine_id']!r}: {name} block bytes "
                                    f"{bb} there and {here} here")
        agent_name = self.agent.add_remote_agent(info["agent_metadata"])
        offsets, descs = self._descs(layout)
        mem_type = next(iter(layout.values()))[4]
        prepped = self.agent.prep_xfer_dlist(agent_name, descs, mem_type)
        self._peers[info["engine_id"]] = (agent_name, prepped, offsets)

    # ------------------------------------------------------------------ reads (decode side)
    def _indices(self, table: dict, offsets: dict[str, int], num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        idx = [offsets["flat"] + b for b in table["flat"][:n]] if table["flat"] else []
        for plane in table["depth"]:
            idx.extend(offsets["looped"] + b for b in plane[:n])
        return idx

    def start_read(self, request_id: str, peer_engine_id: str, remote_table: dict, local_table: dict,
                   num_tokens: int) -> int:
        """READ every plane's blocks covering `num_tokens` positions; returns bytes moved."""
        if peer_engine_id not in self._peers:
            raise KeyError(f"unknown peer engine {peer_engine_id!r}: no handshake was made with it")
        agent_name, prepped, offsets = self._peers[peer_engine_id]
        remote = self._indices(remote_table, offsets, num_tokens)
        local = self._indices(local_table, self._offsets, num_tokens)
        if len(remote) != len(local):
            raise ValueError(f"{request_id}: {len(remote)} remote blocks vs {len(local)} local blocks")
        handle = self.agent.make_prepped_xfer("READ", self._local, local, prepped, remote,
                                              f"read:{request_id}".encode())
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"{request_id}: NIXL READ failed to start")
        self._inflight[request_id] = handle
        n = -(-num_tokens // self.block_size)
        looped = n * len(local_table["depth"]) * self._layout["looped"][1]
        flat = n * self._layout["flat"][1] if local_table["flat"] else 0
        return looped + flat

    def poll(self) -> tuple[list[str], list[str]]:
        """Non-blocking: (reads done, reads failed) since the last call."""
        done, failed = [], []
        for rid, handle in list(self._inflight.items()):
            state = self.agent.check_xfer_state(handle)
            if state == "PROC":
                continue
            self.agent.release_xfer_handle(handle)
            del self._inflight[rid]
            (done if state == "DONE" else failed).append(rid)
        return done, failed

    def notify(self, peer_engine_id: str, kind: str, request_ids: list[str]) -> None:
        """Tell a prefill peer without a transfer: 'release' (not reading it after all), 'renew'."""
        if peer_engine_id in self._peers and request_ids:
            self.agent.send_notif(self._peers[peer_engine_id][0], f"{kind}:{','.join(request_ids)}".encode())

    # ------------------------------------------------------------------ notifications (prefill side)
    def poll_notifications(self) -> dict[str, list[str]]:
        """{'read': [...], 'release': [...], 'renew': [...]}: request ids per kind."""
        out: dict[str, list[str]] = {"read": [], "release": [], "renew": []}
        for msgs in self.agent.get_new_notifs().values():
            for m in msgs:
                kind, _, ids = m.decode().partition(":")
                if kind in out and ids:
                    out[kind].extend(ids.split(","))
        return out

    def close(self) -> None:
        for handle in self._inflight.values():
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
        self._inflight.clear()
        for _, reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                pass
        self._regs = []
