"""benchmarks/prefix_pd.py's library on a tiny 1P1D process cluster: its workloads have the
documented shapes; every arm gives the same greedy tokens; with the features off nothing is
found cached and every prompt is prefilled remotely; with a threshold above every prompt's
length every prompt is prefilled on its decode worker and no KV is read. Nothing is timed."""

from __future__ import annotations

import argparse

from loopserve.bench.prefix_pd import (Arm, add_arguments, print_table, run_arm, shared_prefix_workload,
                                       short_workload)


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_workloads_have_the_documented_shapes():
    items = shared_prefix_workload(40, 2.0, 0, num_prefixes=3, prefix_len=64, turn_len=(5, 9), max_tokens=3)
    prefixes = {tuple(it.prompt[:64]) for it in items}
    assert len(prefixes) == 3 and all(69 <= len(it.prompt) <= 73 for it in items)
    arrivals = [it.arrival_s for it in items]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 < arrivals[-1]
    assert all(it.params.max_tokens == 3 and it.params.ignore_eos for it in items)
    short = short_workload(20, float("inf"), 1, prompt_len=(5, 40), max_tokens=2)
    assert all(5 <= len(it.prompt) <= 40 and it.arrival_s == 0 for it in short)
    assert len({it.request_id for it in items + short}) == 60


def test_arms_give_equal_tokens_and_count_where_prompts_went(capsys):
    args = _args(prefill_workers=1, decode_workers=1, num_blocks=2048)
    items = shared_prefix_workload(10, 50.0, 0, num_prefixes=2, prefix_len=48, turn_len=(3, 20), max_tokens=4)
    warm = shared_prefix_workload(2, float("inf"), 9, num_prefixes=1, prefix_len=48, turn_len=(3, 5), max_tokens=2)
    runs = {arm.name: run_arm(arm, warm, items, args)
            for arm in (Arm("off", False, False, 0), Arm("local", True, True, 1000))}
    off, local = runs["off"].counters, runs["local"].counters
    assert off["prefix_hits"] == 0 and off["prefill_local"] == 0 and off["prefill_remote"] == 10
    assert off["read_bytes"] > 0
    assert local["prefill_local"] == 10 and local["prefill_remote"] == 0 and local["read_bytes"] == 0
    assert all(r.summary["ok"] == 10 for r in runs.values())
    assert print_table("tiny", runs, "off") is False  # no failure, greedy tokens equal
    out = capsys.readouterr().out
    assert "greedy tokens: local equals off for 10/10 requests" in out
