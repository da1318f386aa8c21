"""Tuned policy vs plain decoding vs every fixed K, per concurrency, on a profile's cost surface.

For the homogeneous acceptance curve and for a mixture of easy and hard requests with the same mean
curve, tune a policy (the search sees the acceptance model that is evaluated), then per concurrency:
  analytic:    exact expected goodput of the table's plan and of each fixed K (no noise);
  Monte-Carlo: every arm plays the same requests (common random numbers: one seed, same request
               classes, lengths and acceptance draws) until ``--requests`` requests finished, over
               ``--seeds`` seeds; an arm's goodput is its tokens over its seconds, all seeds pooled.
Arms: plain (K = 0), fixed K = 1..max_k (exact graphs, full budget b*K), the policy through the
runtime Planner with online correction ("policy"), the table alone ("table"), and the table with
uniform instead of history allocation ("uniform"). "alloc gain" = table / best fixed K: what
per-request budget allocation (ranking requests by their own acceptance history) adds where the budget binds.

    python benchmarks/sim_policy_vs_fixed.py benchmarks/profiles/h200_probe_qwen3-8b_eagle-1l.yaml

Writes benchmarks/results/sim_<profile>.json and exits 1 if a goal is missed (policy >= 0.99 x the
best of plain and fixed K, and >= plain, at every concurrency, Monte-Carlo and analytic).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from spectune.autotune.acceptance import AcceptanceModel, resolve_acceptance
from spectune.autotune.simulator import FixedK, Mixture, expected_tokens, simulate
from spectune.autotune.tune_pipeline import cost_model, tune
from spectune.runtime.planner import Planner, step_ms
from spectune.runtime.table import Table, read_table

CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GOAL = 0.99


class TableOnly:
    """The planner without online correction (no ``observe``): the table's plan at every step."""

    def __init__(self, table: Table):
        self.planner = Planner(table)

    def plan(self, batch_size: int):
        return self.planner.plan(batch_size)


def analytic(table: Table, acc: AcceptanceModel, b: int) -> dict:
    cost, mix = cost_model(table), Mixture.of(acc)
    p = Planner(table).plan(b)
    assert p.tier is not None
    pol = float(expected_tokens(mix, b, p.k, [p.verify_budget], inflight=True)[0]) / step_ms(cost, b, p.k, p.tier) * 1000
    fixed = {k: float(expected_tokens(mix, b, k, [b * k], inflight=True)[0]) / step_ms(cost, b, k, b * (k + 1)) * 1000
             for k in range(table.workload.max_k + 1)}
    best = max(fixed, key=lambda k: fixed[k])
    return {"plan": [p.k, p.verify_budget, p.tier], "policy": pol, "best_k": best, "best": fixed[best],
            "plain": fixed[0], "vs_best": pol / fixed[best], "vs_plain": pol / fixed[0]}


def monte_carlo(table: Table, acc: AcceptanceModel, b: int, requests: int, seeds: int) -> dict:
    cost = cost_model(table)
    arms = {f"k{k}": (FixedK(k), "history") for k in range(table.workload.max_k + 1)}
    tokens = {name: 0 for name in [*arms, "policy", "table", "uniform"]}
    seconds = dict.fromkeys(tokens, 0.0)
    cap = max(2000, 400 * requests // b)  # step cap, far above what `requests` needs
    for seed in range(seeds):
        runs = {**arms, "policy": (Planner(table), "history"), "table": (TableOnly(table), "history"),
                "uniform": (TableOnly(table), "uniform")}
        for name, (fn, alloc) in runs.items():
            r = simulate(cost, acc, fn, concurrency=b, steps=cap, requests=requests, seed=seed, allocation=alloc)
            tokens[name] += r.tokens
            seconds[name] += r.seconds
    g = {name: tokens[name] / seconds[name] for name in tokens}
    fixed = {k: g[f"k{k}"] for k in range(table.workload.max_k + 1)}
    best = max(fixed, key=lambda k: fixed[k])
    return {"plain": fixed[0], "fixed": fixed, "best_k": best, "best": fixed[best], "policy": g["policy"],
            "table": g["table"], "uniform": g["uniform"], "vs_best": g["policy"] / fixed[best],
            "vs_plain": g["policy"] / fixed[0], "table_vs_best": g["table"] / fixed[best],
            "online_vs_table": g["policy"] / g["table"], "alloc_gain": g["table"] / fixed[best],
            "uniform_vs_best": g["uniform"] / fixed[best]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="profile (or policy table) YAML whose costs are used")
    ap.add_argument("--acceptance", default=None, help="acceptance source (default: the EAGLE-3 MT-Bench curve)")
    ap.add_argument("--spread", type=float, default=0.9, help="easy/hard split of the same-mean mixture")
    ap.add_argument("--requests", type=int, default=400, help="finished requests per arm and seed")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--concurrency", default=None, help="comma-separated (default: 1,2,4,...,256)")
    args = ap.parse_args()
    profile = read_table(args.profile)
    acc = resolve_acceptance(args.acceptance, profile.workload.max_k)
    hetero = AcceptanceModel.mixture_with_same_mean(acc.mean_survival(acc.max_k), max_k=acc.max_k,
                                                    spread=args.spread)
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else CONCURRENCY
    levels = [c for c in levels if c <= profile.workload.max_batch]
    result: dict = {"profile": args.profile, "acceptance": acc.source, "requests": args.requests,
                    "seeds": args.seeds, "command": " ".join(sys.argv)}
    missed = []
    for name, model in (("mean", acc), ("heterogeneous", hetero)):
        t0 = time.perf_counter()
        table = tune(profile, model, trials=args.trials).table
        tune_s = time.perf_counter() - t0
        rows = []
        print(f"\n{name}: {model.source}  (tune {tune_s:.1f} s)")
        print(f"{'conc':>5} {'plan K/B/tier':>14} {'an.bestK':>8} {'an.ratio':>8} | {'plain':>7} {'bestK':>5} "
              f"{'best':>7} {'policy':>7} {'vs best':>7} {'vs plain':>8} {'online/table':>12} "
              f"{'alloc gain':>10} {'uniform':>7}")
        for b in levels:
            an, mc = analytic(table, model, b), monte_carlo(table, model, b, args.requests, args.seeds)
            rows.append({"concurrency": b, "analytic": an, "monte_carlo": mc})
            print(f"{b:>5} {'/'.join(map(str, an['plan'])):>14} {an['best_k']:>8} {an['vs_best']:>8.4f} | "
                  f"{mc['plain']:>7.0f} {mc['best_k']:>5} {mc['best']:>7.0f} {mc['policy']:>7.0f} "
                  f"{mc['vs_best']:>7.4f} {mc['vs_plain']:>8.4f} {mc['online_vs_table']:>12.4f} "
                  f"{mc['alloc_gain']:>10.4f} {mc['uniform_vs_best']:>7.4f}")
            for what, ratio, floor in (("analytic vs best", an["vs_best"], GOAL), ("MC vs best", mc["vs_best"], GOAL),
                                       ("analytic vs plain", an["vs_plain"], 1.0 - 1e-9),
                                       ("MC vs plain", mc["vs_plain"], 1.0 - 1e-9)):
                if ratio < floor:
                    missed.append(f"{name} b={b}: {what} {ratio:.4f}")
        result[name] = {"source": model.source, "tune_seconds": tune_s, "rows": rows}
    out = Path(__file__).parent / "results" / f"sim_{Path(args.profile).stem}.json"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    print(f"\nwrote {out}")
    for m in missed:
        print(f"goal missed: {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
