"""Prompts past every initial capacity (tests/real_shapes.py) through `LLM.generate` with every
policy, defer_readback on and off, and through the CPU twins of the GPU paths: greedy tokens
and exit depths equal the dense full-recompute reference."""

from dataclasses import replace

import pytest

from loopserve.engine.llm import LLM
from loopserve.scheduler import RequestStatus
from tests.engine.conftest import make_engine, reference, run_pd, run_to_completion
from tests.engine.test_deferred_readback import stream
from tests.real_shapes import (
    ENGINE,
    LONG_PROMPTS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    SLAB_ROWS,
    check_lengths_exceed_capacities,
    prompt_of,
    workload,
)

# tests/engine/test_equivalence.py's CONFIGS at real shapes: prompt chunks of the default size
CONFIGS = {
    "refill": {},
    "refill-async": {"async_scheduling": True},
    "no_refill": {"policy": "no_refill"},
    "priority": {"policy": "priority"},
    "mixed-split": {"policy": "mixed", "split_prefill": True, "prefill_chunk_size": 256,
                    "max_num_batched_tokens": 512},
    "split-async": {"split_prefill": True, "prefill_chunk_size": 256, "async_scheduling": True},
    # a pool just big enough for the 2100-token request: whether requests that all arrive at
    # once preempt depends on their order; test_long_prompts_preempted_and_offloaded makes sure
    "preempt-offload": {"policy": "priority", "incremental_kv": True, "num_blocks": 530,
                        "preemption_mode": "offload"},
    "speculative": {"speculative": {"num_draft_tokens": 3, "draft_loops": 1}},
}


def later_first(items):
    """Later requests more important (priority: lower first)."""
    return [replace(it, params=replace(it.params, priority=-k)) for k, it in enumerate(items)]


def check(family, items, outs):
    for it in items:
        tokens, depths = reference(family, it.prompt, it.params)
        assert outs[it.request_id] == (list(tokens), list(depths)), f"{it.request_id} ({len(it.prompt)} tokens)"


def test_lengths_exceed_capacities():
    check_lengths_exceed_capacities()
    e = make_engine("tiny-ouro", **ENGINE)
    assert e.runner.states.capacity == SLAB_ROWS < min(LONG_PROMPTS)


