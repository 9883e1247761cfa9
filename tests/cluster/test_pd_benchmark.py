"""benchmarks/pd_vs_colocated.py when a mode fails: that mode's errors are printed, the modes
that ran still get their table row and PNG curves, nothing waits for requests that already
ended, a zero goodput gives "n/a" ratios, and the exit status is 1.

Each mode's cluster is one in-process colocated worker; the colocated mode's engine is
broken from the test side, in its warm-up or in the measured run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from loopserve.bench import pd_compare
from loopserve.cluster.placement import stop_all
from loopserve.cluster.router.core import Router
from tests.cluster.conftest import ENGINE
from tests.cluster.faulty import FAULT, break_engine
from tests.cluster.inprocess import InProcessHandle

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pd_vs_colocated.py"


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("pd_vs_colocated", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_process_cluster(break_after_tokens: int):
    class InProcessCluster:
        """Stands in for Cluster: the colocated mode's engine fails once a request has
        `break_after_tokens` tokens (warm-up requests stop at 8)."""

        def __init__(self, config) -> None:
            self.mode = config.mode

        def __enter__(self):
            self.handles = [InProcessHandle(f"bench-{self.mode}", ENGINE)]
            if self.mode == "colocated":
                break_engine(self.handles[0].host, break_after_tokens)
            self.router = Router(self.handles, poll_s=0.1).start()
            return self

        def __exit__(self, *exc) -> None:
            self.router.close()
            stop_all(self.handles)

    return InProcessCluster


@pytest.mark.parametrize("phase,after_tokens", [("warm-up", 0), ("measured", 16)])
def test_a_failed_mode_is_reported_and_the_other_still_written(monkeypatch, tmp_path, capsys,
                                                                 phase, after_tokens):
    bench = _load_benchmark()
    monkeypatch.setattr(pd_compare, "Cluster", in_process_cluster(after_tokens))
    png = tmp_path / "cdf.png"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--requests", "4", "--rate", "100",
                                      "--max-tokens", "24", "--png", str(png)])
    assert bench.main() == 1
    out = capsys.readouterr().out
    assert png.exists()
    assert any(line.startswith("1P1D ") and line.endswith(" 4/4") for line in out.splitlines()), out
    if phase == "warm-up":
        assert "colocated: failed: RuntimeError: 16 of 16 warm-up requests failed" in out
        assert FAULT in out and "ratios" not in out
    else:
        assert "colocated: 4 of 4 requests failed:" in out and f"4 x engine failed: RuntimeError: {FAULT}" in out
        assert any(line.startswith("colocated ") and line.endswith(" 0/4") for line in out.splitlines()), out
        assert "goodput_req_s n/a" in out  # the colocated goodput is 0
