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


MODELS = Path(__file__).with_name("models")
TARGET = MODELS / "llama-3.1-8b-instruct"  # config.json only: the public numbers (models/README.md)
EAGLE3 = MODELS / "eagle3-llama-3.1-8b"


def _run(engine, items, tmp_path):
    if not (ENGINES / engine).is_dir():
        pytest.skip(f"{engine} not installed: run .ci/install-engines")
    env = {
        **os.environ,
        "PYTHONPATH": str(ENGINES / engine),
        "VLLM_LOGGING_LEVEL": "ERROR",
        # vLLM's CPU platform (this wheel is the CUDA build; the speculative config code is the
        # same on every platform), its caches under the test's folder, nothing from a hub
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    result = tmp_path / f"{engine}-result.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("engine_check.py")), str(result)],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(result.read_text())
    if isinstance(out, dict) and "missing" in out:
        pytest.skip(
            f"{engine} in .engines/ cannot import {out['missing']}: add it to .ci/install-engines"
        )
    return out


def _want(schedule):
    return [
        next((k for lo, hi, k in schedule if lo <= b <= hi), 0) for b in range(1, MAX_BATCH + 1)
    ]


def _vllm_item(flags):
    return {"fmt": "vllm", "flags": list(flags), "target": str(TARGET)}


def _with_config(flags, edit):
    """The flags with their --speculative-config JSON changed by ``edit``."""
    flags = list(flags)
    i = flags.index("--speculative-config") + 1
    flags[i] = json.dumps(edit(json.loads(flags[i])))
    return flags


def test_vllm_serve_builds_every_shipped_export_and_runs_the_policy_k(tmp_path):
    # `vllm serve --model <Llama-3.1-8B-Instruct> <the exported flags>`, parsed and turned into the
    # engine config by vLLM's own code: ngram (no drafter) and EAGLE-3 with a drafter folder whose
    # config.json vLLM reads and resolves (LlamaForCausalLMEagle3)
    items, wants = [], []
    for policy in SHIPPED:
        schedule = schedule_from_table(read_table(policy))
        for method, model in (("ngram", None), ("eagle3", str(EAGLE3))):
            exp = export_schedule(schedule, "vllm", method=method, model=model, max_batch=MAX_BATCH)
            items.append(_vllm_item(exp.flags))
            # ngram: vLLM gives the drafter the target's model config
            drafter = ["LlamaForCausalLMEagle3"] if model else ["LlamaForCausalLM"]
            wants.append(
                {
                    "k": _want(schedule),
                    "method": method,
                    "drafter": drafter,
                    "max_num_seqs": MAX_BATCH,
                }
            )
    first = items[0]["flags"]
    # without our tail vLLM keeps the last range's K up to max_num_seqs; without a method, or an
    # EAGLE-3 method without its drafter, it refuses
    bare = _with_config(
        first,
        lambda c: dict(
            c, num_speculative_tokens_per_batch_size=c["num_speculative_tokens_per_batch_size"][:-1]
        ),
    )
    nomethod = _with_config(first, lambda c: {k: v for k, v in c.items() if k != "method"})
    nodrafter = _with_config(
        items[1]["flags"], lambda c: {k: v for k, v in c.items() if k != "model"}
    )
    got = _run("vllm", [*items, *map(_vllm_item, (bare, nomethod, nodrafter))], tmp_path)
    assert got[: len(items)] == wants
    assert isinstance(got[len(items)], dict) and "k" in got[len(items)], got[len(items)]
    assert got[len(items)]["k"] != wants[0]["k"]
    assert "without speculative model" in got[-2]["error"]
    assert "without speculative model" in got[-1]["error"]


def test_sglang_routes_every_batch_to_the_policy_k_with_the_emitted_flags(tmp_path):
    items, wants = [], []
    for policy in SHIPPED:
        schedule = schedule_from_table(read_table(policy))
        exp = export_schedule(
            schedule, "sglang", method="EAGLE3", model="/m/e3", max_batch=MAX_BATCH
        )
        flags = list(exp.flags)
        graphs = [int(f) for f in flags[flags.index("--cuda-graph-bs-decode") + 1 :]]
        steps = int(flags[flags.index("--speculative-num-steps") + 1])
        items.append(
            {
                "fmt": "sglang",
                "config": exp.config,
                "max_batch": MAX_BATCH,
                "graphs": graphs,
                "num_steps": steps,
            }
        )
        wants.append(_want(schedule))
    got = _run("sglang", items, tmp_path)
    assert got == wants


def test_vllm_own_metrics_while_k_varies_exact_or_refused(tmp_path):
    rates = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6]
    true = np.cumprod(rates)
    by_phase, cycling = _run(
        "vllm",
        [
            {
                "fmt": "vllm-metrics",
                "rates": rates,
                "phases": [[7], [3], [1]],
                "steps": 300,
                "batch": 8,
                "seed": 0,
            },
            {
                "fmt": "vllm-metrics",
                "rates": rates,
                "phases": [[7, 3, 1]],
                "steps": 900,
                "batch": 8,
                "seed": 1,
            },
        ],
        tmp_path,
    )
    assert isinstance(by_phase, list) and isinstance(cycling, list), (by_phase, cycling)
    texts = [(f"scrape-{i}", t) for i, t in enumerate(by_phase)]
    got = np.array(metrics_model(texts, max_k=7).mean_survival(7))
    assert np.all(np.abs(got / true - 1) < 0.05), got
    with pytest.raises(AcceptanceError, match="not determined"):
        metrics_model([(f"scrape-{i}", t) for i, t in enumerate(cycling)], max_k=7)
