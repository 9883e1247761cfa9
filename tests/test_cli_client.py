"""`loopserve client`, `loopserve generate` and `loopserve bench serve` against the shipped
trained model, as the README runs them: the client prints the reply on stdout and, on stderr,
each token's exit depth (the README's "4 loops" / "exits after 3 loops"); generate's default
model is the server's; bench serve writes under the git-ignored results/ and says where; a
prompt over the default cluster's max_model_len gets the refusal README.md and
docs/reliability.md quote."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from loopserve.cli import main
from loopserve.cluster.config import ClusterConfig
from loopserve.cluster.router.core import Router
from loopserve.engine.config import DEFAULT_MODEL, EngineConfig
from tests.cluster.conftest import http_serving, serving
from tests.cluster.inprocess import InProcessHandle

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "o=7;z=o;c=8;p=c;j=a;a=p;j=?"  # j=a, a=p, p=c, c=8: four hops
ENGINE = ClusterConfig().engine.model_dump()  # the default cluster's: max_model_len 512


@pytest.fixture(scope="module")
def router():
    handle = InProcessHandle("cli-client", ENGINE)
    r = Router([handle], poll_s=0.1).start()
    yield r
    r.close()
    handle.shutdown()


@pytest.mark.parametrize("flags,text,depths", [
    ([], "8", [4, 4]),                              # fixed depth: the answer and EOS, 4 loops each
    (["--max-loops", "2"], "7", [2, 2]),            # too few loops for four hops
    (["--exit-threshold", "0.9"], "8", [3, 1]),     # the exit gate stops the answer after 3
])
def test_client_prints_the_reply_then_each_tokens_exit_depth(router, capsys, flags, text, depths):
    with serving(router) as client:
        assert main(["client", PROMPT, "--address", client.address, *flags]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == text
    assert err.strip().splitlines()[-1] == f"--- stop; 2 tokens; exit depths {depths}"


def test_one_default_model_everywhere(capsys):
    assert EngineConfig().model == ClusterConfig().engine.model == DEFAULT_MODEL == "tiny-ouro-chains"
    assert main(["generate", PROMPT, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "8" and out["exit_depths"] == [4, 4]


def test_bench_serve_writes_under_the_ignored_results_dir(router, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with http_serving(router, ENGINE) as server:
        code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "3", "--input-len", "5",
                     "--output-len", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    result, plot = tmp_path / "results" / "bench-result.json", tmp_path / "results" / "bench-latency.png"
    assert json.loads(result.read_text())["completed"] == 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"result: {result}" in out and f"latency CDFs: {plot}" in out
    names = ["results/bench-result.json", "results/bench-latency.png"]
    ignored = subprocess.run(["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == names, "results/ is not git-ignored"


def _refusal(prompt_len: int, max_tokens: int) -> str:
    return f"prompt length ({prompt_len}) + max_tokens ({max_tokens}) must be <= max_model_len (512)"


def test_the_default_limits_are_what_the_docs_say(router, capsys):
    """512 tokens for prompt + max_tokens, one token per UTF-8 byte: 480 bytes + 32 is served,
    481 bytes (476 characters) + 32 is refused, as is the issue's 2000-character prompt."""
    assert ENGINE["max_model_len"] == 512 and ENGINE["model"] == DEFAULT_MODEL
    with serving(router) as client:
        assert main(["client", "a" * 480, "--address", client.address]) == 0
        capsys.readouterr()
        assert main(["client", "é" * 5 + "a" * 471, "--address", client.address]) == 1
        assert capsys.readouterr().err.strip() == f"loopserve: error: INVALID_ARGUMENT: {_refusal(481, 32)}"
        assert main(["client", "a" * 2000, "--address", client.address]) == 1
        assert capsys.readouterr().err.strip() == f"loopserve: error: INVALID_ARGUMENT: {_refusal(2000, 32)}"
    with http_serving(router, ENGINE) as server:
        req = urllib.request.Request(f"{server.url}/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": DEFAULT_MODEL, "prompt": "a" * 2000}).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["message"] == _refusal(2000, 16)
    for doc in ("README.md", "docs/reliability.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert _refusal(2000, 16) in text, doc
