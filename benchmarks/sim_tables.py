"""`spectune simulate` over served sources: a policy table's closed-run what-if, one table per call.

For each served source (every shipped trace set, 0.9^i, 0.55^i and a drift from one to the
other: ``spectune.autotune.whatif.heldout_sources``) and concurrency, the path of
``spectune simulate`` (``whatif.simulate_table``: closed runs of 8 waves per concurrency with their
drain, a fresh planner per run, 3 seeds pooled, arms plain, fixed:1..7, the best fixed K and its
neighbours, auto); prints auto / the best other arm over the whole run and over the steps at full
concurrency, and writes JSON.

    python benchmarks/sim_tables.py spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml \
        --out benchmarks/results/sim_tables_h200_ctx320.json

The held-out H200 bench (``benchmarks/heldout_ab.py``) serves another protocol: 48 requests of
64 tokens at c = 16 (3 waves), and one planner across its repeats after a training run. Its drift
cell differs by that alone (0.963 of the best fixed K with it, 1.04 with the defaults):

    python benchmarks/sim_tables.py POLICY --sources drift --concurrency 16 --requests 48 \
        --decode-tokens 63 --repeats 5 --shared-planner

``--served-cost PROFILE`` times the runs by another profile's cost model while the policy plans
on its own (``spectune simulate --served-cost``): the controller where its cost model is off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from spectune.autotune.acceptance import AcceptanceModel, resolve_acceptance
from spectune.autotune.whatif import WhatIf, heldout_sources, served_cost_of, simulate_table
from spectune.errors import SpectuneError
from spectune.io import atomic_write_text
from spectune.runtime.planner import load

SOURCES = ("humaneval-ngram", "mtbench-ngram", "humaneval-suffix", "mtbench-suffix", "high-0.9", "low-0.55", "drift")


def served_models(name: str, planner: Any) -> tuple[AcceptanceModel, AcceptanceModel | None]:
    """(acceptance, drift or None) of a held-out source name, or of ``tuned``: the table's own
    acceptance, as `spectune bench` serves it by default."""
    if name == "tuned":
        return AcceptanceModel.from_dict(planner.table.acceptance).widened(planner.k_hi), None
    first, second = heldout_sources()[name]
    return resolve_acceptance(first, planner.k_hi), resolve_acceptance(second, planner.k_hi) if second else None


def main(argv: list[str] | None = None) -> int:
    known = heldout_sources()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--sources", default=",".join(SOURCES),
                    help="names from: " + ", ".join(known) + ", tuned (the acceptance the table was tuned on)")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--requests", type=int, help="requests per concurrency (default: 8 waves, at least 64)")
    ap.add_argument("--decode-tokens", type=int, default=127, help="decode tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="seeds per (concurrency, arm), pooled")
    ap.add_argument("--shared-planner", action="store_true",
                    help="auto: one planner trained by a first run serves every seed (the bench's protocol)")
    ap.add_argument("--served-cost", metavar="PROFILE",
                    help="time the runs by this profile's cost model while the policy plans on its own")
    ap.add_argument("--host-lag", action="store_true",
                    help="play the bench engine's host lag (idle rows: spectune simulate --host-lag)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    for option, value in (("--requests", a.requests), ("--decode-tokens", a.decode_tokens), ("--repeats", a.repeats)):
        if value is not None and value < 1:
            print(f"sim_tables: {option}: must be >= 1, got {value}", file=sys.stderr)
            return 2
    names = [n for n in a.sources.split(",") if n]
    unknown = [n for n in names if n not in known and n != "tuned"]
    if unknown:
        print(f"sim_tables: --sources: unknown {', '.join(unknown)} (known: {', '.join([*known, 'tuned'])})",
              file=sys.stderr)
        return 2
    concurrency = [int(c) for c in a.concurrency.split(",")]
    planner = load(a.policy, on_gpu_mismatch="ignore")
    if "tuned" in names and not planner.table.acceptance:
        print(f"sim_tables: --sources tuned: {a.policy} records no tuned acceptance", file=sys.stderr)
        return 2
    try:
        served = served_cost_of(a.served_cost, planner.table) if a.served_cost else None
    except SpectuneError as exc:
        print(f"sim_tables: {exc}", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = []
    for name in names:
        model, late = served_models(name, planner)
        what = WhatIf(planner.fresh, model, late,
                      decode_tokens=a.decode_tokens, repeats=a.repeats, shared=a.shared_planner,
                      served_cost=served, host_lag=a.host_lag)
        if a.requests is not None:
            what = dataclasses.replace(what, requests=lambda c: a.requests)
        out = simulate_table(what, concurrency, None)
        for r in out["rows"]:
            rows.append({"source": name, **r})
        print(f"{name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"{'source':18s} {'c':>4s} {'auto/best':>9s} {'full load':>9s}  best arm (closed / full)")
    for r in rows:
        if r["arm"] != "auto":
            continue
        here = [o for o in rows if o["source"] == r["source"] and o["concurrency"] == r["concurrency"] and o["arm"] != "auto"]
        best = max(here, key=lambda o: o["goodput_tok_s"] or 0.0)["arm"]
        best_full = max(here, key=lambda o: o["full_tok_s"] or 0.0)["arm"]
        full = r["full_ratio_vs_best_other"]
        print(f"{r['source']:18s} {r['concurrency']:4d} {r['ratio_vs_best_other']:9.3f} "
              f"{full if full is not None else float('nan'):9.3f}  {best} / {best_full}")
    if a.out:
        atomic_write_text(a.out, json.dumps({"policy": a.policy, "served_cost": a.served_cost, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
