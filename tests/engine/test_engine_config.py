"""EngineConfig embeds SchedulerConfig: flat keys (YAML `engine:` sections, keyword arguments)
and the nested `scheduler` section give one config; unknown keys and bad values are named."""

from __future__ import annotations

import pytest

from loopserve.engine.config import EngineConfig
from loopserve.engine.llm import make_config
from loopserve.scheduler import SchedulerConfig, SpeculativeConfig
from loopserve.scheduler.policy import POLICIES


def test_flat_and_nested_scheduler_keys_give_one_config():
    flat = EngineConfig(max_num_seqs=4, policy="priority", speculative={"num_draft_tokens": 2})
    nested = EngineConfig(scheduler={"max_num_seqs": 4, "policy": "priority",
                                     "speculative": {"num_draft_tokens": 2}})
    given = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, policy="priority",
                                                   speculative=SpeculativeConfig(num_draft_tokens=2)))
    assert flat == nested == given
    assert flat.scheduler.speculative == SpeculativeConfig(num_draft_tokens=2, draft_loops=1)
    assert EngineConfig(**flat.model_dump()) == flat  # dumps are nested and load back
    assert EngineConfig(split_prefill=True, max_num_batched_tokens=100).scheduler.prefill_chunk_size == 100


def test_overrides_merge_scheduler_keys_one_by_one():
    base = EngineConfig(max_num_seqs=4, policy="priority")
    assert make_config(base, max_num_batched_tokens=64).scheduler == SchedulerConfig(
        max_num_seqs=4, policy="priority", max_num_batched_tokens=64)
    assert make_config(base, scheduler={"max_num_seqs": 2}).scheduler.policy == "priority"
    assert make_config({"scheduler": {"max_num_seqs": 2}}, max_num_seqs=3).scheduler.max_num_seqs == 3


@pytest.mark.parametrize("kw, loc", [
    (dict(blok_size=4), "blok_size"),
    (dict(scheduler={"max_num_seq": 4}), "scheduler.max_num_seq"),
    (dict(coda_writes_kv=False), "coda_writes_kv"),  # the model's, not a setting
])
def test_unknown_keys_are_named(kw, loc):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert loc in str(e.value) and "Extra inputs are not permitted" in str(e.value)


def test_the_models_coda_writes_kv_cannot_be_set():
    with pytest.raises(ValueError, match="scheduler.coda_writes_kv comes from the model"):
        EngineConfig(scheduler={"coda_writes_kv": False})


def test_unknown_policy_names_the_field_and_every_registered_policy():
    with pytest.raises(ValueError) as e:
        EngineConfig(policy="fifo")
    msg = str(e.value)
    assert "scheduler.policy" in msg and "'fifo'" in msg and all(name in msg for name in POLICIES), msg


@pytest.mark.parametrize("kw, needles", [
    (dict(speculative={"num_draft_tokens": 17}), ["scheduler.speculative.num_draft_tokens", "less than or equal to 16"]),
    (dict(speculative={"num_draft_tokens": 5}, max_num_batched_tokens=4),
     ["speculative.num_draft_tokens (5)", "max_num_batched_tokens (4)"]),
])
def test_draft_length_bounds_name_the_field_and_limit(kw, needles):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert all(n in str(e.value) for n in needles), str(e.value)
