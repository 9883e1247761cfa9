"""Engine greedy output == dense full-recompute reference, token for token, for every policy."""

from dataclasses import replace

import pytest

from loopserve.engine.config import EngineConfig
from loopserve.protocol.sampling_params import SamplingParams
from tests.engine.conftest import make_engine, reference, run_to_completion, workload

CONFIGS = {
    "refill": {},
    "refill-async": {"async_scheduling": True},
    "no_refill": {"policy": "no_refill"},
    "priority": {"policy": "priority", "max_num_seqs": 4},
    "mixed-split": {"policy": "mixed", "split_prefill": True, "prefill_chunk_size": 8,
                    "max_num_batched_tokens": 24},
    "split-async": {"split_prefill": True, "prefill_chunk_size": 5, "async_scheduling": True},
    "preempt-incremental": {"policy": "priority", "incremental_kv": True, "num_blocks": 48,
                            "max_num_seqs": 6, "preemption_mode": "offload"},
    "priority-keep-async": {"policy": "priority", "max_num_seqs": 3, "async_scheduling": True},
    "speculative": {"speculative": {"num_draft_tokens": 3, "draft_loops": 1}},
}


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_engine_matches_dense_reference(family, cfg):
    engine = make_engine(family, **CONFIGS[cfg])
    work = workload(seed=1)
    if "priority" in cfg or "preempt" in cfg:  # later arrivals are more important: preemption
        work = [(rid, prompt, replace(p, priority=-int(rid[1:]))) for rid, prompt, p in work]
    # half the requests are there at the start, the rest arrive while the others run
    for rid, prompt, params in work[:8]:
        engine.add_request(prompt, params, request_id=rid)
    outs, depths = run_to_completion(engine, arrivals=work[8:])
    if "priority" in cfg or "preempt" in cfg:
        assert engine.counters.preemptions > 0, "the workload must actually preempt"
    if cfg == "speculative":
        assert engine.counters.spec_accepted > 0
    for rid, prompt, params in work:
        tokens, ref_depths = reference(family, prompt, params)
        assert outs[rid] == list(tokens), f"{cfg}/{rid}: tokens differ"
        assert depths[rid] == list(ref_depths), f"{cfg}/{rid}: exit depths differ"


def test_engine_equals_serial_execution(family):
    """A request's output does not depend on who shares its batches."""
    work = workload(seed=2, n=6)
    batched = make_engine(family)
    for rid, prompt, params in work:
        batched.add_request(prompt, params, request_id=rid)
    together, _ = run_to_completion(batched)
    for rid, prompt, params in work:
        alone = make_engine(family)
        alone.add_request(prompt, params, request_id=rid)
        single, _ = run_to_completion(alone)
        assert single[rid] == together[rid]


def _with_logprobs(engine, work):
    """Each request's tokens, logprobs and top logprobs, the whole stream joined."""
    for rid, prompt, params in work:
        engine.add_request(prompt, params, request_id=rid)
    got: dict[str, tuple[list, list, list]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks, lps, tops = got.setdefault(o.request_id, ([], [], []))
            toks.extend(o.new_token_ids)
            lps.extend(o.logprobs or ())
            tops.extend(o.top_logprobs or ())
    engine.check_no_leaks()
    return got


def test_speculative_logprobs_equal_plain_decoding(family):
    """Tokens accepted in a speculative round carry the logprob (and top alternatives) that
    plain greedy decoding reports for them."""
    work = [(rid, prompt, replace(p, logprobs=k % 3)) for k, (rid, prompt, p) in enumerate(workload(seed=3, n=8))]
    spec = make_engine(family, speculative={"num_draft_tokens": 3, "draft_loops": 1})
    got = _with_logprobs(spec, work)
    assert spec.counters.spec_accepted > 0
    want = _with_logprobs(make_engine(family), work)
    for rid, prompt, p in work:
        (toks, lps, tops), (ref_toks, ref_lps, ref_tops) = got[rid], want[rid]
        assert toks == ref_toks, f"{rid}: tokens differ"
        assert len(lps) == len(toks) and lps == pytest.approx(ref_lps, abs=1e-4), f"{rid}: logprobs differ"
        assert len(tops) == (len(toks) if p.logprobs else 0)
        for row, ref_row in zip(tops, ref_tops):
            assert len(row) == p.logprobs and [i for i, _ in row] == [i for i, _ in ref_row]
            assert [v for _, v in row] == pytest.approx([v for _, v in ref_row], abs=1e-4)


def test_speculation_as_wide_as_the_batch_budget_finishes_and_wider_is_refused(family):
    """A verify round is num_draft_tokens rows in one batch: equal to max_num_batched_tokens
    it runs (and matches the reference); one more would never be scheduled, so it is refused."""
    engine = make_engine(family, max_num_batched_tokens=3, speculative={"num_draft_tokens": 3, "draft_loops": 1})
    prompt, params = [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=12, ignore_eos=True, max_loops=4,
                                                        exit_threshold=1.0, seed=0)
    engine.add_request(prompt, params, request_id="r")
    outs, _ = run_to_completion(engine)
    assert engine.counters.spec_accepted > 0
    assert outs["r"] == list(reference(family, prompt, params)[0])
    with pytest.raises(ValueError, match=r"num_draft_tokens \(4\).*max_num_batched_tokens \(3\)"):
        EngineConfig(model=family, max_num_batched_tokens=3, speculative={"num_draft_tokens": 4})
