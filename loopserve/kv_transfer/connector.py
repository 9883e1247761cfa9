"""KVConnector: what a PD worker needs from the library that moves KV blocks between engines.

Pull model: the decode side READs a prefilled request's blocks out of the prefill engine's
pools. A connector is built over one engine's block-major pools (`make_connector`, by the
name `transfer.connector` gives) and speaks four verbs:

- handshake: the serving (prefill) side publishes `handshake_info()` once; a reader
  `add_peer(info)`s it, refusing (KVCompatError) a peer whose `compat` facts differ.
- reads (decode side): `start_read` posts one READ of a request's blocks on every plane and
  returns its bytes; `poll()` reports READs finished and failed since the last call.
- notifications: the reader `notify`s the prefill side `release` (will not read) or `renew`
  (still will: extend the lease); a finished READ tells it `read` by itself. The prefill side
  collects them with `poll_notifications()`.
- `close()`: release every transport resource; idempotent.

Without a thread of its own (`progress_thread` False) the transport moves only when the
owner calls `progress()` (or a poll) every tick of its loop. Callers serialise calls.
Torch-free on purpose: the config that names a connector must not load torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loopserve.kv_cache import BlockTable

NOTIFY_KINDS = ("read", "release", "renew")
# Keys every handshake_info() carries (agent_name: this connector instance, new when its
# engine restarts); a transport adds its own next to them.
HANDSHAKE_KEYS = frozenset({"engine_id", "agent_name", "compat"})


class KVCompatError(ValueError):
    """Two engines' KV layouts differ; they must not exchange blocks."""


def check_compat(engine_id: str, ours: dict, peer: str, theirs: dict) -> None:
    """Refuse a peer unless every compat fact (model, dtypes, block shapes, ...) is equal."""
    diffs = [f"{key} is {theirs.get(key)!r} on {peer!r} but {ours.get(key)!r} on {engine_id!r}"
             for key in sorted(set(theirs) | set(ours)) if theirs.get(key) != ours.get(key)]
    if diffs:
        raise KVCompatError(f"KV layout of peer {peer!r} does not match: " + "; ".join(diffs))


class KVConnector(ABC):
    """One engine's end of the KV transport (see the module doc for the protocol).

    Implementations are constructed as `cls(engine_id, pools, block_size, compat,
    progress_thread=...)`: `pools` maps "looped" (and "flat") to the engine's block-major KV
    tensors, `compat` holds the engine-level facts a peer must match.
    """

    engine_id: str
    progress_thread: bool  # True: the transport drives itself; False: the owner calls progress()

    # ------------------------------------------------------------------ handshake
    @abstractmethod
    def handshake_info(self) -> dict:
        """What a reader needs once to READ this engine's blocks (HANDSHAKE_KEYS at least)."""

    @abstractmethod
    def add_peer(self, info: dict) -> None:
        """Accept a peer's handshake_info(); KVCompatError on any compat mismatch. A known
        engine id again (it restarted) replaces the old peer."""

    # ------------------------------------------------------------------ reads (decode side)
    @abstractmethod
    def start_read(self, request_id: str, peer_engine_id: str, remote_table: BlockTable | dict,
                   local_table: BlockTable | dict, num_tokens: int, first_block: int = 0) -> int:
        """Post one READ of the blocks covering `num_tokens` positions on every plane, from
        block `first_block` on; returns the bytes it moves. Completion comes through poll()."""

    @abstractmethod
    def poll(self) -> tuple[list[str], list[str]]:
        """Non-blocking: (READs done, READs failed) since the last call."""

    # ------------------------------------------------------------------ notifications
    @abstractmethod
    def notify(self, peer_engine_id: str, kind: str, request_ids: list[str]) -> bool:
        """Tell a prefill peer `release` or `renew` for these requests; best effort: False if
        it could not be sent (the unrenewed lease frees the blocks in the end)."""

    @abstractmethod
    def poll_notifications(self) -> dict[str, list[str]]:
        """Prefill side: request ids per kind (NOTIFY_KINDS) received since the last call."""

    @abstractmethod
    def progress(self) -> None:
        """Drive the transport once (send queued notifications, serve peers' READs)."""

    # ------------------------------------------------------------------ teardown
    @abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent. READs still in flight are cancelled."""
