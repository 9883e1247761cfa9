"""Prefill of n uncached tokens vs the NIXL READ of their KV planes: the crossover below which
a decode worker should prefill a prompt itself (issue 29's `local_prefill_tokens`). The
library behind benchmarks/disagg_crossover.py, whose docstring says what it prints. Here, not
in benchmarks/, so the spawned prefill process can import its entry point.

Two real engines of the cluster config, in two processes: a prefill-role engine (spawned, with
its NIXL agent, stepping the way a prefill worker does) and a decode-role engine here.
  prefill(n): the decode engine alone, a fresh prompt of n random ids (no prefix cache hit),
    add_request to its first token at the model's full loop depth.
  transfer(n): the prefill engine prefills its own fresh prompt and hands it off; the decode
    engine `add_handoff`s it (not in the figure) and its NIXL agent READs every plane of the prompt's
    blocks (looped planes x blocks + flat blocks), timed from start_read to poll() reporting
    it done. The prefill process polls its notifications every POLL_WAIT_S, as an idle
    prefill worker with a transfer pending does; with transfer.progress_thread off (the CPU
    configs) that poll is also what drives UCX on its side, so the READ can wait for it, as
    in serving. The decode worker sees a READ done at its next tick (POLL_WAIT_S when idle,
    one decode step when busy): that wait is not in the figure.
Both are medians over `reps` after `warmup` runs at each n; on CUDA the device is
synchronised around each prefill. Each engine gets the torch threads its worker would
(OMP_NUM_THREADS, else the group's num_cpus), so on a small CPU the two processes do not
thrash each other's cores. NixlKVWorker sets UCX's environment as in serving (TCP and CMA
over loopback on CPU, cuda_ipc GET on GPU). The pools are fresh, so a prompt's blocks are
mostly consecutive and NIXL merges them into few descriptors; a fragmented pool needs more.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from loopserve.cluster.config import ClusterConfig, load_cluster_config
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.kv_transfer.nixl_agent import NixlKVWorker
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.worker_host.host import POLL_WAIT_S
from loopserve.worker_host.transfer_host import kv_pools

DEFAULT_LENGTHS = (16, 32, 64, 128, 256, 512, 1024)
HANDOFF_TOKENS = 2  # a prefill-role request with one token to go is handed off, not finished
TIMEOUT_S = 120.0


@dataclass
class Row:
    n: int
    prefill_ms: float
    transfer_ms: float
    ratio: float  # transfer / prefill
    read_bytes: int  # bytes the READ moved (every plane)
    blocks: int  # blocks per plane


def load_config(path: str | Path, model: str | None = None, max_model_len: int | None = None,
                num_blocks: int | None = None) -> ClusterConfig:
    """The cluster YAML with engine overrides (None: as the file says)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    engine = dict(data.get("engine") or {})
    for key, value in (("model", model), ("max_model_len", max_model_len), ("num_blocks", num_blocks)):
        if value is not None:
            engine[key] = value
    return load_cluster_config({**data, "engine": engine})


def lengths_for(config: EngineConfig, wanted: list[int]) -> list[int]:
    """`wanted` with lengths past max_model_len (less the handoff's tokens) cut to that limit."""
    limit = config.max_model_len - HANDOFF_TOKENS
    return sorted({min(n, limit) for n in wanted if n >= 1})


def machine() -> str:
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
        dev = f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    nixl = "unknown"
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            nixl = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{dev}; torch {torch.__version__}; {nixl}; python {platform.python_version()}"


def worker_threads(cluster: ClusterConfig, role: str) -> int:
    """Torch threads of a `role` worker: what the launcher gives it (OMP_NUM_THREADS, else the
    group's num_cpus), so two engines on one machine do not thrash its cores."""
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env else max(1, int(cluster.group(role).num_cpus))


def _sync(engine: EngineCore) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _full_depth(engine: EngineCore, max_tokens: int) -> SamplingParams:
    loops = engine.max_loops
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, min_loops=loops, max_loops=loops)


def random_prompt(rng: random.Random, engine: EngineCore, n: int) -> list[int]:
    return [rng.randrange(engine.model.vocab_size) for _ in range(n)]


def _drain(engine: EngineCore) -> None:
    end = time.monotonic() + TIMEOUT_S
    while engine.has_unfinished():
        engine.step()
        if time.monotonic() > end:
            raise TimeoutError("engine did not drain")


