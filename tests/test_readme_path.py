"""The README's own first path, as a new user runs it on a CPU: ``spectune autotune`` (defaults),
then ``spectune bench --policy spectune-tiny-eagle-1l.policy.yaml`` (default concurrencies), then
``spectune report`` on what they wrote."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from spectune.cli import main
from spectune.runtime.planner import load

POLICY = "spectune-tiny-eagle-1l.policy.yaml"
PROFILE = "spectune-tiny-eagle-1l.yaml"


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory):
    """``spectune autotune`` with the README's defaults, run in a fresh folder."""
    where = tmp_path_factory.mktemp("readme")
    old = os.getcwd()
    os.chdir(where)
    try:
        yield where
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def autotune_run(readme_dir):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["autotune", "--no-progress"])
    return rc, out.getvalue(), err.getvalue()


def test_autotune_writes_the_files_the_readme_names(readme_dir, autotune_run):
    rc, out, err = autotune_run
    assert rc == 0, err
    assert "Traceback" not in err
    for name in (PROFILE, POLICY, "spectune-tiny-eagle-1l.csv", PROFILE + ".journal"):
        assert (readme_dir / name).exists(), name
    assert not list(readme_dir.glob(".*.tmp"))
    planner = load(readme_dir / POLICY)  # what a server does at start
    assert planner.plan(1).k >= 0


def test_autotune_prints_only_gains_a_table_can_mean(autotune_run):
    _, out, _ = autotune_run
    rows = re.findall(r"batch\s+(\d+)-(\d+)\s+K=(\d+)\s+budget=\d+\s+tier=\S+\s+([\d.]+)x vs plain", out)
    assert rows, out
    for lo, hi, k, gain in rows:
        assert 0 < float(gain) <= int(k) + 1, (lo, hi, k, gain)  # K drafts emit at most K + 1 tokens a step


def test_report_on_what_autotune_wrote(readme_dir, autotune_run):
    assert main(["report", PROFILE, POLICY, "--out", "report"]) == 0
    assert (readme_dir / "report" / "report.md").exists() and (readme_dir / "report" / "report.html").exists()


def test_bench_then_report_at_the_default_concurrencies(readme_dir, autotune_run):
    assert main(["bench", "--policy", POLICY, "--out", "b.json", "--no-progress"]) == 0
    rows = json.loads((readme_dir / "b.json").read_text())["rows"]
    assert {r["concurrency"] for r in rows} == {1, 4}  # the CPU defaults
    assert all(r["hard_mismatches"] == 0 for r in rows)
    assert main(["report", "b.json", POLICY, "--out", "report-bench"]) == 0
    assert (readme_dir / "report-bench" / "report.md").exists()
    data = yaml.safe_load((readme_dir / POLICY).read_text())
    assert data["policy"]["rows"]
