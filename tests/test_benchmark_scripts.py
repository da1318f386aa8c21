"""The scaling benchmarks' logic on CPU (their numbers come from the commands in docs/SCALING.md)."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_two_worker_profile_compare_runs_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    mod = load("profile_two_workers")
    assert mod.main(["--device", "cpu", "--target", "tiny", "--batch-sizes", "1,2", "--max-k", "1",
                     "--trials", "0"]) == 0
    res = json.loads((tmp_path / "profile_two_workers.json").read_text())
    assert res["grid_and_held_out_equal"] and res["duplicates"] == [0, 0]
    assert res["common_points"] == res["points"][0] == res["points"][1]
    assert sum(res["workers_two"].values()) == res["points"][1]
    assert "grid + held-out point sets equal: True" in capsys.readouterr().out
