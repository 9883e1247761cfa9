"""Sampling reproducibility, abort, bad input, streaming and the Python API."""

import asyncio

import pytest

from loopserve.engine.llm import AsyncLLM, LLM
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.scheduler.invariants import check_invariants
from tests.engine.conftest import make_engine, run_to_completion, workload


def sampled(engine_kw, family, extra_requests):
    e = make_engine(family, **engine_kw)
    e.add_request([5, 6, 7, 8], SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9,
                                               seed=1234, ignore_eos=True), request_id="target")
    for rid, prompt, params in extra_requests:
        e.add_request(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True),
                      request_id=rid)
    outs, _ = run_to_completion(e)
    return outs["target"]


def test_seeded_sampling_is_independent_of_batch(family):
    alone = sampled({}, family, [])
    crowded = sampled({}, family, workload(seed=3, n=8))
    crowded_async = sampled({"async_scheduling": True}, family, workload(seed=4, n=5))
    assert alone == crowded == crowded_async
    assert len(set(alone)) > 1  # it really sampled


def test_abort_mid_generation_frees_every_block(family):
    e = make_engine(family)
    baseline = e.kv_manager.usage().used_blocks
    for rid, prompt, params in workload(seed=5, n=6, max_tokens=30):
        e.add_request(prompt, params, request_id=rid)
    for _ in range(25):
        e.step()
    e.abort("r0")
    e.abort("r3")
    outs = []
    while e.has_unfinished():
        outs += e.step()
        check_invariants(e.scheduler)
    aborted = [o for o in outs if o.finish_reason == "abort"]
    assert {o.request_id for o in aborted} == {"r0", "r3"}
    assert e.kv_manager.usage().used_blocks == baseline
    e.check_no_leaks()


def test_abort_every_request_at_every_step_drains(family):
    for k in range(0, 30, 7):
        e = make_engine(family, async_scheduling=bool(k % 2))
        for rid, prompt, params in workload(seed=k, n=4):
            e.add_request(prompt, params, request_id=rid)
        for _ in range(k):
            e.step()
        for rid in list(e.requests):
            e.abort(rid)
        run_to_completion(e)


@pytest.mark.parametrize(
    "prompt,kw,field",
    [
        ([], {}, "prompt"),
        ("x" * 200, {}, "max_model_len"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"min_loops": 3, "max_loops": 2}, "min_loops"),
        ([1, 2], {"max_loops": 99}, "max_loops"),
        ([1, 10**9], {}, "vocabulary"),
    ],
)
def test_bad_input_names_the_field_and_engine_keeps_serving(prompt, kw, field):
    e = make_engine("tiny-ouro")
    e.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), request_id="ok")
    with pytest.raises(ValueError, match=field):
        e.add_request(prompt, SamplingParams(**kw))
    outs, _ = run_to_completion(e)
    assert len(outs["ok"]) == 4


def test_a_request_that_can_never_fit_names_the_pool_setting_and_its_size():
    """The scheduler's admission checks it, for the blocks the role holds: a prefill engine
    only the prompt's, every other engine the prompt's and every output token's."""
    params = SamplingParams(max_tokens=40, max_loops=4, ignore_eos=True)
    e = make_engine("tiny-ouro", num_blocks=16)
    with pytest.raises(ValueError, match=r"'big' needs 48 looped KV blocks .*more than num_blocks \(16\)"):
        e.add_request([1] * 8, params, request_id="big")
    assert not e.has_unfinished()
    make_engine("tiny-ouro", num_blocks=16, role="prefill").add_request([1] * 8, params, request_id="big")


def test_abort_unknown_request_id():
    e = make_engine("tiny-ouro")
    with pytest.raises(ValueError, match="unknown request_id"):
        e.abort("nope")


def test_llm_generate_and_streaming_outputs(family):
    llm = LLM(model=family, block_size=4, num_blocks=512, max_model_len=128)
    outs = llm.generate(["hello", "looped world"], SamplingParams(max_tokens=8, ignore_eos=True,
                                                                  logprobs=2))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(len(o.exit_depths) == 8 and all(d >= 1 for d in o.exit_depths) for o in outs)
    assert all(len(o.logprobs) == 8 for o in outs)
    assert outs[0].first_token_time >= outs[0].arrival_time


def test_stop_string_cuts_the_reply():
    llm = LLM(model="tiny-ouro", block_size=4, num_blocks=512, max_model_len=128)
    free = llm.generate(["abc"], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    stop = free.text[3:5]
    if not stop:
        pytest.skip("reply too short to pick a stop string")
    cut = llm.generate(["abc"], SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and free.text.startswith(cut.text)


def test_async_llm_stream_and_cancel():
    async def main():
        engine = AsyncLLM(model="tiny-huginn", block_size=4, num_blocks=512, max_model_len=128)
        try:
            got = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))]
            assert sum(len(o.new_token_ids) for o in got) == 6 and got[-1].finished
            gen = engine.generate([4, 5], SamplingParams(max_tokens=100, ignore_eos=True), request_id="c")
            await gen.__anext__()
            await gen.aclose()  # client cancels -> abort
            for _ in range(100):
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.02)
            assert engine.engine.kv_manager.usage().used_blocks == 0
        finally:
            engine.shutdown()

    asyncio.run(main())
