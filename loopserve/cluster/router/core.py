"""Router: sends a request to an entry worker (prefill or colocated) and its handoff to a decode
worker, and streams the request's outputs back to the caller. Each is chosen by the routing
policy (`policy.py`; the default, `prefix_aware`, picks among workers near the least loaded
the one whose prefix cache holds the longest part of the prompt: `prefix_index.py`, fed by
the workers' KV events). In pd mode a request whose uncached prompt (on the decode worker it would
go to) is shorter than `local_prefill_tokens` is prefilled there: no prefill worker, no KV
transfer (disaggregation decided per request, as Dynamo's conditional disaggregation).

One pump thread per worker long-polls `get_events` and dispatches everything new: outputs to
their streams, handoffs to a decode worker. (Lease renewals and releases go from decode to
prefill workers directly, as NIXL notifications.)
A slow or hung worker stalls nothing else: every other call to a worker runs on that
worker's own threads and has a deadline (`deadline_s`); a watchdog marks a worker whose
long poll is `deadline_s` late, or whose call missed its deadline, unresponsive (routed
around at once: its missed submit or handoff goes to another worker), and after `fail_s`
without an answer fails it (its requests migrate, as for a dead one). A worker answering
again serves again. Outputs from a worker a request has left are dropped and the request
aborted there. Health is the router's own view, never a call.
When a worker dies, or a request ends in an engine-side error (a KV read failed or timed out,
an engine crashed), the request migrates: it continues on a surviving worker from the tokens
already streamed (`migration.py`), up to `max_migrations` times, and only then ends with an
error; what survivors still hold of the old attempt is aborted at once. A worker that reports
itself unhealthy (its engine failed: it has ended its requests) is handled as a dead one, and
its handle's `restart()` replaces it (Ray) or stops it for good.
Streams are asyncio queues fed with `call_soon_threadsafe`, so a request's first token (from
the prefill side) always precedes its decode tokens: the handoff is forwarded after the
outputs of the same batch were queued.
Every front (gRPC, HTTP) streams through `generate`, so the request metrics are observed
there (`self.metrics`, whose registry also reads the workers' stats at scrape time).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace

from loopserve.cluster.handle import WorkerHandle
from loopserve.cluster.router.migration import StreamHistory
from loopserve.cluster.router.policy import PrefixAware, RoutingPolicy, decode_load, entry_load
from loopserve.cluster.router.prefix_index import PrefixIndex
from loopserve.cluster.router.workers import WorkerState
from loopserve.metrics import ServingMetrics, WorkerCollector
from loopserve.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.model_limits import ModelLimits
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.prefix_keys import PrefixKeyer
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.stats import WorkerStats
from loopserve.protocol.status import NoWorkerError, QueueFullError, RequestIdInUseError

log = logging.getLogger(__name__)
REUSE_MEMORY = 100_000  # client ids remembered to make engine ids unique (>> worker tombstones)


@dataclass
class _Prompt:
    """A checked request as routing sees it: its token ids, its params with the loop fields
    resolved, and its block keys under each keyer, computed once each."""

    ids: list[int]
    params: SamplingParams
    _keys: dict[PrefixKeyer, tuple[bytes, ...]] = field(default_factory=dict)

    def keys(self, keyer: PrefixKeyer | None) -> tuple[bytes, ...]:
        if keyer is None:
            return ()
        if keyer not in self._keys:  # None: they depend on a seed the engine will draw
            self._keys[keyer] = keyer.keys(self.ids, self.params, self.params.seed) or ()
        return self._keys[keyer]


@dataclass
class _Stream:
    client_id: str
    request_id: str  # the id the engines see (unique per router)
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    entry: str
    history: StreamHistory
    prompt: _Prompt
    decode: str | None = None
    decoding: bool = False  # the decode worker has streamed: the prefill side is done with it
    avoid: set[str] = field(default_factory=set)  # workers an earlier attempt failed on


class Router:
    def __init__(self, entry: Sequence[WorkerHandle], decode: Sequence[WorkerHandle] = (),
                 poll_s: float = 0.2, max_migrations: int = 2, deadline_s: float = 10.0,
                 fail_s: float = 30.0, metrics: ServingMetrics | None = None,
                 policy: RoutingPolicy | None = None, local_prefill_tokens: int = 0) -> None:
        """`policy`: the routing rule (default `PrefixAware()`)."""
        if not entry:
            raise ValueError("a router needs at least one prefill or colocated worker")
        roles = {h.role for h in entry}
        if decode and roles != {"prefill"}:
            raise ValueError(f"decode workers need prefill entry workers, got roles {sorted(roles)}")
        if not decode and roles != {"colocated"}:
            raise ValueError(f"without decode workers the entry workers must be colocated, "
                             f"got roles {sorted(roles)}")
        if not 0 < deadline_s <= fail_s:
            raise ValueError(f"need 0 < deadline_s <= fail_s, got {deadline_s} and {fail_s}")
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        self.limits: tuple[ModelLimits, ...] = ()  # the workers' engines' (start() asks them)
        self.tokenizer: ByteTokenizer | HFTokenizer | None = None  # theirs; this process's only one
        self.policy = policy or PrefixAware()
        self.prefix_routing = self.policy.uses_prefixes
        self.local_prefill_tokens = local_prefill_tokens if decode else 0
        self.poll_s = poll_s
        self.max_migrations = max_migrations
        self.deadline_s = deadline_s
        self.fail_s = fail_s
        self._entry = [WorkerState(h) for h in entry]
        self._decode = [WorkerState(h) for h in decode]
        self._workers = {w.id: w for w in self._entry + self._decode}
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}  # engine request id -> stream
        self._live: dict[str, str] = {}  # client id -> engine request id
        self._uses: OrderedDict[str, int] = OrderedDict()  # client id -> times used
        self._prefixes = PrefixIndex()  # which worker's prefix cache holds which block
        self._token = uuid.uuid4().hex[:8]  # engine ids of reused client ids: "<id>#<token>-<n>"
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.metrics = metrics or ServingMetrics()
        self._collector = WorkerCollector(self.stats)
        self.metrics.add_collector(self._collector)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Router:
        """Handshake every decode worker with every prefill worker, learn what each engine
        accepts (and load their tokenizer) and how each keys its prefix cache, then start the
        pumps."""
        self._handshake(self._decode, self._entry)
        self._learn_limits(list(self._workers.values()))
        self._learn_keyers(list(self._workers.values()))
        loops = [(self._pump, (w,), f"pump-{w.id}") for w in self._workers.values()]
        for target, args, name in [*loops, (self._watch, (), "router-watchdog")]:
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _handshake(self, decode: Sequence[WorkerState], prefill: Sequence[WorkerState]) -> None:
        if not decode:
            return
        infos = [f.result() for f in [p.calls.submit(p.handle.handshake_info) for p in prefill]]
        for f in [d.calls.submit(d.handle.add_peer, info) for d in decode for info in infos]:
            f.result()

    def _learn_limits(self, workers: Sequence[WorkerState]) -> None:
        futures = [w.calls.submit(w.handle.model_limits) for w in workers]
        self.limits = tuple(dict.fromkeys(f.result() for f in futures))
        first = self.limits[0]
        self.tokenizer = load_tokenizer(first.tokenizer, vocab_size=first.vocab_size)

    def _learn_keyers(self, workers: Sequence[WorkerState]) -> None:
        if not self.prefix_routing:
            return
        futures = [(w, w.calls.submit(w.handle.prefix_keyer)) for w in workers]
        for w, f in futures:
            w.keyer = f.result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._streams, self._live = list(self._streams.values()), {}, {}
        for st in streams:
            self._push(st, RequestOutput.ended(st.request_id, "abort", "server shutting down"))
        for t in self._threads:
            t.join(timeout=self.poll_s + self.deadline_s)
        for w in self._workers.values():
            w.calls.shutdown(wait=False, cancel_futures=True)
            w.observer.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing or cancelling the stream aborts it everywhere.

        Raises ValueError (bad input; RequestIdInUseError for an id in use), QueueFullError or
        NoWorkerError before the first output.
        """
        record = self.metrics.begin()
        try:
            routed = self._check(prompt, params or SamplingParams())
            st = self._open(request_id or f"req-{uuid.uuid4().hex[:16]}", routed)
        except (ValueError, NoWorkerError) as e:
            record.refused(_refusal(e))
            raise
        entry = self._workers[st.entry]
        submit = functools.partial(entry.handle.submit, st.request_id, routed.ids, routed.params,
                                   timeout=self.deadline_s)
        try:
            accepted = await asyncio.get_running_loop().run_in_executor(entry.calls, submit)
        except asyncio.CancelledError:
            record.finish("abort")
            self._abort_later(st.request_id)
            raise
        except (ValueError, QueueFullError) as e:  # the request's fault, or backpressure: no retry
            record.refused(_refusal(e))
            with self._lock:
                entry.unsend()
            self._forget(st)
            raise
        except Exception as e:  # noqa: BLE001 - the worker died, failed or is too slow: go elsewhere
            self._missed(entry, e)
            with self._lock:
                entry.unsend()
            self._migrate(st.request_id, f"submit to {entry.id} failed: {e}", {entry.id})
            accepted = True
        if not accepted:  # it was aborted while the submit travelled
            record.finish("abort")
            self._forget(st)
            return
        finished = False
        try:
            while True:
                out = await st.queue.get()
                finished = out.finished
                record.output(out)
                yield out if out.request_id == st.client_id else replace(out, request_id=st.client_id)
                if finished:
                    return
        finally:
            if not finished:
                record.finish("abort")
                self._abort_later(st.request_id)

    def _check(self, prompt: str | list[int], params: SamplingParams) -> _Prompt:
        """The one tokenization of a request, and its check against every engine's limits
        (FieldError names the field and the limit): the workers get token ids and resolved
        loop parameters."""
        if self.tokenizer is None:
            raise NoWorkerError("the router has not started")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        for limits in self.limits:
            params = limits.check(ids, params)
        return _Prompt(ids, params)

    def _open(self, client_id: str, routed: _Prompt) -> _Stream:
        if not isinstance(client_id, str) or not client_id:
            raise ValueError("request_id must be a non-empty string")
        with self._lock:
            if self._closed:
                raise NoWorkerError("the router is closed")
            if client_id in self._live:
                raise RequestIdInUseError(f"request_id {client_id!r} is already in use by a live request")
            if self._decode and not any(w.routable for w in self._decode):
                raise NoWorkerError("no healthy decode worker")
            entry, local = self._local_prefill(routed), True
            if entry is None:
                entry, local = self._pick_start(set(), routed)
            rid = self._engine_id(client_id)
            st = _Stream(client_id, rid, asyncio.get_running_loop(), asyncio.Queue(), entry.id,
                         StreamHistory(routed.ids, routed.params), routed, decode=entry.id if local else None)
            self.metrics.routed.labels("local" if local else
                                       "remote" if self._decode else "colocated").inc()
            self._streams[rid] = st
            self._live[client_id] = rid
            entry.note_sent(0)
            return st

    def _engine_id(self, client_id: str) -> str:
        """A fresh engine-side id: the client's id the first time, then suffixed (lock held)."""
        n = self._uses.get(client_id, 0)
        self._uses[client_id] = n + 1
        self._uses.move_to_end(client_id)
        while len(self._uses) > REUSE_MEMORY:
            self._uses.popitem(last=False)
        return client_id if n == 0 else f"{client_id}#{self._token}-{n}"

    def _forget(self, st: _Stream) -> None:
        with self._lock:
            if self._streams.get(st.request_id) is st:
                del self._streams[st.request_id]
            if self._live.get(st.client_id) == st.request_id:
                del self._live[st.client_id]

    def _cached_tokens(self, prompt: _Prompt | None, workers: list[WorkerState]) -> dict[str, int]:
        """Prompt tokens each worker's prefix cache holds, as its KV events last said (lock held)."""
        out: dict[str, int] = {}
        if prompt is None or not self.prefix_routing:
            return out
        for keyer in {w.keyer for w in workers if w.keyer is not None}:
            ids = [w.id for w in workers if w.keyer == keyer]
            for wid, n in self._prefixes.match(prompt.keys(keyer), ids).items():
                out[wid] = n * keyer.block_size
        return out

    def _pick_entry(self, avoid: set[str] = frozenset(), prompt: _Prompt | None = None) -> WorkerState:
        healthy = _preferred(self._entry, avoid)
        if not healthy:
            raise NoWorkerError(f"no healthy {self._entry[0].handle.role} worker")
        cached = self._cached_tokens(prompt, healthy)
        best = self.policy.choose(healthy, cached, entry_load)
        self.metrics.routed_cached_tokens.inc(cached.get(best.id, 0))
        return best

    def _pick_start(self, avoid: set[str], prompt: _Prompt | None) -> tuple[WorkerState, bool]:
        """The worker to start (or continue) a request on, and whether it is a decode worker
        prefilling it itself: in pd mode with no healthy prefill worker, a decode worker
        serves the whole request (no KV transfer) rather than failing it."""
        try:
            return self._pick_entry(avoid, prompt), False
        except NoWorkerError:
            chosen = self._decode_for(prompt, avoid) if self._decode else None
            if chosen is None:
                raise
            self.metrics.routed_cached_tokens.inc(chosen[1])
            return chosen[0], True

    def _decode_for(self, prompt: _Prompt | None, avoid: set[str]) -> tuple[WorkerState, int] | None:
        """The decode worker for a request, and how much of its prompt that worker holds."""
        healthy = _preferred(self._decode, avoid)
        if not healthy:
            return None
        cached = self._cached_tokens(prompt, healthy)
        best = self.policy.choose(healthy, cached, decode_load)
        return best, cached.get(best.id, 0)

    def _pick_decode(self, blocks: int, prompt: _Prompt | None,
                     avoid: set[str] = frozenset()) -> WorkerState | None:
        chosen = self._decode_for(prompt, avoid)
        if chosen is None:
            return None
        chosen[0].note_sent(blocks)
        return chosen[0]

    def _local_prefill(self, prompt: _Prompt) -> WorkerState | None:
        """pd mode: the decode worker to prefill this request on, if its uncached prompt there
        is shorter than `local_prefill_tokens` (its transfer would cost more than its prefill)."""
        if not self.local_prefill_tokens:
            return None
        chosen = self._decode_for(prompt, set())
        if chosen is None:
            return None
        target, cached = chosen
        if len(prompt.ids) - cached >= self.local_prefill_tokens:
            return None
        self.metrics.routed_cached_tokens.inc(cached)
        return target

    def _abort_later(self, request_id: str) -> None:
        """Abort from a closing stream without waiting (it may be closed from a finalizer)."""
        if not self._closed:
            self._abort_sync(request_id)

    async def abort(self, client_id: str) -> bool:
        """Abort a live request on every engine holding it; its stream ends with 'abort'."""
        with self._lock:
            rid = self._live.get(client_id)
        return rid is not None and self._abort_sync(rid)

    def _abort_sync(self, request_id: str, reason: str = "abort", error: str | None = None,
                    code: str | None = None) -> bool:
        """End the stream now; the workers holding it are told on their own threads."""
        with self._lock:
            st = self._streams.pop(request_id, None)
            if st is None:
                return False
            if self._live.get(st.client_id) == request_id:
                del self._live[st.client_id]
            targets = [self._workers[w] for w in dict.fromkeys((st.entry, st.decode)) if w is not None]
        self._push(st, RequestOutput.ended(st.request_id, reason, error, code))
        for w in targets:
            self._tell(w, "abort", request_id)
        return True

    # ------------------------------------------------------------------ migration
    def _migrate(self, request_id: str, error: str, suspects: set[str], code: str = "UNAVAILABLE") -> None:
        """Continue a failed attempt on a healthy entry worker, or end its stream with `error`
        and `code` (the failure's: UNAVAILABLE for a lost worker, INTERNAL for an engine fault)."""
        with self._lock:
            st = self._streams.pop(request_id, None)
            if st is None:  # finished, aborted or migrated already
                return
            old = [self._workers[w] for w in dict.fromkeys((st.entry, st.decode)) if w is not None]
            st.avoid |= suspects
            entry, why = None, f"after {st.history.migrations} migration(s)"
            if self._closed:
                why = "the router is closing"
            elif st.history.migrations < self.max_migrations:
                try:
                    entry, local = self._pick_start(st.avoid, st.prompt)
                except NoWorkerError as e:
                    why = str(e)
            if entry is None:
                if self._live.get(st.client_id) == request_id:
                    del self._live[st.client_id]
            else:
                prompt, params = st.history.continuation()
                st.request_id = self._engine_id(st.client_id)
                st.entry, st.decode, st.decoding = entry.id, entry.id if local else None, False
                self._streams[st.request_id] = st
                self._live[st.client_id] = st.request_id
                entry.note_sent(0)
        for w in old:  # survivors free the old attempt's blocks now (a dead one just fails)
            self._tell(w, "abort", request_id)
        if entry is None:
            self._push(st, RequestOutput.ended(st.request_id, "error", f"{error} ({why})", code))
            return
        log.warning("%s: %s; continuing on %s as %s after %d token(s)", st.client_id, error,
                    entry.id, st.request_id, len(st.history.tokens))
        self.metrics.migrations.inc()
        entry.calls.submit(self._resubmit, st.request_id, entry, prompt, params, error)

    def _resubmit(self, request_id: str, entry: WorkerState, prompt, params, error: str) -> None:
        try:  # False: aborted meanwhile
            entry.handle.submit(request_id, prompt, params, timeout=self.deadline_s)
        except Exception as e:  # noqa: BLE001 - dead too, slow, or full: try the next one
            self._missed(entry, e)
            with self._lock:
                entry.unsend()
            self._migrate(request_id, f"{error}; then {entry.id} refused it: {e}", {entry.id})

    # ------------------------------------------------------------------ pumps
    def _pump(self, w: WorkerState) -> None:
        while not self._closed:
            w.polling_since = time.monotonic()
            try:
                ev = w.handle.get_events(self.poll_s)
            except Exception as e:  # noqa: BLE001 - the worker died or is restarting
                w.polling_since = None
                if self._closed:
                    return
                if not w.failed:
                    log.error("worker %s failed: %s", w.id, e)
                    self._fail_worker(w, f"worker {w.id} failed: {e}")
                self._tell(w, "revive")  # a dead process starts again (Ray restarts actors itself)
                time.sleep(1.0)
                continue
            w.polling_since = None
            if w.failed and ev.load.healthy:  # it came back (a restarted actor): new KV agent, handshake again
                self._rejoin(w)
            with self._lock:
                w.on_load(ev.load)
                w.silent_since = None
                for change in ev.cache:
                    self._prefixes.apply(w.id, change)
            for out in ev.outputs:
                self._deliver(w, out)
            for msg in ev.handoffs:
                self._route_handoff(w, msg)
            if not (w.failed or ev.load.healthy):  # its engine failed: a dead worker to replace
                log.error("worker %s failed: %s", w.id, ev.load.error)
                self._fail_worker(w, f"worker {w.id} failed: {ev.load.error}", "INTERNAL")
                self._tell(w, "restart")

    def _watch(self) -> None:
        """Mark workers whose long poll is late unresponsive, and fail those silent too long."""
        period = min(self.poll_s, self.deadline_s) / 2
        while not self._closed:
            time.sleep(period)
            now = time.monotonic()
            for w in self._workers.values():
                if (late := w.poll_late(now, self.poll_s + self.deadline_s)) is not None:
                    self._missed(w, late)
                if (error := w.silent_too_long(now, self.fail_s)) is not None:
                    log.error("%s; failing it", error)
                    self._fail_worker(w, error)
                    self._tell(w, "restart")

    def _missed(self, w: WorkerState, e: Exception) -> None:
        """A call to `w` missed its deadline: route around it until it answers a poll again."""
        if not isinstance(e, TimeoutError):
            return
        with self._lock:
            if w.silent_since is None:
                log.warning("worker %s unresponsive (%s): routing around it", w.id, e)
                w.silent_since = time.monotonic()

    def _deliver(self, w: WorkerState, out: RequestOutput) -> None:
        with self._lock:
            st = self._streams.get(out.request_id)
            stale = st is None or w.id not in (st.entry, st.decode)
        if stale:  # ended, or moved off `w` (which answers late): `w` must let it go
            if not out.finished:
                self._tell(w, "abort", out.request_id)
            return
        with self._lock:
            failed = out.finished and out.finish_reason == "error"
            if not failed:
                st.decoding |= w.handle.role == "decode"
                out = st.history.record(out)
                if out.finished:
                    del self._streams[out.request_id]
                    if self._live.get(st.client_id) == out.request_id:
                        del self._live[st.client_id]
        if failed:  # an engine-side failure (KV read, crashed engine): not the request's fault
            self._migrate(out.request_id, out.error or "engine error", {w.id, st.entry},
                          out.error_code or "INTERNAL")
            return
        self._push(st, out)

    def _route_handoff(self, prefill: WorkerState, msg: HandoffMessage) -> None:
        rid = msg.request_id
        with self._lock:
            st = self._streams.get(rid)
            target = self._pick_decode(msg.looped_blocks(), st.prompt, st.avoid) if st is not None else None
            if target is not None:
                st.decode = target.id
        if st is None:  # aborted meanwhile: let the prefill side free the blocks now
            self._tell(prefill, "abort", rid)
            return
        if target is None:
            self._abort_sync(rid, "error", "no healthy decode worker", "UNAVAILABLE")
            return
        target.calls.submit(self._hand_off, prefill, target, msg)

    def _hand_off(self, prefill: WorkerState, target: WorkerState, msg: HandoffMessage) -> None:
        """On the decode worker's own threads: a slow one never holds up the prefill's pump.
        A handoff that misses the deadline starts again elsewhere as a new attempt (the same
        handoff sent to a second reader could be released under it by the first, waking late)."""
        rid = msg.request_id
        try:
            accepted = target.handle.submit_handoff(msg, timeout=self.deadline_s)
        except Exception as e:  # noqa: BLE001 - the decode worker died, refused or hangs
            self._missed(target, e)
            with self._lock:
                target.unsend()
            self._migrate(rid, f"handoff to {target.id} failed: {e}", {target.id})
            return
        if not accepted:
            with self._lock:
                target.unsend()
            self._tell(prefill, "abort", rid)

    def _fail_worker(self, w: WorkerState, error: str, code: str = "UNAVAILABLE") -> None:
        """Migrate every request the worker held (a prefill worker no longer holds those
        whose decode side has started streaming)."""
        with self._lock:
            w.failed, w.error = True, error
            self._prefixes.forget(w.id)  # its cache is gone with it
            hit = [st.request_id for st in self._streams.values()
                   if st.decode == w.id or (st.entry == w.id and not st.decoding)]
        for rid in hit:
            self._migrate(rid, error, {w.id}, code)

    def _rejoin(self, w: WorkerState) -> None:
        """A failed worker answers healthy again (restarted): shake hands with the peers in
        service (one still down does so itself when it rejoins), then route to it. On failure
        it stays failed and the next poll tries again."""
        try:
            if w.handle.role == "prefill":
                self._handshake([d for d in self._decode if d.routable], [w])
            elif w.handle.role == "decode":
                self._handshake([w], [p for p in self._entry if p.routable])
            self._learn_keyers([w])
        except Exception as e:  # noqa: BLE001 - stays failed until a later poll rejoins it
            log.error("worker %s could not rejoin: %s", w.id, e)
            with self._lock:
                w.error = f"worker {w.id} could not rejoin: {e}"
            return
        with self._lock:
            w.reset()
            w.failed, w.error = False, None

    def _tell(self, w: WorkerState, method: str, *args) -> None:
        """Best effort, on the worker's own threads (a dead one fails, a hung one waits)."""
        def call() -> None:
            try:
                getattr(w.handle, method)(*args)
            except Exception as e:  # noqa: BLE001 - best effort; the worker's leases cover it
                log.warning("%s on %s failed: %s", method, w.id, e)
        try:
            w.calls.submit(call)
        except RuntimeError:  # the router is closed
            pass

    @staticmethod
    def _push(st: _Stream, out: RequestOutput) -> None:
        try:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, out)
        except RuntimeError:  # the caller's event loop is gone
            pass

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, WorkerStats]:
        """Every worker's stats, within `deadline_s` of this call (blocking; call from a thread).
        A worker that has not answered by then is reported as such."""
        calls = self._stats_calls()
        wait_futures(calls.values(), timeout=self.deadline_s)
        return self._stats_of(calls)

    async def stats_async(self) -> dict[str, WorkerStats]:
        """`stats()` for an event loop: no thread is taken while the workers answer."""
        calls = self._stats_calls()
        waits = [asyncio.wrap_future(f) for f in calls.values()]
        await asyncio.wait(waits, timeout=self.deadline_s)
        return self._stats_of(calls)

    async def render_metrics(self) -> bytes:
        """The Prometheus text, its worker part within `deadline_s` of this call."""
        stats = await self.stats_async()
        with self._collector.given(stats):
            return self.metrics.render()

    def _stats_calls(self) -> dict[str, Future]:
        """The stats call in flight to each worker, started if there is none."""
        calls = {}
        with self._lock:
            for w in self._workers.values():
                f = w.stats_call
                if f is None or f.done():
                    f = w.stats_call = w.observer.submit(_ask_stats, w.handle, self.deadline_s)
                calls[w.id] = f
        return calls

    def _stats_of(self, calls: dict[str, Future]) -> dict[str, WorkerStats]:
        silent = f"did not answer within {self.deadline_s:g} s of the call"
        return {w.id: calls[w.id].result() if calls[w.id].done()
                else WorkerStats.unanswered(w.id, w.handle.role, silent)
                for w in self._workers.values()}

    def health(self) -> dict[str, dict]:
        """Each worker as the router sees it (no call: answers whatever the workers do)."""
        now = time.monotonic()
        with self._lock:
            return {w.id: {"ok": w.routable, "role": w.handle.role, "error": w.why_not(now)}
                    for w in self._workers.values()}

    def serving(self) -> tuple[bool, str]:
        """(can serve, "SERVING" | "DEGRADED: ..." | "UNAVAILABLE: ..."): a request can be
        served (pd mode: a healthy decode worker, which prefills itself while no prefill
        worker is healthy; else a healthy colocated worker); degraded when some worker is not."""
        health = self.health()
        bad = ", ".join(f"{w} ({h['error']})" for w, h in sorted(health.items()) if not h["ok"])
        needed = self._decode or self._entry
        missing = [] if any(health[w.id]["ok"] for w in needed) else [needed[0].handle.role]
        if missing:
            return False, f"UNAVAILABLE: no healthy {' or '.join(missing)} worker; {bad}"
        return True, f"DEGRADED: {bad}" if bad else "SERVING"

    def num_live(self) -> int:
        """Streams still open (0 once every request finished, failed or was aborted)."""
        with self._lock:
            return len(self._streams)


def _refusal(e: Exception) -> str:
    """Why generate() refused a request, as the metrics count it."""
    if isinstance(e, QueueFullError):
        return "backpressure"
    return "unavailable" if isinstance(e, NoWorkerError) else "invalid"


def _preferred(workers: list[WorkerState], avoid: set[str]) -> list[WorkerState]:
    """Routable workers, without those in `avoid` unless that leaves none."""
    healthy = [w for w in workers if w.routable]
    return [w for w in healthy if w.id not in avoid] or healthy


def _ask_stats(handle: WorkerHandle, timeout: float) -> WorkerStats:
    try:
        return handle.stats(timeout=timeout)
    except Exception as e:  # noqa: BLE001 - reported as data: the stats of a dead worker
        return WorkerStats.unanswered(handle.worker_id, handle.role, f"{type(e).__name__}: {e}")

