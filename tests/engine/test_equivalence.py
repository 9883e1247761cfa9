"""Engine greedy output == dense full-recompute reference, token for token, for every policy."""

from dataclasses import replace

import pytest

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
