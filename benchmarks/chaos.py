"""Chaos run: a real `loopserve` 2P2D server under mixed HTTP load while workers are frozen
(SIGSTOP, then SIGCONT) and killed (SIGKILL), for a given duration.

Clients (raw HTTP/1.1 over asyncio streams, no loopserve imports) mix: completions and chat,
streamed and not; cancels (a stream closed after its first event); slow readers; slow
writers (a body sent in pieces); bodies over the size limit (by Content-Length and chunked);
malformed bodies (invalid JSON, bad fields, invalid UTF-8). One fault at a time: a random
worker is frozen for a few seconds or killed (the launcher starts it again), the next fault
once every worker serves again.

Every request must end accounted for: 200 with a complete answer (a stream ends with
`[DONE]` and no error event), or a clear refusal (4xx or 503, with an OpenAI error body; a
stream's error event with code 4xx/503). Anything else (500, a connection dropped without a
status, an answer cut short, no answer within --request-timeout) is LOST. Afterwards, with
every worker resumed, every KV pool must hold 0 blocks (GetStats). The server's RSS (the
router and both fronts) is reported at the start of the load and at the end.
Exit status 1 on a lost request or a held block.

    python benchmarks/chaos.py --duration 300                      # the record (docs/reliability.md)
    python benchmarks/chaos.py --duration 15 --fault-every 4 --launcher process --concurrency 8  # the suite's
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLES = ("prefill", "decode")
PROMPTS = ["o=7;z=o;c=8;p=c;j=a;a=p;j=?", "a=1;b=a;b=?", "x=3;y=x;z=y;q=z;q=?", "hello " * 40]
MAX_BODY = 65536  # server.limits.max_message_bytes of the run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# tiny-ouro-chains has no chat template of its own (chat would be a 400): the server gets this one
CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _config(launcher: str, path: Path) -> None:
    template = path.with_name("chat.jinja")
    template.write_text(CHAT_TEMPLATE)
    path.write_text(json.dumps({
        "mode": "pd", "launcher": launcher, "max_restarts": 10_000,
        "ray": {"num_cpus": 4},
        "prefill": {"num_workers": 2, "num_cpus": 0.5},
        "decode": {"num_workers": 2, "num_cpus": 0.5},
        "server": {"worker_deadline_s": 2.0, "worker_fail_s": 6.0, "max_migrations": 4,
                   "limits": {"max_message_bytes": MAX_BODY}, "chat_template": str(template)},
    }))  # JSON is YAML


# ---------------------------------------------------------------------------- processes
def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += _children(p)
    return pids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def workers(server_pid: int) -> dict[str, list[int]]:
    """Worker pids by role: the process launcher names them `prefill-N` / `decode-N`, Ray
    names actor processes `ray::PrefillWorker` / `ray::DecodeWorker` (comm keeps 15 chars)."""
    found: dict[str, list[int]] = {r: [] for r in ROLES}
    for pid in _tree(server_pid):
        comm = _comm(pid).lower()
        for role in ROLES:
            if comm.startswith((f"{role}-", f"ray::{role}")):
                found[role].append(pid)
    return found


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ---------------------------------------------------------------------------- HTTP
class Outcome:
    OK, REFUSED, LOST = "ok", "refused", "lost"


async def http(port: int, method: str, path: str, body: bytes | list[bytes] = b"",
               headers: dict[str, str] | None = None, chunked: bool = False,
               read_delay: float = 0.0, close_after_first: bool = False,
               write_delay: float = 0.0) -> tuple[int | None, bytes]:
    """One request on its own connection; (status or None, raw body as received)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        pieces = body if isinstance(body, list) else [body]
        head = {"Host": "127.0.0.1", "Connection": "close", "Content-Type": "application/json",
                **(headers or {})}
        if chunked:
            head["Transfer-Encoding"] = "chunked"
        else:
            head["Content-Length"] = str(sum(map(len, pieces)))
        writer.write(f"{method} {path} HTTP/1.1\r\n".encode()
                     + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n")
        for piece in pieces:
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
            await writer.drain()
            if write_delay:
                await asyncio.sleep(write_delay)
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            return None, b""
        status = int(status_line.split()[1])
        data = b""
        while chunk := await reader.read(4096 if not read_delay else 64):
            data += chunk
            if close_after_first and b"data:" in data:
                return status, data
            if read_delay:
                await asyncio.sleep(read_delay)
        return status, data
    except (ConnectionError, OSError):
        return None, b""
    finally:
        writer.close()


def judge(status: int | None, data: bytes, stream: bool, cancelled: bool = False) -> str:
    """OK, REFUSED (a clear 4xx/503) or LOST."""
    if status is None:
        return Outcome.LOST
    if status == 503 or 400 <= status < 500:
        return Outcome.REFUSED if b'"error"' in data else Outcome.LOST
    if status != 200:
        return Outcome.LOST
    if cancelled:
        return Outcome.OK if b"data:" in data else Outcome.LOST
    if stream:
        if b'"error"' in data:  # an error event: clear only for 4xx / 503
            return Outcome.REFUSED if (b'"code":503' in data or b'"code": 503' in data) else Outcome.LOST
        return Outcome.OK if b"data: [DONE]" in data else Outcome.LOST
    return Outcome.OK if b'"finish_reason"' in data else Outcome.LOST


def _body(rng: random.Random, chat: bool, stream: bool) -> dict:
    prompt = rng.choice(PROMPTS)
    common = {"model": "tiny-ouro-chains", "max_tokens": rng.choice([4, 16, 48]), "stream": stream,
              "temperature": rng.choice([0, 0.8]), "ignore_eos": True}
    if chat:
        return {**common, "messages": [{"role": "user", "content": prompt}]}
    return {**common, "prompt": prompt, "n": rng.choice([1, 1, 2])}


async def client(kind: str, port: int, rng: random.Random, timeout: float,
                 seen: list | None = None) -> str:
    """One request of `kind`; its outcome. `seen` gets (status, the answer's first bytes)."""
    chat, stream = rng.random() < 0.4, rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = json.dumps(_body(rng, chat, stream)).encode()
    kw: dict = {}
    if kind == "cancel":
        body = json.dumps(_body(rng, chat, True) | {"max_tokens": 200}).encode()
        kw, stream = {"close_after_first": True}, True
    elif kind == "slow_reader":
        body = json.dumps(_body(rng, chat, True)).encode()
        kw, stream = {"read_delay": 0.2}, True
    elif kind == "slow_writer":
        body = [body[i:i + 16] for i in range(0, len(body), 16)]
        kw = {"write_delay": 0.05}
    elif kind == "oversized":
        big = json.dumps({"model": "x", "prompt": "a" * (MAX_BODY * 4)}).encode()
        body = [big[i:i + 65536] for i in range(0, len(big), 65536)]
        kw = {"chunked": rng.random() < 0.5}
    elif kind == "malformed":
        body = rng.choice([b"{not json", b'{"model": "tiny-ouro-chains", "prompt": "a", "max_tokens": -3}',
                           b'{"model": "tiny-ouro-chains", "prompt": "\xff\xfe"}',
                           b'{"model": "tiny-ouro-chains", "prompt": "a", "bogus_field": 1}',
                           b"[" * 5000])
    try:
        status, data = await asyncio.wait_for(http(port, "POST", path, body, **kw), timeout)
    except TimeoutError:
        status, data = None, b"(no answer within the request timeout)"
    if seen is not None:
        seen.append((status, data[-300:].decode(errors="replace")))
    if status is None:
        return Outcome.LOST
    if kind in ("oversized", "malformed"):  # must be refused, never served
        return Outcome.REFUSED if status is not None and 400 <= status < 500 and b'"error"' in data \
            else Outcome.LOST
    return judge(status, data, stream, cancelled=kind == "cancel")


KINDS = {"completion": 8, "cancel": 2, "slow_reader": 1, "slow_writer": 1, "oversized": 1, "malformed": 1}


async def load(port: int, duration: float, concurrency: int, seed: int, timeout: float,
               results: collections.Counter, lost: list, statuses: collections.Counter) -> None:
    rng = random.Random(seed)
    end = time.monotonic() + duration
    kinds, weights = zip(*KINDS.items())

    async def loop(i: int) -> None:
        r = random.Random(rng.random())
        while time.monotonic() < end:
            kind = r.choices(kinds, weights)[0]
            seen: list = []
            outcome = await client(kind, port, r, timeout, seen)
            results[(kind, outcome)] += 1
            statuses[seen[0][0] if seen else None] += 1
            if outcome == Outcome.LOST:
                lost.append((round(time.monotonic() - end + duration, 1), kind, *(seen[0] if seen else ())))

    await asyncio.gather(*(loop(i) for i in range(concurrency)))


async def faults(server_pid: int, grpc_port: int, duration: float, every: float, seed: int,
                 log: list) -> None:
    """One fault at a time: freeze a random worker for 2-6 s, or kill it; the next one only
    once every worker is back in service (a killed one restarted)."""
    rng = random.Random(seed)
    end = time.monotonic() + duration
    while time.monotonic() + every < end:
        await asyncio.sleep(every * rng.uniform(0.5, 1.0))
        role = rng.choice(ROLES)
        pids = workers(server_pid)[role]
        if not pids:
            log.append(("none", role))
            continue
        pid = rng.choice(pids)
        if rng.random() < 0.5:
            hold = rng.uniform(2, 6)
            os.kill(pid, signal.SIGSTOP)
            log.append(("SIGSTOP", role, round(hold, 1)))
            await asyncio.sleep(hold)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        else:
            os.kill(pid, signal.SIGKILL)
            log.append(("SIGKILL", role))
        back = time.monotonic() + 300
        while time.monotonic() < back and await asyncio.to_thread(blocks_in_use, grpc_port) is None:
            await asyncio.sleep(1)


def blocks_in_use(grpc_port: int) -> dict[str, int] | None:
    """Blocks each worker holds (GetStats); None unless every worker answers healthy."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from loopserve.entrypoints.grpc.client import LoopServeClient

    try:
        with LoopServeClient(f"127.0.0.1:{grpc_port}") as c:
            stats = c.stats()
    except Exception:  # noqa: BLE001 - the server is busy or going: ask again
        return None
    if not all(w.healthy for w in stats.workers):
        return None
    return {w.worker_id: w.looped.used + w.flat.used for w in stats.workers}


def wait_ready(proc: subprocess.Popen, http_port: int, timeout: float, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            status, _ = asyncio.run(http(http_port, "GET", "/health"))
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"server not ready within {timeout} s:\n{log.read_text()[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load and faults")
    p.add_argument("--fault-every", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--concurrency", type=int, default=12, help="clients at once")
    p.add_argument("--launcher", choices=["ray", "process"], default="ray")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    config, log = tmp / "cluster.yaml", tmp / "server.log"
    _config(args.launcher, config)
    grpc_port, http_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("LOOPSERVE_AUTH_TOKEN", None)
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "loopserve.job", "--config", str(config),
                                   "--serve", "--port", str(grpc_port), "--http-port", str(http_port)],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        t0 = time.monotonic()
        wait_ready(server, http_port, 600, log)
        started_s = time.monotonic() - t0
        found = workers(server.pid)
        if sorted(map(len, found.values())) != [2, 2]:
            sys.exit(f"expected 2 prefill and 2 decode worker processes, found {found}")
        rss_start = rss_mb(server.pid)
        results: collections.Counter = collections.Counter()
        statuses: collections.Counter = collections.Counter()
        lost: list = []
        fault_log: list = []

        async def run() -> None:
            await asyncio.gather(
                load(http_port, args.duration, args.concurrency, args.seed, args.request_timeout, results,
                     lost, statuses),
                faults(server.pid, grpc_port, args.duration, args.fault_every, args.seed + 1, fault_log))

        t1 = time.monotonic()
        asyncio.run(run())
        load_s = time.monotonic() - t1
        rss_end = rss_mb(server.pid)
        for pids in workers(server.pid).values():  # nothing stays frozen
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        held, end = None, time.monotonic() + 120
        while time.monotonic() < end:  # every worker healthy again and idle
            held = blocks_in_use(grpc_port)
            if held is not None and not any(held.values()):
                break
            time.sleep(1)
        # Served normally afterwards: one plain request.
        after = asyncio.run(client("completion", http_port, random.Random(7), args.request_timeout))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
    by_outcome = collections.Counter()
    for (_, outcome), n in results.items():
        by_outcome[outcome] += n
    summary = {
        "launcher": args.launcher, "duration_s": args.duration, "load_s": round(load_s, 1),
        "server_start_s": round(started_s, 1), "concurrency": args.concurrency,
        "requests": sum(results.values()), "ok": by_outcome[Outcome.OK],
        "refused_4xx_503": by_outcome[Outcome.REFUSED], "lost": by_outcome[Outcome.LOST],
        "lost_detail": lost[:20], "statuses": {str(k): n for k, n in sorted(statuses.items(), key=str)},
        "by_kind": {f"{k}:{o}": n for (k, o), n in sorted(results.items())},
        "faults": fault_log, "blocks_after": held, "after_ok": after == Outcome.OK,
        "server_rss_mb": {"start": round(rss_start, 1), "end": round(rss_end, 1),
                          "growth": round(rss_end - rss_start, 1)},
        "server_log": str(log),
    }
    print(json.dumps(summary, indent=1))
    failed = summary["lost"] or held is None or any(held.values()) or after != Outcome.OK
    print(f"chaos: {summary['requests']} requests, {summary['ok']} ok, {summary['refused_4xx_503']} "
          f"refused (4xx/503), {summary['lost']} lost; {len(fault_log)} faults; blocks after: {held}; "
          f"server RSS {rss_start:.0f} -> {rss_end:.0f} MB; {'FAILED' if failed else 'PASSED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
