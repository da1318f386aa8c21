"""Every shipped table's exports through vLLM's and SGLang's own code (installed by
.ci/install-engines into .engines/; skipped when that folder is absent). The engine runs in a
subprocess so its imports do not leak into the test process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spectune.autotune.acceptance import AcceptanceError
from spectune.autotune.acceptance_sources import metrics_model
from spectune.autotune.export import export_schedule, schedule_from_table
from spectune.runtime.table import read_table

ROOT = Path(__file__).parents[2]
ENGINES = ROOT / ".engines"
SHIPPED = sorted((ROOT / "spectune" / "profiles").glob("*.policy.yaml"))
MAX_BATCH = 1024


def _run(engine, items):
    if not (ENGINES / engine).is_dir():
        pytest.skip(f"{engine} not installed: run .ci/install-engines")
    env = {**os.environ, "PYTHONPATH": str(ENGINES / engine), "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_check.py"))], input=json.dumps(items),
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    if isinstance(out, dict) and "missing" in out:
        pytest.skip(f"{engine} in .engines/ cannot import {out['missing']}: add it to .ci/install-engines")
    return out


def _want(schedule):
    return [next((k for lo, hi, k in schedule if lo <= b <= hi), 0) for b in range(1, MAX_BATCH + 1)]


def test_vllm_accepts_every_shipped_export_and_runs_the_policy_k():
    items, wants = [], []
    for policy in SHIPPED:
        schedule = schedule_from_table(read_table(policy))
        for method, model in (("ngram", None), ("eagle3", "/models/eagle3")):
            exp = export_schedule(schedule, "vllm", method=method, model=model, max_batch=MAX_BATCH)
            items.append({"fmt": "vllm", "config": exp.config, "max_batch": MAX_BATCH})
            wants.append(_want(schedule))
    # without our tail vLLM keeps the last range's K up to max_num_seqs; without a method it refuses
    bare = dict(items[0]["config"], num_speculative_tokens_per_batch_size=items[0]["config"][
        "num_speculative_tokens_per_batch_size"][:-1])
    nomethod = {k: v for k, v in items[0]["config"].items() if k != "method"}
    got = _run("vllm", [*items, {"fmt": "vllm", "config": bare, "max_batch": MAX_BATCH},
                        {"fmt": "vllm", "config": nomethod, "max_batch": MAX_BATCH}])
    assert got[: len(items)] == wants
    assert got[len(items)] != wants[0]
    assert "without speculative model" in got[-1]["error"]


def test_sglang_routes_every_batch_to_the_policy_k_with_the_emitted_flags():
    items, wants = [], []
    for policy in SHIPPED:
        schedule = schedule_from_table(read_table(policy))
        exp = export_schedule(schedule, "sglang", method="EAGLE3", model="/m/e3", max_batch=MAX_BATCH)
        flags = list(exp.flags)
        graphs = [int(f) for f in flags[flags.index("--cuda-graph-bs-decode") + 1:]]
        steps = int(flags[flags.index("--speculative-num-steps") + 1])
        items.append({"fmt": "sglang", "config": exp.config, "max_batch": MAX_BATCH, "graphs": graphs,
                      "num_steps": steps})
        wants.append(_want(schedule))
    got = _run("sglang", items)
    assert got == wants


def test_vllm_own_metrics_while_k_varies_exact_or_refused():
    rates = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6]
    true = np.cumprod(rates)
    by_phase, cycling = _run("vllm", [
        {"fmt": "vllm-metrics", "rates": rates, "phases": [[7], [3], [1]], "steps": 300, "batch": 8, "seed": 0},
        {"fmt": "vllm-metrics", "rates": rates, "phases": [[7, 3, 1]], "steps": 900, "batch": 8, "seed": 1},
    ])
    assert isinstance(by_phase, list) and isinstance(cycling, list), (by_phase, cycling)
    texts = [(f"scrape-{i}", t) for i, t in enumerate(by_phase)]
    got = np.array(metrics_model(texts, max_k=7).mean_survival(7))
    assert np.all(np.abs(got / true - 1) < 0.05), got
    with pytest.raises(AcceptanceError, match="not determined"):
        metrics_model([(f"scrape-{i}", t) for i, t in enumerate(cycling)], max_k=7)
