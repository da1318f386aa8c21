"""Simulated goodput: plain vs every fixed K vs the tuned policy, per concurrency, and the
heterogeneity experiment (easy + hard requests with the same mean curve: survival allocation vs
uniform allocation vs best fixed K). Writes benchmarks/results/sim_<profile>.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spectune.autotune.acceptance import AcceptanceModel
from spectune.autotune.simulator import FixedK, simulate
from spectune.autotune.tuner import cost_model, resolve_acceptance, tune
from spectune.runtime.planner import Planner
from spectune.runtime.table import read_table

CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def compare(table, acc: AcceptanceModel, steps: int, seed: int) -> list[dict]:
    cost, rows = cost_model(table), []
    for b in [c for c in CONCURRENCY if c <= table.workload.max_batch]:
        fixed = {k: simulate(cost, acc, FixedK(k), concurrency=b, steps=steps, seed=seed).goodput_tok_s
                 for k in range(0, table.workload.max_k + 1)}
        pol = simulate(cost, acc, Planner(table), concurrency=b, steps=steps, seed=seed).goodput_tok_s
        uni = simulate(cost, acc, Planner(table), concurrency=b, steps=steps, seed=seed,
                       allocation="uniform").goodput_tok_s
        best_k = max(fixed, key=lambda k: fixed[k])
        rows.append({"concurrency": b, "plain": fixed[0], "fixed": fixed, "best_k": best_k, "policy": pol,
                     "policy_uniform_alloc": uni, "vs_best": pol / fixed[best_k], "vs_plain": pol / fixed[0]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("profile")
    ap.add_argument("--acceptance", default=None)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    profile = read_table(args.profile)
    acc = resolve_acceptance(args.acceptance, profile.workload.max_k)
    hetero = AcceptanceModel.mixture_with_same_mean(acc.mean_survival(acc.max_k), max_k=acc.max_k, spread=0.9)
    result = {"profile": args.profile, "acceptance": acc.source}
    for name, model in (("mean", acc), ("heterogeneous", hetero)):
        table = tune(profile, model, trials=args.trials, seed=args.seed).table
        rows = compare(table, model, args.steps, args.seed)
        result[name] = rows
        print(f"\n{name}: {model.source}")
        print(f"{'conc':>5} {'plain':>9} {'bestK':>5} {'best fixed':>10} {'policy':>9} {'uniform':>9} "
              f"{'vs best':>8} {'vs plain':>8}")
        for r in rows:
            print(f"{r['concurrency']:>5} {r['plain']:>9.0f} {r['best_k']:>5} {r['fixed'][r['best_k']]:>10.0f} "
                  f"{r['policy']:>9.0f} {r['policy_uniform_alloc']:>9.0f} {r['vs_best']:>8.3f} {r['vs_plain']:>8.3f}")
    out = Path(__file__).parent / "results" / f"sim_{Path(args.profile).stem}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
