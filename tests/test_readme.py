"""The README's every code block runs as written, on the checkout under test (issue 40).

`bash scripts/run.sh` starts the server the other blocks talk to; every other bash line and
python block then runs in the environment scripts/env.sh picks, from the checkout's root, and
must exit 0. What a block says it prints is checked: `# prints X` (X a line of stdout), a
quoted "text" in that comment (in stdout or stderr), and JSON shown in comment lines after a
command (each `"key":value` of it in the reply). Not run here, each named below with the
test that runs it instead: the test suite itself, the Ray job recipe, the GPU commands.

The default ports (50051, 8000) are used when free, so the commands run verbatim (as on CI);
when another server holds one, free ports replace them in the commands, and nothing else does.
When this checkout is not the installed loopserve (a second worktree), run.sh's install step
would install it: then the server is run.sh's own serve command, without the install.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SERVER_BLOCK = "bash scripts/run.sh"
NOT_RUN = {  # a substring of the block: why it is not run here
    "bash scripts/test.sh": "the test suite itself (CI runs it)",
    "ray job submit": "the Ray job recipe: tests/cluster/test_job.py submits the job to a head it starts",
    "configs/h200-1p1d.yaml": "needs CUDA: scripts/gpu_check.sh runs these",
}
DEFAULT_PORTS = (50051, 8000)


@dataclass
class Command:
    text: str
    comment: str        # the comment on its line
    shown: list[str]    # comment lines after it (output it shows)


def code_blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(bash|python)\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def _split_comment(line: str) -> tuple[str, str]:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def bash_commands(block: str) -> list[Command]:
    commands: list[Command] = []
    pending = ""
    for raw in block.splitlines():
        code, comment = _split_comment(raw)
        if not code.strip():
            if comment and commands and not pending:
                commands[-1].shown.append(comment)
            continue
        if code.endswith("\\"):
            pending += code[:-1] + " "
            continue
        commands.append(Command(pending + code, comment, []))
        pending = ""
    return commands


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    grpc: int
    http: int

    def rewrite(self, text: str) -> str:
        """The command with this server's ports where they are not the defaults."""
        if (self.grpc, self.http) == DEFAULT_PORTS:
            return text
        text = text.replace("127.0.0.1:50051", f"127.0.0.1:{self.grpc}").replace(
            "127.0.0.1:8000", f"127.0.0.1:{self.http}")
        if text.startswith("loopserve client") and "--address" not in text:
            text += f" --address 127.0.0.1:{self.grpc}"
        if text.startswith("loopserve bench serve") and "--base-url" not in text:
            text += f" --base-url http://127.0.0.1:{self.http}"
        return text


def _env() -> dict[str, str]:
    """A user's shell: without the Ray and Triton settings this test session made for itself
    (its own Ray token, the Triton interpreter), with this checkout's loopserve first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "TRITON_INTERPRET"}
    return {**env, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}


def _in_env(command: str) -> list[str]:
    return ["bash", "-c", f"set -eo pipefail; source scripts/env.sh; {command}"]


def _installed_here() -> bool:
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    r = subprocess.run(_in_env("cd / && python3 -c 'import loopserve, pathlib; "
                               "print(pathlib.Path(loopserve.__file__).resolve().parents[1])'"),
                       cwd=ROOT, env=env, capture_output=True, text=True)
    return r.stdout.strip() == str(ROOT)


def _serve_line_of_run_sh() -> str:
    [line] = [ln for ln in (ROOT / "scripts" / "run.sh").read_text().splitlines() if ln.startswith("exec ")]
    return line.removeprefix("exec ").replace('"$@"', "").strip()


@pytest.fixture(scope="module")
def server():
    blocks = [b.strip() for lang, b in code_blocks() if lang == "bash"]
    assert SERVER_BLOCK in blocks, "the README's first command is gone"
    ports = DEFAULT_PORTS if all(map(_free, DEFAULT_PORTS)) else (_free_port(), _free_port())
    command = SERVER_BLOCK if _installed_here() else _serve_line_of_run_sh()
    if ports != DEFAULT_PORTS:
        command += f" --port {ports[0]} --http-port {ports[1]}"
    proc = subprocess.Popen(_in_env(f"exec {command}"), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("loopserve serving"):
            break
    else:
        proc.wait()
        raise AssertionError(f"{command} exited before serving:\n" + "".join(lines[-30:]))
    try:
        yield Server(*ports)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        assert proc.returncode == 0, f"{command} did not stop cleanly ({proc.returncode})"


def _check_claims(label: str, comment: str, shown: list[str], out: str, err: str) -> None:
    if m := re.search(r"\bprints (.+?)(?:, \"|$)", comment):
        assert m.group(1).strip() in out.splitlines(), f"{label}: not printed: {m.group(1)!r}\n{out}"
    for quoted in re.findall(r'"([^"]+)"', comment.split("prints", 1)[-1] if "prints" in comment else ""):
        assert quoted in out + err, f"{label}: {quoted!r} not in its output\n{out}\n{err}"
    fragments = re.findall(r'"\w+":(?:"[^"…]*"|\[[\d,]*\]|-?\d+(?:\.\d+)?|null|true|false)', " ".join(shown))
    if fragments:
        reply = json.dumps(json.loads(out), separators=(",", ":"), ensure_ascii=False)
        missing = [f for f in fragments if f not in reply]
        assert not missing, f"{label}: the reply lacks {missing}\n{reply}"


def _run(label: str, argv: list[str], stdin: str | None = None) -> tuple[str, str]:
    r = subprocess.run(argv, cwd=ROOT, env=_env(), input=stdin, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{label} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout, r.stderr


def _blocks_to_run() -> list[tuple[str, str]]:
    return [(lang, b) for lang, b in code_blocks()
            if b.strip() != SERVER_BLOCK and not any(key in b for key in NOT_RUN)]


def test_every_block_is_run_or_named():
    blocks = code_blocks()
    assert len(blocks) == len(_blocks_to_run()) + 1 + sum(
        any(key in b for key in NOT_RUN) for _, b in blocks)
    assert all(any(key in b for _, b in blocks) for key in NOT_RUN), "a NOT_RUN entry matches no block"


@pytest.mark.parametrize("lang,block", _blocks_to_run(), ids=lambda v: v.strip().splitlines()[0][:60]
                         if "\n" in v or len(v) > 8 else v)
def test_readme_block_runs_as_written(server, lang, block):
    created = [p for p in (ROOT / "results" / "bench-result.json", ROOT / "results" / "bench-latency.png")
               if not p.exists()]
    try:
        if lang == "python":
            out, err = _run("python block", _in_env("python3 -"), stdin=server.rewrite(block))
            for line in block.splitlines():
                _check_claims(line.strip(), _split_comment(line)[1], [], out, err)
            return
        for cmd in bash_commands(block):
            out, err = _run(cmd.text, _in_env(server.rewrite(cmd.text)))
            _check_claims(cmd.text, cmd.comment, cmd.shown, out, err)
    finally:
        for p in created:
            p.unlink(missing_ok=True)
