"""The time feedback's held-out check: a table served where its cost model is off, old planner beside new.

The table plans on its own cost model while ``spectune simulate``'s runs are timed by a cost model
with the drafter and / or the target scaled (drafter 1.4x and 0.7x, target 1.2x, both 1.15x), on
MT-Bench n-gram, HumanEval n-gram and 0.55^i at c = 16 and 64 under the bench's protocol (one
planner trained by a first run, 48 / 128 requests, 63 tokens, 3 seeds). Prints full-load auto /
the best of plain and fixed K 1..7 per cell, and writes JSON.

    python benchmarks/sim_served_cost.py --planner 6f0b136 --out old.json   # a git revision's planner
    python benchmarks/sim_served_cost.py --out new.json                     # the working copy's
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_trace import planner_at  # noqa: E402

from spectune.autotune.acceptance import resolve_acceptance  # noqa: E402
from spectune.autotune.whatif import WhatIf, heldout_sources, simulate_table  # noqa: E402
from spectune.io import atomic_write_text  # noqa: E402
from spectune.runtime.planner import load  # noqa: E402

TABLE = "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml"
SCENARIOS = (("drafter 1.4x", 1.0, 1.4), ("drafter 0.7x", 1.0, 0.7), ("target 1.2x", 1.2, 1.0), ("all 1.15x", 1.15, 1.15))
SOURCES = ("mtbench-ngram", "humaneval-ngram", "low-0.55")
CELLS = ((16, 48), (64, 128))


def scaled(cost: Any, target: float, drafter: float) -> Any:
    """``cost`` with every time term of the target scaled by ``target`` and of the drafter by
    ``drafter`` (``CostModelParams.scaled``; the overhead is left as it is)."""
    return dataclasses.replace(cost, params=cost.params.scaled(weight=target, token=target, drafter=drafter))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planner", help="git revision whose planner.py plans (default: the working copy's)")
    ap.add_argument("--table", default=TABLE)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    loader = planner_at(a.planner).load if a.planner else load
    cost = load(a.table, on_gpu_mismatch="ignore").cost
    out: dict[str, float] = {}
    sources = heldout_sources()
    for name, tf, df in SCENARIOS:
        served = scaled(cost, tf, df)
        for src in SOURCES:
            acc = resolve_acceptance(sources[src][0], 15)
            for c, req in CELLS:
                what = WhatIf(lambda: loader(a.table, on_gpu_mismatch="ignore"), acc, requests=lambda _c, r=req: r,
                              repeats=3, decode_tokens=63, shared=True, served_cost=served)
                rows = simulate_table(what, [c], None)["rows"]
                out[f"{name}|{src}|{c}"] = next(r["full_ratio_vs_best_other"] for r in rows if r["arm"] == "auto")
                print(f"{name:14s} {src:16s} {c:4d} {out[f'{name}|{src}|{c}']:.4f}", flush=True)
    if a.out:
        atomic_write_text(a.out, json.dumps({"planner": a.planner or "working copy", "table": a.table, "cells": out},
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
