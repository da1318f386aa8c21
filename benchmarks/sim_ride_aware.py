"""Riding steps at their own K (``Planner.plan_ride``) against riding steps at the choice's K, simulated.

With mixed prefill a step may carry up to the prefill budget of prompt tokens, which push its
forward past the compute knee: there a verify token costs more than in the choice's own step.
``plan_ride`` lets such a step run a smaller K (the shape that keeps the most tokens after paying
for its time at what a millisecond yields without the ride). This script plays the same closed
runs (``spectune simulate --mixed-prefill``'s protocol: 8 x c requests, 3 seeds, a fresh planner
per run) with ``plan_ride`` and with a planner whose riding steps run ``plan(batch)``, over the
held-out sources (``whatif.heldout_sources``) and the tuned one, for three prompt shapes:

  p64      64-token prompts, 256 new tokens, the engine's default ride limit (bursts apart)
  p256     256-token prompts, 128 new tokens, the engine's default ride limit
  p256-all 256-token prompts, 128 new tokens, every prompt riding (no ride limit)

Printed and written: end-to-end tok/s of plain and of auto with and without ``plan_ride``.

    PYTHONPATH=. python benchmarks/sim_ride_aware.py spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml \\
        --out benchmarks/results/sim_ride_aware_fused_ctx320.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from spectune.autotune.acceptance import AcceptanceModel, resolve_acceptance
from spectune.autotune.whatif import WhatIf, heldout_sources, simulate_table
from spectune.io import atomic_write_text
from spectune.runtime.planner import Planner, load
from spectune.runtime.prefill_plan import Riding

SHAPES = {  # name: (prompt tokens, new tokens, ride limit (None: the budget, the engine's default))
    "p64": (64, 256, None),
    "p256": (256, 128, None),
    "p256-all": (256, 128, 1 << 20),
}


def as_planned(path: str) -> Planner:
    """The planner with riding steps at ``plan(batch)`` (``Planner.ride_aware`` off): what the
    engine ran before ``plan_ride``."""
    planner = load(path, on_gpu_mismatch="ignore")
    planner.ride_aware = False
    return planner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--sources", default="tuned,humaneval-ngram,mtbench-ngram,high-0.9,low-0.55,two-class,drift")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--concurrency", default="32,64")
    ap.add_argument("--budget", type=int, default=256, help="prompt tokens a step carries (--prefill-budget)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    began = time.time()
    planner = load(a.policy, on_gpu_mismatch="ignore")
    max_k = planner.k_hi
    tuned = AcceptanceModel.from_dict(planner.table.acceptance) if planner.table.acceptance else None
    sources = heldout_sources()
    concurrency = [int(c) for c in a.concurrency.split(",")]
    rows = []
    for name in a.sources.split(","):
        if name == "tuned":
            served, drift = resolve_acceptance(tuned, max_k), None
        else:
            spec, drift_spec = sources[name]  # (a drift: the first half's and the second half's)
            served = resolve_acceptance(spec, max_k)
            drift = resolve_acceptance(drift_spec, max_k) if drift_spec is not None else None
        for shape in a.shapes.split(","):
            prompt, new, limit = SHAPES[shape]
            ride = Riding(prompt, a.budget, limit)
            results = {}
            for arm, factory in (("plan_ride", lambda: load(a.policy, on_gpu_mismatch="ignore")),
                                 ("as_planned", lambda: as_planned(a.policy))):
                what = WhatIf(factory, served, drift, repeats=a.repeats)
                what = replace(what, decode_tokens=new - 1, prompt_len=prompt, ride=ride)
                out = simulate_table(what, concurrency, ("plain", "auto") if arm == "plan_ride" else ("auto",))
                for r in out["rows"]:
                    results[(r["concurrency"], r["arm"] if r["arm"] == "plain" else arm)] = r
            for c in concurrency:
                on, off, plain = (results[(c, k)] for k in ("plan_ride", "as_planned", "plain"))
                row = {"source": name, "shape": shape, "concurrency": c, "prompt_len": prompt,
                       "new_tokens": new, "ride_limit": ride.ride_limit, "budget": a.budget,
                       "e2e_plain": plain["output_tok_s"], "e2e_auto_as_planned": off["output_tok_s"],
                       "e2e_auto_plan_ride": on["output_tok_s"],
                       "k_hist_as_planned": off["k_hist"], "k_hist_plan_ride": on["k_hist"]}
                row["plan_ride_over_as_planned"] = row["e2e_auto_plan_ride"] / row["e2e_auto_as_planned"]
                rows.append(row)
                print(f"{name:16s} {shape:9s} c={c:<4d} e2e plain {row['e2e_plain']:8.0f}  auto as planned "
                      f"{row['e2e_auto_as_planned']:8.0f}  plan_ride {row['e2e_auto_plan_ride']:8.0f}  "
                      f"x {row['plan_ride_over_as_planned']:.3f}", flush=True)
    ratios = [r["plan_ride_over_as_planned"] for r in rows]
    summary = {"cells": len(rows), "min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
    print(f"plan_ride / as planned over {len(rows)} cells: min {summary['min']:.3f}, median "
          f"{summary['median']:.3f}, max {summary['max']:.3f}; {time.time() - began:.0f} s")
    if a.out:
        atomic_write_text(a.out, json.dumps({
            "method": "spectune simulate --mixed-prefill's closed runs (8 x c requests, a fresh planner per run), "
                      f"{a.repeats} seeds; auto with Planner.plan_ride against riding steps at plan(batch)",
            "policy": a.policy, "rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
