"""`loopserve serve` itself (the command, in its own process: config, cluster, both fronts),
driven by the official `openai` client: a streamed completion and a streamed chat
completion, then /metrics shows the looped metrics of that run; SIGTERM stops it cleanly.
The other HTTP tests run the same HttpServer in process, over a router they build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"mode": "colocated", "launcher": "process",
          "engine": {"model": "tiny-ouro", "device": "cpu", "block_size": 4, "num_blocks": 512,
                     "max_model_len": 256},
          "colocated": {"num_workers": 1},
          "server": {"host": "127.0.0.1", "port": 0, "http_port": 0}}


def _start(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """The server process and its HTTP URL, read from its 'loopserve serving' line."""
    cfg = tmp_path / "serve.yaml"
    template = tmp_path / "chat.jinja"  # tiny-ouro has none of its own: chat needs one named
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    cfg.write_text(yaml.safe_dump({**CONFIG, "server": {**CONFIG["server"], "chat_template": str(template)}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loopserve.cli", "serve", "--config", str(cfg),
                             "--duration", "300"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("loopserve serving"):
            return proc, line.rsplit(" on ", 1)[1].strip().removesuffix("/v1")
    proc.wait()
    raise AssertionError("loopserve serve exited before serving:\n" + "".join(lines[-30:]))


def test_openai_client_streams_from_loopserve_serve(tmp_path):
    proc, url = _start(tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny-ouro", prompt="loop", max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
        chunks = list(client.chat.completions.create(
            model="tiny-ouro", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            extra_body={"ignore_eos": True}))
        depths = [d for c in chunks if c.choices for d in c.choices[0].exit_depths]
        assert text and len(depths) == 4 and chunks[-1].choices[0].finish_reason == "length"
        metrics = {s.name: s.value for f in text_string_to_metric_families(
            urllib.request.urlopen(f"{url}/metrics").read().decode()) for s in f.samples if not s.labels}
        assert metrics["loopserve:generation_tokens_total"] == 8
        assert metrics["loopserve:token_exit_depth_count"] == 8
        assert metrics["loopserve:request_loops_per_token_count"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
