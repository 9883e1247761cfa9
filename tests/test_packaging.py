"""A non-editable install carries the package data and serves: named model configs resolve,
`py.typed` is there (a path found through a source file's parents works only in a checkout),
and the installed engine generates with `tiny-ouro`."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
from importlib.resources import files

import loopserve
from loopserve.engine.llm import LLM
from loopserve.model.config import load_model_config
from loopserve.protocol.sampling_params import SamplingParams

assert loopserve.__file__.startswith(sys.argv[1]), loopserve.__file__
cfg = load_model_config("tiny-ouro")
out = LLM(model="tiny-ouro").generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
print(type(cfg).__name__, cfg.hidden_size, files("loopserve").joinpath("py.typed").is_file(),
      len(out.token_ids))
"""


def test_non_editable_install_serves_tiny_ouro_and_has_py_typed(tmp_path):
    # Built from a copy: pip builds in the tree it is given (build/, *.egg-info), and a
    # build/ left from an earlier run would ship modules the checkout no longer has.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "loopserve", src / "loopserve", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--target", str(target), str(src)], check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", PROBE, str(target)], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-4:] == ["OuroConfig", "64", "True", "4"], run.stdout
