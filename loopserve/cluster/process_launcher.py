"""Workers as plain processes (multiprocessing spawn) for machines without Ray.

The child builds the worker and serves its methods over `multiprocessing.connection`
(127.0.0.1, an authkey); the parent opens one connection per calling thread, so a pump's
long poll never blocks another thread's submit or abort.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import secrets
import threading
import weakref
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from loopserve.cluster.handle import WorkerHandle
from loopserve.cluster.worker_spec import START_TIMEOUT_S, WorkerSpec, worker_class

log = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    pass


def _portable(e: BaseException) -> BaseException:
    """The exception itself if it pickles (so callers can catch its type), else its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _serve_connection(worker: Any, conn: Connection, stop: threading.Event) -> None:
    with conn:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                return
            try:
                result = ("ok", getattr(worker, method)(*args))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                result = ("err", _portable(e))
            conn.send(result)
            if method == "shutdown":
                stop.set()
                return


def _accept_loop(listener: Listener, worker: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            conn = listener.accept()
        except OSError:
            return
        threading.Thread(target=_serve_connection, args=(worker, conn, stop), daemon=True).start()


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """An orphaned worker (its launcher died) stops instead of holding memory forever."""
    while not stop.wait(1.0):
        if os.getppid() != parent_pid:
            stop.set()


def _worker_main(spec: WorkerSpec, ready: Connection, authkey: bytes, parent_pid: int) -> None:
    os.environ.update(spec.env)  # before torch / NIXL read them
    with contextlib.suppress(OSError):  # ps / top show which worker this is (Linux)
        Path("/proc/self/comm").write_text(spec.worker_id[:15])
    try:
        worker = worker_class(spec.role)(**spec.kwargs())
        # A deep backlog: with the default of 1, concurrent connects overflow the accept queue
        # and wait for a SYN-ACK retransmit (1 s, then longer).
        listener = Listener(("127.0.0.1", 0), authkey=authkey, backlog=128)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which raises it
        ready.send(("err", _portable(e)))
        return
    ready.send(("ok", listener.address))
    stop = threading.Event()
    threading.Thread(target=_accept_loop, args=(listener, worker, stop), daemon=True).start()
    threading.Thread(target=_watch_parent, args=(parent_pid, stop), daemon=True).start()
    stop.wait()
    worker.shutdown()  # idempotent: a no-op when the shutdown RPC already ran it
    listener.close()


class ProcessWorkerHandle(WorkerHandle):
    """A worker process; `restart()` and `revive()` start a new one from the same spec while
    it has restarts left (`max_restarts`), as Ray restarts an actor."""

    def __init__(self, spec: WorkerSpec, max_restarts: int = 0) -> None:
        super().__init__(spec.worker_id, spec.role)
        self._spec = spec
        self.restarts_left = max_restarts
        self._respawning = threading.Lock()
        self._local = threading.local()
        # Connections live in their thread's local storage and close when it ends; this only
        # lets kill() close the ones still open.
        self._conns: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._conns_lock = threading.Lock()
        self._generation = 0  # of the process; a thread's connection to an older one is dropped
        self._closed = False  # shut down: never started again
        self._spawn()

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self._authkey = secrets.token_bytes(16)
        self._ready, child = ctx.Pipe(duplex=False)
        self._address: tuple[str, int] | None = None
        self._proc = ctx.Process(target=_worker_main, name=self._spec.worker_id, daemon=True,
                                 args=(self._spec, child, self._authkey, os.getpid()))
        self._proc.start()
        child.close()
        self._generation += 1

    def wait_ready(self, timeout: float) -> dict:
        if self._address is None:
            if not self._ready.poll(timeout):
                raise TimeoutError(f"worker {self.worker_id} did not start within {timeout} s")
            try:
                status, value = self._ready.recv()
            except EOFError:
                raise WorkerDiedError(
                    f"worker {self.worker_id} exited during start (exit code {self._proc.exitcode})"
                ) from None
            if status == "err":
                raise value
            self._address = value
        return self.health(timeout=timeout)

    def _conn(self) -> Connection:
        generation, conn = getattr(self._local, "conn", None) or (0, None)
        if conn is not None and generation != self._generation:  # to a process that was replaced
            self._drop_conn()
            conn = None
        if conn is None:
            if self._address is None:
                raise WorkerDiedError(f"worker {self.worker_id} is not ready (starting)")
            generation = self._generation
            conn = Client(self._address, authkey=self._authkey)
            self._local.conn = (generation, conn)
            with self._conns_lock:
                self._conns.add(conn)
        return conn

    def _drop_conn(self) -> None:
        _, conn = getattr(self._local, "conn", None) or (0, None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        try:
            conn = self._conn()
            conn.send((method, args))
            answered = timeout is None or conn.poll(timeout)
            if answered:
                status, value = conn.recv()
        except (EOFError, OSError, ConnectionError) as e:
            self._drop_conn()
            raise WorkerDiedError(f"worker {self.worker_id} is gone ({type(e).__name__}) "
                                  f"during {method}") from None
        if not answered:  # alive but late: not a dead worker (TimeoutError is an OSError)
            self._drop_conn()  # a late reply would be read as the next call's
            raise TimeoutError(f"{self.worker_id}.{method} did not answer within {timeout} s")
        if status == "err":
            raise value
        return value

    def _close_conns(self) -> None:
        with self._conns_lock:
            for conn in list(self._conns):
                conn.close()

    def kill(self) -> None:
        self._closed = True
        self._close_conns()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def restart(self) -> None:
        """The worker failed (its engine is dead) or hangs: kill it (SIGKILL also ends a
        stopped process) and start a new one, or stop it for good once out of restarts."""
        self._respawn(kill=True)

    def revive(self) -> None:
        """Its connection broke: start a new process if this one is gone."""
        if not self._proc.is_alive():
            self._respawn(kill=False)

    def _respawn(self, kill: bool) -> None:
        if not self._respawning.acquire(blocking=False):
            return  # another thread is at it
        try:
            if self._closed:
                return
            if kill and self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
            self._close_conns()
            if self.restarts_left <= 0:
                log.error("worker %s failed and has no restarts left: it stays down", self.worker_id)
                return
            self.restarts_left -= 1
            log.warning("starting worker %s again (%d restart(s) left)", self.worker_id, self.restarts_left)
            self._spawn()
            self.wait_ready(START_TIMEOUT_S)
            if self._closed:  # shut down meanwhile
                self.kill()
        finally:
            self._respawning.release()
