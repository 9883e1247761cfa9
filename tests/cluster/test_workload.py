"""summarize(): the figures every benchmark and `--workload` job reports."""

from loopserve.cluster.workload import RequestResult, summarize


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