# ---------------------------------------------------------------------- prefill side (spawned)
def _prefill_owner(conn, config: dict, engine_id: str, progress_thread: bool, threads: int) -> None:
    """Serves handoffs: ("prefill", rid, ids) -> the HandoffMessage, then polls notifications as
    a prefill worker's loop does until the READ's note frees the blocks -> ("freed", rid)."""
    engine = nixl = None
    try:
        torch.set_num_threads(threads)
        engine = EngineCore(EngineConfig(**config))
        nixl = NixlKVWorker(engine_id, kv_pools(engine), engine.layout.block_size, engine.kv_compat(),
                            progress_thread=progress_thread)
        conn.send(("ready", nixl.handshake_info()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            rid, ids = args
            engine.add_request(ids, _full_depth(engine, HANDOFF_TOKENS), request_id=rid)
            handoffs: list[HandoffMessage] = []
            while not handoffs:
                engine.step()
                handoffs = engine.take_handoffs()
            (h,) = handoffs
            h.prefill_engine_id = engine_id
            conn.send(("handoff", h))
            end = time.monotonic() + TIMEOUT_S
            while rid not in nixl.poll_notifications()["read"]:
                if time.monotonic() > end:
                    raise TimeoutError(f"{rid}: no read notification within {TIMEOUT_S} s")
                time.sleep(POLL_WAIT_S)
            engine.transfer_done(rid)
            conn.send(("freed", rid))
    except BaseException:  # noqa: BLE001 - the reader must hear why, not wait for a timeout
        conn.send(("error", traceback.format_exc()))
    finally:
        if nixl is not None:
            nixl.close()
        if engine is not None:
            engine.shutdown()


class PrefillProcess:
    def __init__(self, config: EngineConfig, progress_thread: bool, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.engine_id = "crossover-prefill"
        self.proc = ctx.Process(target=_prefill_owner, daemon=True,
                                args=(child, config.model_dump(), self.engine_id, progress_thread, threads))
        self.proc.start()
        self.info = self.expect("ready")

    def prefill(self, rid: str, ids: list[int]) -> HandoffMessage:
        """Prefill `ids` in the owner's engine; its handoff, the blocks held until READ."""
        self.conn.send(("prefill", rid, ids))
        return self.expect("handoff")

    def expect(self, kind: str) -> Any:
        end = time.monotonic() + TIMEOUT_S
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"prefill process exited (code {self.proc.exitcode}) before sending {kind!r}")
            if time.monotonic() > end:
                raise TimeoutError(f"prefill process sent no {kind!r} within {TIMEOUT_S} s")
        got, payload = self.conn.recv()
        if got == "error":
            raise RuntimeError(f"prefill process failed:\n{payload}")
        if got != kind:
            raise RuntimeError(f"prefill process sent {got!r}, expected {kind!r}")
        return payload

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------- decode side (here)
def _time_prefill(d: EngineCore, ids: list[int], rid: str) -> float:
    hits = d.stats().prefix_cache.hits
    _sync(d)
    t0 = time.perf_counter()
    d.add_request(ids, _full_depth(d, 1), request_id=rid)
    while not any(o.request_id == rid and o.new_token_ids for o in d.step()):
        pass
    _sync(d)
    dt = time.perf_counter() - t0
    _drain(d)
    if d.stats().prefix_cache.hits != hits:
        raise RuntimeError(f"{rid}: the prompt hit the prefix cache; prefill(n) must be uncached")
    return dt


@dataclass(frozen=True)
class HandoffRead:
    """One handoff taken over by the decode engine and its KV READ, on one clock."""

    fence_s: float  # add_handoff: blocks given, zeroed, and the device waited for up to that
    read_s: float  # start_read to poll() reporting it done
    nbytes: int  # bytes the READ moved (every plane)
    descriptors: int | None  # after NIXL's merge of adjacent blocks (None: no telemetry)


def handoff_read(d: EngineCore, dw: NixlKVWorker, owner: PrefillProcess, h: HandoffMessage,
                 drain: bool = True) -> HandoffRead:
    """`d` takes over the owner's handoff `h` and READs its KV; the request is then dropped
    (`drain`: `d` is stepped until idle)."""
    rid = h.request_id
    t0 = time.perf_counter()
    table = d.add_handoff(h)
    t1 = time.perf_counter()
    if table is None:
        raise RuntimeError(f"{rid}: the decode engine has no blocks for the handoff")
    if d.cached_blocks(rid):
        raise RuntimeError(f"{rid}: the decode engine's prefix cache holds part of the prompt")
    nbytes = dw.start_read(rid, h.prefill_engine_id, h.block_table, table, h.num_kv_tokens)
    end = time.monotonic() + TIMEOUT_S
    while True:
        done, failed = dw.poll()
        if rid in done:
            break
        if rid in failed or time.monotonic() > end:
            raise RuntimeError(f"{rid}: the KV READ {'failed' if rid in failed else 'timed out'}")
        if not dw.progress_thread:
            dw.progress()
        time.sleep(0)  # let a progress thread run
    t2 = time.perf_counter()
    stats = dw.read_stats.pop(rid, None)
    d.kv_received(rid)
    d.abort(rid)
    if drain:
        _drain(d)
    owner.expect("freed")
    return HandoffRead(t1 - t0, t2 - t1, nbytes, stats.descriptors if stats else None)


def measure(cluster: ClusterConfig, lengths: list[int], reps: int = 5, warmup: int = 1,
            seed: int = 0, log: Callable[[str], None] = print) -> list[Row]:
    """One Row per length (cut to what max_model_len allows), each figure a median of `reps`."""
    dcfg, pcfg = cluster.engine_config("decode"), cluster.engine_config("prefill")
    progress_thread = cluster.transfer.progress_thread
    owner = PrefillProcess(pcfg, progress_thread, worker_threads(cluster, "prefill"))
    d = dw = None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(worker_threads(cluster, "decode"))
        d = EngineCore(dcfg)
        dw = NixlKVWorker("crossover-decode", kv_pools(d), d.layout.block_size, d.kv_compat(),
                          progress_thread=progress_thread)
        dw.add_peer(owner.info)
        rng, seq, rows = random.Random(seed), 0, []
        for n in lengths_for(dcfg, lengths):
            prefill_s, read_s, nbytes = [], [], 0
            for i in range(warmup + reps):
                seq += 1
                tp = _time_prefill(d, random_prompt(rng, d, n), f"local-{seq}")
                r = handoff_read(d, dw, owner, owner.prefill(f"read-{seq}", random_prompt(rng, d, n)))
                nbytes = r.nbytes
                if i >= warmup:
                    prefill_s.append(tp)
                    read_s.append(r.read_s)
            p_ms, t_ms = statistics.median(prefill_s) * 1e3, statistics.median(read_s) * 1e3
            row = Row(n, p_ms, t_ms, t_ms / p_ms, nbytes, -(-n // dcfg.block_size))
            rows.append(row)
            log(format_row(row))
        return rows
    finally:
        torch.set_num_threads(threads)
        if dw is not None:
            dw.close()
        if d is not None:
            d.shutdown()
        owner.close()


def crossover(rows: list[Row]) -> dict:
    """The smallest n with prefill(n) >= transfer(n), linearly interpolated in n between the
    two measured points around the first crossing; or where it lies outside the range."""
    if not rows:
        return {"tokens": None, "status": "no data", "text": "no lengths measured"}
    gap = [r.prefill_ms - r.transfer_ms for r in rows]
    first = next((i for i, g in enumerate(gap) if g >= 0), None)
    if first is None:
        return {"tokens": None, "status": "above largest n",
                "text": f"above the largest n measured ({rows[-1].n}): prefill < transfer at every n"}
    if first == 0:
        out = {"tokens": None, "status": "at or below smallest n",
               "text": f"at or below the smallest n measured ({rows[0].n}): prefill >= transfer there"}
    else:
        a, b = rows[first - 1], rows[first]
        ga, gb = gap[first - 1], gap[first]
        n = a.n + (b.n - a.n) * (-ga) / (gb - ga)
        out = {"tokens": n, "status": "interpolated",
               "text": f"{n:.0f} tokens (between n={a.n} and n={b.n}, linear in n)"}
    if back := [r.n for r, g in zip(rows[first:], gap[first:]) if g < 0]:
        out["text"] += f"; not monotone: prefill < transfer again at n={back}"
        out["below_again_at"] = back
    return out


HEADER = f"{'n':>6} {'blocks':>7} {'read KiB':>9} {'prefill ms':>11} {'transfer ms':>12} {'xfer/prefill':>13}"


def format_row(r: Row) -> str:
    return (f"{r.n:>6} {r.blocks:>7} {r.read_bytes / 1024:>9.1f} {r.prefill_ms:>11.3f} "
            f"{r.transfer_ms:>12.3f} {r.ratio:>13.2f}")


def describe_engine(cluster: ClusterConfig) -> str:
    e = cluster.engine_config("decode")
    return (f"model {e.model}, {e.device} {e.dtype}, block_size {e.block_size}, num_blocks {e.num_blocks}, "
            f"max_model_len {e.max_model_len}, max_num_batched_tokens {e.scheduler.max_num_batched_tokens}, "
            f"progress_thread {cluster.transfer.progress_thread}")


def result_json(rows: list[Row], cross: dict, **header: Any) -> dict:
    return {**header, "rows": [asdict(r) for r in rows], "crossover": cross}
