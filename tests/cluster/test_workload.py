"""summarize(): the figures every benchmark and `--workload` job reports."""

import pytest

from loopserve.bench.workload import RequestResult, summarize


def _result(rid: str, tokens: int, ttft: float, tpot: float, error: str | None = None) -> RequestResult:
    done = ttft + tpot * (tokens - 1)
    return RequestResult(rid, token_ids=list(range(tokens)), finish_reason="length", error=error,
                         submitted=0.0, first_token=ttft, done=done)


def test_goodput_counts_ok_requests_within_the_tpot_slo():
    results = [_result("fast", 5, 0.1, 0.01), _result("slow", 5, 0.1, 0.2),
               _result("one-token", 1, 0.1, 0.0), _result("failed", 5, 0.1, 0.01, error="boom")]
    s = summarize(results, wall_s=2.0, slo_tpot_s=0.05)
    assert s["ok"] == 3 and s["output_tokens"] == 11
    assert s["goodput_req_s"] == 1.0  # fast + one-token (no TPOT to miss), over 2 s
    assert s["tpot_p99_ms"] == 200.0 and s["ttft_p50_ms"] == 100.0
    assert "goodput_req_s" not in summarize(results, wall_s=2.0)


def test_greedy_divergence_tells_a_near_tie_from_a_real_difference():
    from loopserve.bench.workload import RequestResult, greedy_divergence

    def res(tokens, tops):
        return RequestResult("r", token_ids=tokens, top_logprobs=tops)

    same = res([1, 2], [{1: -0.1, 5: -3.0}, {2: -0.2, 7: -2.0}])
    assert greedy_divergence(same, res([1, 2], [])) is None
    a = res([1, 2, 3], [{1: -0.1}, {2: -0.70, 4: -0.75}, {3: -0.1}])
    b = res([1, 4, 9], [{1: -0.1}, {4: -0.69, 2: -0.72}, {9: -0.1}])
    assert greedy_divergence(a, b) == (1, pytest.approx(0.05))
    far = res([1, 6], [{1: -0.1}, {6: -0.1, 8: -4.0}])  # 2 is not even in its top logprobs
    assert greedy_divergence(a, far) == (1, float("inf"))
    assert greedy_divergence(res([1], [{1: 0.0}]), res([1, 2], [{1: 0.0}, {2: 0.0}]))[1] == float("inf")
