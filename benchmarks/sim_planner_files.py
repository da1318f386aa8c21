"""Planner variants side by side in simulation: auto of each planner file against the same fixed arms.

For each shipped table, served source and concurrency, the fixed arms (plain and every fixed K,
``whatif.fixed_k_predictions``) are run once and kept in a cache folder; then each planner file
(a ``planner.py``, or ``HEAD`` / a git revision for the committed one) runs the auto arm under
``spectune simulate``'s protocol (8 waves of requests, at least 64, 127 decode tokens, seeds
0..repeats-1 pooled). Prints auto / the best other arm over the closed run and at full load per
planner, and writes JSON. A controller change is judged here on every table and held-out source
before a GPU call; the fixed arms are the slow part, so a second variant costs only its auto runs.

    python benchmarks/sim_planner_files.py --planners HEAD,/tmp/planner_variant.py --concurrency 1 \\
        --out benchmarks/results/batch1_trials_v28/sim_c1.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import sys
from multiprocessing import Pool
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_trace import planner_at  # noqa: E402
from sim_tables import served_models  # noqa: E402

from spectune.autotune.simulator import FixedK  # noqa: E402
from spectune.autotune.whatif import (  # noqa: E402
    WhatIf,
    arm_workload,
    fixed_k_predictions,
    heldout_sources,
    predict_arm,
    tuned_prior,
)
from spectune.io import atomic_write_text  # noqa: E402
from spectune.runtime.planner import load  # noqa: E402

PROFILES = Path(__file__).resolve().parent.parent / "spectune" / "profiles"
TABLES = ("qwen3-8b_eagle-1l.ctx320", "qwen3-8b_eagle-1l.fused.ctx320", "qwen3-8b_eagle-1l.fp8.ctx320",
          "llama-3.1-8b_eagle-1l.ctx320", "qwen3-32b_eagle-1l.ctx320")
SOURCES = ("humaneval-ngram", "mtbench-ngram", "humaneval-suffix", "mtbench-suffix", "high-0.9", "low-0.55",
           "drift", "tuned")
_MODULES: dict[str, Any] = {}  # planner modules of this process, by name (a revision's is a ``git show``)


def planner_module(name: str) -> Any:
    if name not in _MODULES:
        _MODULES[name] = planner_at("", Path(name)) if Path(name).is_file() else planner_at(name)
    return _MODULES[name]


def cell(job: tuple[str, str, int, tuple[str, ...], int, str]) -> dict[str, Any]:
    table, source, c, planners, repeats, cache = job
    path = PROFILES / f"nvidia-h200_{table}.policy.yaml"
    base = load(path, on_gpu_mismatch="ignore")
    model, late = served_models(source, base)
    work = arm_workload(WhatIf(base.fresh, model, late, repeats=repeats), c, base.cost.context_len, tuned_prior(base.table))
    key = Path(cache) / (hashlib.sha1(path.read_bytes() + f"|{source}|{c}|{repeats}".encode()).hexdigest() + ".pkl")
    if key.exists():
        others = pickle.loads(key.read_bytes())
    else:
        fixed = fixed_k_predictions(base.cost, model, min(base.k_hi, model.max_k), **work)
        plain = predict_arm(base.cost, model, lambda: FixedK(0), **work)
        others = {k: (p.goodput_tok_s, p.full_tok_s) for k, p in fixed.items()}
        others[0] = (plain.goodput_tok_s, plain.full_tok_s)
        key.write_bytes(pickle.dumps(others))
    best = max(g for g, _ in others.values())
    best_full = max(f for _, f in others.values() if f)
    row: dict[str, Any] = {"table": table, "source": source, "concurrency": c,
                           "best_arm": max(others, key=lambda k: others[k][0]), "auto": {}}
    for name in planners:
        planner = planner_module(name).load(path, on_gpu_mismatch="ignore")
        p = predict_arm(base.cost, model, planner.fresh, **work)
        row["auto"][name] = {"ratio_vs_best_other": p.goodput_tok_s / best, "full_ratio_vs_best_other": p.full_tok_s / best_full,
                             "k_hist": {str(k): n for k, n in sorted(p.k_hist.items())}}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planners", required=True, help="comma list of planner.py files or git revisions")
    ap.add_argument("--tables", default=",".join(TABLES), help="shipped nvidia-h200 tables (name after the GPU)")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="/tmp/spectune_sim_planner_files", help="folder of the fixed arms' runs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    tables, sources = a.tables.split(","), a.sources.split(",")
    bad = [t for t in tables if not (PROFILES / f"nvidia-h200_{t}.policy.yaml").is_file()]
    bad += [s for s in sources if s != "tuned" and s not in heldout_sources()]
    if bad or a.repeats < 1:
        print(f"sim_planner_files: unknown table or source {', '.join(bad)} (or --repeats < 1)", file=sys.stderr)
        return 2
    Path(a.cache).mkdir(parents=True, exist_ok=True)
    planners = tuple(a.planners.split(","))
    jobs = [(t, s, int(c), planners, a.repeats, a.cache) for t in tables for s in sources for c in a.concurrency.split(",")]
    rows = []
    pool = Pool(a.workers) if a.workers > 1 else None
    try:
        for r in pool.imap(cell, jobs) if pool is not None else map(cell, jobs):
            rows.append(r)
            ratios = " ".join(f"{v['ratio_vs_best_other']:.3f}/{v['full_ratio_vs_best_other']:.3f}" for v in r["auto"].values())
            print(f"{r['table']:32s} {r['source']:17s} {r['concurrency']:4d} best {r['best_arm']:2d}  {ratios}", flush=True)
    finally:
        if pool is not None:
            pool.close()
    if a.out:
        atomic_write_text(a.out, json.dumps({"planners": planners, "repeats": a.repeats, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
