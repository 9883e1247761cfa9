"""The router and both fronts load no torch or numpy: what crosses processes is in
`loopserve/protocol/`, which imports nothing heavier than pydantic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy")


def _loaded(modules: list[str]) -> dict[str, bool]:
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(json.dumps({{h: h in sys.modules for h in {HEAVY!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


FRONTS = ["loopserve.cluster.router.core", "loopserve.entrypoints.grpc.server", "loopserve.entrypoints.openai.server"]


@pytest.mark.parametrize("module", ["loopserve.protocol." + p.stem for p in
                                    sorted((ROOT / "loopserve" / "protocol").glob("[!_]*.py"))])
def test_protocol_module_is_light(module):
    assert _loaded([module]) == dict.fromkeys(HEAVY, False)


def test_router_and_fronts_load_no_torch():
    assert _loaded(FRONTS) == dict.fromkeys(HEAVY, False)


def test_the_check_sees_torch():
    """The same check on the engine finds torch: it is not vacuous."""
    assert _loaded(["loopserve.engine.engine_core"])["torch"]
