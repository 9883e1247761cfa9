import random
import time
import uuid
from dataclasses import dataclass, field

import pytest

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.kv_transfer.registry import DEFAULT_CONNECTOR, make_connector
from loopserve.model.dense_reference import dense_greedy_generate
from loopserve.model.registry import resolve_model
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.scheduler import RequestStatus
from loopserve.scheduler.invariants import check_invariants
import torch

FAMILIES = ["tiny-huginn", "tiny-ouro"]
NUM_REQUESTS = 16
MAX_TOKENS = 12


def workload(seed: int = 0, n: int = NUM_REQUESTS, max_tokens: int = MAX_TOKENS):
    """Mixed prompt lengths and per-request loop params (adaptive exit, different bounds)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.choice([1, 3, 5, 9, 17, 26])
        prompt = [rng.randrange(0, 256) for _ in range(plen)]
        thr = rng.choice([0.5, 0.7, 0.9, 1.0])
        lo = rng.choice([1, 1, 2])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, min_loops=lo,
                                max_loops=rng.choice([None, 3, 4]), exit_threshold=thr, seed=i)
        out.append((f"r{i}", prompt, params))
    return out


_models: dict[str, torch.nn.Module] = {}
_refs: dict[tuple, tuple] = {}


def model_for(name: str) -> torch.nn.Module:
    if name not in _models:
        _models[name] = resolve_model(name, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    return _models[name]


def reference(name: str, prompt: list[int], params: SamplingParams):
    """Dense full-recompute greedy tokens and exit depths (cached per test session)."""
    model = model_for(name)
    d = model.default_loop_params
    p = params.resolve_loops(d.min_loops, d.max_loops, d.exit_threshold, model.max_loops)
    key = (name, tuple(prompt), p.max_tokens, p.min_loops, p.max_loops, p.exit_threshold, p.seed)
    if key not in _refs:
        _refs[key] = dense_greedy_generate(model, prompt, p.max_tokens, min_loops=p.min_loops,
                                           max_loops=p.max_loops, exit_threshold=p.exit_threshold,
                                           seed=p.seed)
    return _refs[key]


def make_engine(name: str, **kw) -> EngineCore:
    cfg = EngineConfig(model=name, **{"block_size": 4, "num_blocks": 2048, "max_model_len": 128, **kw})
    return EngineCore(cfg, model=model_for(name))


def run_to_completion(engine: EngineCore, max_steps: int = 100_000, arrivals=(), every: int = 3):
    """Step until drained; `arrivals` (rid, prompt, params) join one per `every` steps."""
    outs: dict[str, list[int]] = {}
    depths: dict[str, list[int]] = {}
    arrivals = list(arrivals)
    steps = 0
    while engine.has_unfinished() or arrivals:
        if arrivals and steps % every == 0:
            rid, prompt, params = arrivals.pop(0)
            engine.add_request(prompt, params, request_id=rid)
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            depths.setdefault(o.request_id, []).extend(o.exit_depths)
        check_invariants(engine.scheduler)
        steps += 1
        assert steps < max_steps, "engine did not drain"
    engine.check_no_leaks()
    return outs, depths


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@dataclass
class PDRun:
    """What a prefill→decode run produced: tokens per request (the prefill engine's first
    token plus the decode engine's) and the scheduler states each side went through."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    states_p: dict[str, list[RequestStatus]] = field(default_factory=dict)
    states_d: dict[str, list[RequestStatus]] = field(default_factory=dict)


def _pools(engine: EngineCore) -> dict[str, torch.Tensor]:
    kv = engine.runner.kv
    return {"looped": kv.looped, "flat": kv.flat}


def _progress(engine: EngineCore) -> tuple[int, dict[str, RequestStatus]]:
    """What changes whenever the engine moves: batches run, and each request's status."""
    statuses = {rid: r.status for rid in engine.requests if (r := engine.scheduler.get_request(rid)) is not None}
    return sum(engine.counters.batches.values()), statuses


# Rounds of run_pd in a row without any progress before it gives up (each polls the transport once).
MAX_IDLE_ROUNDS = 20_000


def run_pd(p: EngineCore, d: EngineCore, max_idle_rounds: int = MAX_IDLE_ROUNDS,
           connector: str = DEFAULT_CONNECTOR) -> PDRun:
    """Serve the requests added to prefill engine `p` through it and decode engine `d`,
    moving every prompt's KV with a real READ of the `connector` transport (the loop the PD
    workers run, the transport driven by these polls as the workers' step loops drive it: no
    progress thread).

    Bounded by progress, not time: it fails after `max_idle_rounds` rounds in a row in which
    nothing moved (no batch, output, status change, READ done or notification), however slow
    the machine."""
    pw = make_connector(connector, f"pe-{uuid.uuid4().hex[:6]}", _pools(p), p.config.block_size, p.kv_compat(),
                        progress_thread=False)
    dw = make_connector(connector, f"de-{uuid.uuid4().hex[:6]}", _pools(d), d.config.block_size, d.kv_compat(),
                        progress_thread=False)
    dw.add_peer(pw.handshake_info())
    run = PDRun()
    idle = 0
    while (p.has_unfinished() or d.has_unfinished()) and idle < max_idle_rounds:
        before = (sum(map(len, run.tokens.values())), _progress(p), _progress(d))
        moved = 0
        for o in p.step():
            run.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        for rid in list(p.requests):
            if (r := p.scheduler.get_request(rid)) is not None:
                run.states_p.setdefault(rid, []).append(r.status)
        for h in p.take_handoffs():
            h.prefill_engine_id = pw.engine_id
            table = d.add_handoff(h)
            assert table is not None
            run.states_d.setdefault(h.request_id, []).append(d.scheduler.get_request(h.request_id).status)
            dw.start_read(h.request_id, h.prefill_engine_id, h.block_table, table.to_dict(), h.num_kv_tokens,
                          d.cached_blocks(h.request_id))
        done, failed = dw.poll()
        assert not failed
        for rid in done:
            d.kv_received(rid)
        notes = pw.poll_notifications()
        for rid in notes["read"]:
            p.transfer_done(rid)
        moved += len(done) + sum(map(len, notes.values()))
        for o in d.step():
            run.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        for rid in list(d.requests):
            r = d.scheduler.get_request(rid)
            if r is not None and (not run.states_d.get(rid) or run.states_d[rid][-1] is not r.status):
                run.states_d.setdefault(rid, []).append(r.status)
        after = (sum(map(len, run.tokens.values())), _progress(p), _progress(d))
        idle = 0 if moved or after != before else idle + 1
        if idle:
            time.sleep(0.0005)  # a READ in flight: give UCX's sockets a moment
    assert not p.has_unfinished() and not d.has_unfinished(), \
        f"PD pipeline did not drain: nothing moved for {max_idle_rounds} rounds"
    p.check_no_leaks()
    d.check_no_leaks()
    pw.close()
    dw.close()
    return run
