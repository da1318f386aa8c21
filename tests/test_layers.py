"""Layer contracts (pyproject [tool.importlinter]) and the runtime's import weight."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports not installed (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, not another install
    res = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "KEPT" in res.stdout and "BROKEN" not in res.stdout


@pytest.mark.parametrize("module", ["spectune.runtime.planner", "spectune.runtime.table",
                                    "spectune.errors", "spectune.io"])
def test_runtime_import_pulls_nothing_heavy(module: str) -> None:
    code = (f"import sys, json; import {module}; "
            "print(json.dumps(sorted(m for m in ('torch', 'triton', 'optuna', 'pandas', 'numpy', "
            "'matplotlib', 'scipy') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out) == []


def test_kernels_do_not_load_the_runtime() -> None:
    code = ("import sys, json; import spectune.kernels.kv_cache, spectune.kernels.attention_configs; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('spectune.runtime') or m == 'yaml')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out) == []
