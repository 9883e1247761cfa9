"""The chaos run's short mode in the default suite: `benchmarks/chaos.py` for 15 s on 2P2D
(plain processes: they start in seconds) with a worker frozen or killed every ~4 s: no request
lost (each completes or gets a clear 4xx/503), no KV block held afterwards, and a request
served normally after. The 5-minute run of record is in docs/reliability.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_chaos_run_loses_no_request_and_holds_no_block():
    out = subprocess.run([sys.executable, "benchmarks/chaos.py", "--duration", "15", "--fault-every", "4",
                          "--launcher", "process", "--concurrency", "8"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    text = out.stdout
    summary, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
    assert out.returncode == 0, text[-4000:] + out.stderr[-4000:]
    assert summary["lost"] == 0 and summary["ok"] > 0 and summary["refused_4xx_503"] > 0, summary
    assert summary["faults"] and all(v == 0 for v in summary["blocks_after"].values()), summary
    assert summary["after_ok"]
