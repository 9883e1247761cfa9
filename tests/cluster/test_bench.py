"""`loopserve bench serve` against real servers (HTTP and gRPC fronts over the in-process
colocated worker): every request completes, the counts agree with the workload, and the JSON
result and the PNG are written."""

from __future__ import annotations

import json

import pytest

from loopserve.bench.dataset import random_requests
from loopserve.cli import main
from tests.cluster.conftest import http_serving, serving


def test_random_requests_are_seeded_and_share_the_prefix():
    a = random_requests(5, input_len=8, output_len=4, range_ratio=0.5, prefix_len=3, seed=1)
    assert a == random_requests(5, input_len=8, output_len=4, range_ratio=0.5, prefix_len=3, seed=1)
    assert len({tuple(r.prompt[:3]) for r in a}) == 1
    assert all(4 + 3 <= len(r.prompt) <= 12 + 3 and 2 <= r.max_tokens <= 6 for r in a)


@pytest.mark.parametrize("backend", ["openai", "grpc"])
def test_bench_serve_writes_its_result_and_plot(colocated_router, tmp_path, capsys, backend):
    result, plot = tmp_path / "r.json", tmp_path / "cdf.png"
    args = ["bench", "serve", "--backend", backend, "--num-prompts", "6", "--input-len", "5",
            "--output-len", "4", "--request-rate", "50", "--max-concurrency", "4", "--max-loops", "2",
            "--goodput", "ttft:60000", "tpot:60000", "--result-file", str(result), "--plot", str(plot),
            "--no-progress"]
    if backend == "openai":
        with http_serving(colocated_router) as s:
            code = main(args + ["--base-url", s.url])
    else:
        with serving(colocated_router) as client:
            code = main(args + ["--address", client.address])
    out = capsys.readouterr().out
    assert code == 0, out
    r = json.loads(result.read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (6, 0, 24)
    assert r["total_input_tokens"] == 30 and r["request_goodput"] > 0
    assert all(r[k]["median"] > 0 for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
    assert len(r["requests"]) == 6 and all(len(q["itl_s"]) == 3 for q in r["requests"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Successful requests" in out and "Median TTFT (ms)" in out