@pytest.mark.parametrize("defer", [True, False], ids=["defer", "sync"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_llm_generate_long_prompts_match_dense_reference(family, cfg, defer):
    items = workload()
    if "priority" in CONFIGS[cfg].get("policy", ""):
        items = later_first(items)
    llm = LLM(model=family, **{**ENGINE, **CONFIGS[cfg], "defer_readback": defer})
    outs = llm.generate([it.prompt for it in items], [it.params for it in items])
    check(family, items, {it.request_id: (o.token_ids, o.exit_depths) for it, o in zip(items, outs)})
    e = llm.engine
    e.check_no_leaks()
    assert e.runner.states.version > 0, "the state slab must have grown"
    assert len(items) > MAX_NUM_SEQS == e.config.scheduler.max_num_seqs
    if cfg == "speculative":
        assert e.counters.spec_accepted > 0


@pytest.mark.parametrize("defer", [True, False], ids=["defer", "sync"])
def test_long_prompts_preempted_and_offloaded(family, defer):
    """The long prompts run first; more important short requests arrive while they do and take
    their seats and blocks: long prompts' KV is offloaded and comes back."""
    items = workload()
    long = [it for it in items if len(it.prompt) in LONG_PROMPTS]
    short = later_first([it for it in items if it not in long])
    short = [replace(it, params=replace(it.params, priority=it.params.priority - 10)) for it in short]
    # the three long requests' blocks and a few more (each depth is a plane of blocks)
    e = make_engine(family, **{**ENGINE, "policy": "priority", "incremental_kv": True,
                               "num_blocks": 900, "preemption_mode": "offload", "defer_readback": defer})
    offloaded = []
    offload = e.scheduler._offload
    e.scheduler._offload = lambda st: offloaded.append(st.request_id) or offload(st)
    for it in long:
        e.add_request(it.prompt, it.params, request_id=it.request_id)
    outs, depths = run_to_completion(e, arrivals=[(it.request_id, it.prompt, it.params) for it in short],
                                     every=2)
    assert {it.request_id for it in long} & set(offloaded), offloaded
    check(family, items, {rid: (outs[rid], depths[rid]) for rid in outs})


def test_padded_decode_path_at_long_contexts(family):
    """The CUDA-graph path's CPU twin: decode batches padded to the graph sizes, context
    buckets up to max_model_len, the slab growing under them."""
    e = make_engine(family, **ENGINE)
    e.runner.use_graphs(MAX_NUM_SEQS, MAX_MODEL_LEN // ENGINE["block_size"], capture=False)
    contexts = []
    run = e.runner.graphs.run
    e.runner.graphs.run = lambda hb, *a: contexts.append(max(hb.context_lens)) or run(hb, *a)
    items = workload()
    for it in items:
        e.add_request(it.prompt, it.params, request_id=it.request_id)
    outs, depths = run_to_completion(e)
    assert max(contexts) > max(LONG_PROMPTS) and e.runner.states.version > 0
    check(family, items, {rid: (outs[rid], depths[rid]) for rid in outs})


@pytest.fixture
def lagging(monkeypatch):
    from loopserve.engine.sampler import DrawnTokens

    monkeypatch.setattr(DrawnTokens, "ready", lambda self: False)


def test_deferred_readback_streams_at_long_prompts(family, lagging):
    """A device that always lags: every sample is read late (tests/engine/test_deferred_readback.py)
    at long prompts, sampled and greedy, logprobs, stop tokens: streams equal the immediate read-back's."""
    work = []
    for k, it in enumerate(workload()):
        p = it.params
        if k % 3 == 1:
            p = replace(p, temperature=0.8, top_k=40, top_p=0.95)
        if k % 4 == 0:
            p = replace(p, logprobs=3)
        work.append((it.request_id, it.prompt, p))
    cfg = ENGINE
    free, _ = stream(family, work, defer=False, **cfg)
    work = [(rid, prompt, replace(p, stop_token_ids=[free[rid][0][0][2]]) if k % 2 else p)
            for k, (rid, prompt, p) in enumerate(work)]
    want, _ = stream(family, work, defer=False, **cfg)
    got, _ = stream(family, work, defer=True, **cfg)
    assert {r: v[0] for r, v in got.items()} == {r: v[0] for r, v in want.items()}
    for rid, (_, values) in want.items():
        assert got[rid][1] == pytest.approx(values, abs=1e-4), rid
    assert [v[0][3] for v in want.values()].count("stop") >= 3


def test_prefill_decode_engines_at_long_prompts(family):
    """Engine-level PD (real NIXL READ of every plane) at long prompts == dense reference."""
    p = make_engine(family, **ENGINE, role="prefill")
    d = make_engine(family, **ENGINE, role="decode")
    items = workload()
    for it in items:
        p.add_request(it.prompt, it.params, request_id=it.request_id)
    run = run_pd(p, d)
    for it in items:
        assert run.tokens[it.request_id] == list(reference(family, it.prompt, it.params)[0]), it.request_id
        assert run.states_d[it.request_id][:2] == [RequestStatus.RECEIVING, RequestStatus.ACTIVE]


def test_text_prompt_past_the_slab(family):
    """The issue's repro: a text prompt of more bytes than the slab has rows, tokenized by the
    engine (the byte tokenizer)."""
    text = "".join(chr(32 + t % 95) for t in prompt_of(LONG_PROMPTS[0]))
    params = workload()[0].params
    llm = LLM(model=family, **ENGINE)
    [out] = llm.generate(text, params)
    ids = llm.engine.tokenizer.encode(text)
    assert out.prompt_token_ids == ids and len(ids) > SLAB_ROWS
    assert (out.token_ids, out.exit_depths) == tuple(map(list, reference(family, ids, params)))
