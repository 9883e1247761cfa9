"""HandoffMessage: validation that names the field, plain-types round trips, derived facts."""

from __future__ import annotations

import json

import msgpack
import pytest

from loopserve.protocol.handoff import HandoffMessage, compat_hash
from loopserve.protocol.sampling_params import SamplingParams

COMPAT = {"model": "tiny-huginn", "dtype": "float32", "block_size": 4, "max_loops": 2}


def message(**over) -> HandoffMessage:
    fields = dict(
        request_id="req-1", prompt_token_ids=[5, 6, 7, 8, 9], output_token_ids=[11],
        exit_depths=[2, 1, 2, 2, 1],
        params=SamplingParams(max_tokens=4, temperature=0.7, seed=3, min_loops=1, max_loops=2,
                              exit_threshold=0.9, stop=("\n",)),
        seed=3, block_table={"flat": [4, 9], "depth": [[0, 1], [7, 2]]}, num_kv_tokens=5,
        arrival_time=10.5, first_token_time=10.75, prefill_engine_id="prefill-0", compat=dict(COMPAT))
    return HandoffMessage(**{**fields, **over})


def test_json_and_msgpack_round_trips_are_exact():
    m = message()
    assert HandoffMessage.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert HandoffMessage.from_dict(msgpack.unpackb(msgpack.packb(m.to_dict()))) == m
    assert json.loads(json.dumps(m.to_dict()))["block_table"] == {"flat": [4, 9], "depth": [[0, 1], [7, 2]]}


def test_derived_facts():
    m = message()
    assert m.block_size == 4 and m.num_draws == 1
    assert m.loop_params == {"min_loops": 1, "max_loops": 2, "exit_threshold": 0.9}
    assert m.table().depth == [[0, 1], [7, 2]] and m.table().flat == [4, 9]
    assert m.looped_blocks() == 3 * 2  # (5 prompt + 4 max_tokens) tokens in blocks of 4, 2 planes
    assert m.compat_hash == compat_hash(dict(reversed(list(COMPAT.items()))))  # key order does not matter
    assert m.compat_hash != message(compat={**COMPAT, "dtype": "bfloat16"}).compat_hash


@pytest.mark.parametrize("over,match", [
    ({"request_id": ""}, "request_id must be a non-empty string"),
    ({"output_token_ids": []}, "output_token_ids must hold the first token"),
    ({"num_kv_tokens": 7}, r"num_kv_tokens must be in \[1, 6\].*got 7"),
    ({"num_kv_tokens": 0}, r"num_kv_tokens must be in \[1, 6\].*got 0"),
    ({"exit_depths": [1, 1]}, "exit_depths must cover the 5 positions with KV and at most 6, got 2"),
    ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*63\), got -1"),
    ({"compat": {"model": "x"}}, r"compat\['block_size'\] must be an integer >= 1, got None"),
    ({"block_table": {"depth": [[0, 1]]}}, "block_table must be"),
    ({"block_table": {"flat": [], "depth": []}}, "block_table has no depth planes"),
    ({"block_table": {"flat": [4, 9], "depth": [[0, 1], [7]]}},
     r"block_table depth\[1\] has 1 blocks, fewer than the 2 that 5 tokens need at block_size 4"),
    ({"block_table": {"flat": [4], "depth": [[0, 1], [7, 2]]}}, "block_table flat has 1 blocks"),
])
def test_bad_messages_are_refused_naming_the_field(over, match):
    with pytest.raises(ValueError, match=match):
        message(**over)


def test_a_one_plane_handoff_reserves_one_plane():
    """A model whose loops share one KV plane (Dory last_loop) hands over one plane whatever
    max_loops is: the block table, not max_loops, sizes the reservation."""
    m = message(block_table={"flat": [4, 9], "depth": [[0, 1]]})
    assert m.params.max_loops == 2 and m.looped_blocks() == 3


def test_params_must_be_sampling_params():
    with pytest.raises(ValueError, match="params must be SamplingParams, got dict"):
        message(params={"max_tokens": 4})


def test_from_dict_names_unknown_and_missing_fields():
    d = message().to_dict()
    with pytest.raises(ValueError, match=r"unknown fields \['lease'\]"):
        HandoffMessage.from_dict({**d, "lease": 1})
    del d["seed"], d["num_kv_tokens"]
    with pytest.raises(ValueError, match=r"missing fields \['num_kv_tokens', 'seed'\]"):
        HandoffMessage.from_dict(d)
    del d["compat"], d["prefill_engine_id"]  # defaulted fields may be absent ...
    with pytest.raises(ValueError, match="compat"):  # ... but a message needs the block size
        HandoffMessage.from_dict({**d, "seed": 3, "num_kv_tokens": 5})
