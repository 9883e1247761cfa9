"""scripts/env.sh picks the one environment setup.sh, run.sh and test.sh use: an active
virtual environment; else the checkout's .venv; else python3 itself, unless it is externally
managed (PEP 668), when .venv is created. Each case runs the real script in a copy of
scripts/ (a fresh directory: no .venv unless the case makes one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER_CHECK = ("import pathlib, sys, sysconfig; "
                "print((pathlib.Path(sysconfig.get_path('stdlib')) / 'EXTERNALLY-MANAGED').is_file())")


def _externally_managed(python: str) -> bool:
    return subprocess.run([python, "-c", MARKER_CHECK], capture_output=True, text=True,
                          check=True).stdout.strip() == "True"


def _checkout(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    return tmp_path


def _picked(cwd: Path, path: str, virtual_env: str | None = None) -> tuple[str, str]:
    """`command -v python3` after sourcing env.sh, and what it printed on stderr."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": path}
    if virtual_env:
        env["VIRTUAL_ENV"] = virtual_env
    r = subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/env.sh; command -v python3"],
                       cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr


def _path_with(python: str) -> str:
    return os.pathsep.join([str(Path(python).parent), "/usr/bin", "/bin"])


def test_every_script_uses_the_environment_env_sh_picks():
    for name in ("setup.sh", "run.sh", "test.sh"):
        code = [line for line in (ROOT / "scripts" / name).read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
        first = code.index("source scripts/env.sh")
        assert not any(re.search(r"\b(python3|pip|loopserve)\b", line) for line in code[:first]), name


def test_python3_itself_when_not_externally_managed(tmp_path):
    python = shutil.which("python3")
    if _externally_managed(python):
        pytest.skip(f"{python} is externally managed")
    got, _ = _picked(_checkout(tmp_path), _path_with(python))
    assert got == python and not (tmp_path / ".venv").exists()


def test_the_checkouts_venv_when_it_exists(tmp_path):
    cwd = _checkout(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(cwd / ".venv")], check=True)
    got, _ = _picked(cwd, _path_with(shutil.which("python3")))
    assert got == str(cwd / ".venv" / "bin" / "python3")


def test_an_active_virtual_environment_is_used_as_is(tmp_path):
    venv = tmp_path / "mine"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    cwd = _checkout(tmp_path / "checkout")
    got, _ = _picked(cwd, _path_with(str(venv / "bin" / "python3")), virtual_env=str(venv))
    assert got == str(venv / "bin" / "python3") and not (cwd / ".venv").exists()


def test_an_externally_managed_python_gets_a_venv(tmp_path):
    system = "/usr/bin/python3"
    if not (Path(system).exists() and _externally_managed(system)):
        pytest.skip("no externally managed /usr/bin/python3 here")
    cwd = _checkout(tmp_path)
    got, err = _picked(cwd, "/usr/bin:/bin")
    assert got == str(cwd / ".venv" / "bin" / "python3")
    assert "externally managed (PEP 668): creating .venv" in err
    assert _picked(cwd, "/usr/bin:/bin")[0] == got  # the second time: the same .venv, quietly
