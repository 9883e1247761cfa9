"""A step that raises (a CUDA fault, a kernel bug): the engine is dead, every request on it
ends at once with finish_reason "error" and the exception's message, every block and state
row is freed, and new work is refused. The fault is injected by replacing a runner method."""

import asyncio
import itertools

import pytest

from loopserve.engine.engine_core import EngineCore, EngineFailedError
from loopserve.engine.llm import LLM, AsyncLLM
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.scheduler import RequestStatus
from loopserve.scheduler.invariants import check_invariants
from tests.engine.conftest import make_engine, workload

FAULT = "injected device fault"


def break_runner(monkeypatch, engine: EngineCore, op: str, after: int = 0) -> None:
    """From its `after`+1-th call on, the runner's `op` raises (as a faulting kernel would)."""
    real, calls = getattr(engine.runner, op), itertools.count()

    def broken(*args, **kwargs):
        if next(calls) >= after:
            raise RuntimeError(FAULT)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, op, broken)


def drain(engine: EngineCore) -> dict[str, RequestOutput]:
    """Step until nothing is unfinished; every request's final output."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return finals
        for o in engine.step():
            assert o.request_id not in finals, f"{o.request_id}: output after its final one"
            if o.finished:
                finals[o.request_id] = o
    raise AssertionError("engine did not drain")


def assert_failed(engine: EngineCore, finals: dict[str, RequestOutput], rids) -> None:
    assert set(finals) == set(rids)
    for o in finals.values():
        assert o.finish_reason == "error" and FAULT in o.error, o
    check_invariants(engine.scheduler)
    engine.check_no_leaks()
    assert engine.kv_manager.usage().used_blocks == 0
    with pytest.raises(EngineFailedError, match=FAULT):
        engine.add_request([1, 2, 3])


@pytest.mark.parametrize("op", ["prelude", "recurrent", "coda"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("defer_readback", [False, True])
def test_a_raising_step_ends_every_request_with_the_error(family, monkeypatch, op, async_scheduling,
                                                          defer_readback):
    e = make_engine(family, async_scheduling=async_scheduling, defer_readback=defer_readback,
                    max_num_seqs=4)  # some requests still wait when the fault comes
    work = workload(seed=11, n=8, max_tokens=20)
    for rid, prompt, params in work:
        e.add_request(prompt, params, request_id=rid)
    break_runner(monkeypatch, e, op, after=3)
    assert_failed(e, drain(e), [rid for rid, _, _ in work])


def test_failed_prefill_and_decode_engines_end_transferring_and_receiving_requests(family, monkeypatch):
    """Requests waiting for a reader (prefill) or for their KV (decode) end too: nothing
    will ever step them, so nothing may wait for them."""
    p = make_engine(family, role="prefill")
    d = make_engine(family, role="decode")
    work = workload(seed=12, n=6, max_tokens=8)
    for rid, prompt, params in work:
        p.add_request(prompt, params, request_id=rid)
    handoffs = []
    while len(handoffs) < 2:
        p.step()
        handoffs += p.take_handoffs()
    assert p.scheduler.get_request(handoffs[0].request_id).status is RequestStatus.TRANSFERRING
    for h in handoffs:
        assert d.add_handoff(h) is not None
    d.kv_received(handoffs[0].request_id)  # ACTIVE (its KV is garbage: it never runs)
    p.add_request([9, 8, 7], SamplingParams(max_tokens=4), request_id="late")  # a prelude to fail
    for engine in (p, d):
        break_runner(monkeypatch, engine, "prelude")
    assert_failed(d, drain(d), [h.request_id for h in handoffs])
    assert_failed(p, drain(p), [rid for rid, _, _ in work] + ["late"])


def test_llm_generate_returns_the_error_and_async_streams_end_with_it(monkeypatch):
    llm = LLM(model="tiny-ouro", block_size=4, num_blocks=512, max_model_len=128)
    break_runner(monkeypatch, llm.engine, "coda", after=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = llm.generate(["loop depth", "token cache state"], params)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all(FAULT in o.error for o in outs)
    with pytest.raises(EngineFailedError, match=FAULT):
        llm.generate("exit gate", params)

    alloc = AsyncLLM(model="tiny-ouro", block_size=4, num_blocks=512, max_model_len=128)
    break_runner(monkeypatch, alloc.engine, "recurrent", after=1)

    async def stream() -> list[RequestOutput]:
        return [o async for o in alloc.generate("loop depth", params)]

    try:
        last = asyncio.run(asyncio.wait_for(stream(), 120))[-1]
    finally:
        alloc.shutdown()
    assert last.finished and last.finish_reason == "error" and FAULT in last.error
