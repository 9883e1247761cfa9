import random

import pytest

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.engine.sampling_params import SamplingParams
from loopserve.model.dense_reference import dense_greedy_generate
from loopserve.model.registry import resolve_model
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
        engine.scheduler.assert_invariants()
        steps += 1
        assert steps < max_steps, "engine did not drain"
    engine.check_no_leaks()
    return outs, depths


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
