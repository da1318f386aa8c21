"""CPU microbenchmark of Planner.plan(): microseconds per call over every batch size."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from spectune.runtime.planner import Planner, load
from spectune.runtime.table import (
    SCHEMA,
    CostError,
    CostModelParams,
    Costs,
    DrafterCost,
    Hardware,
    Online,
    OverheadCost,
    Policy,
    Row,
    Software,
    Table,
    TargetCost,
    Workload,
)


def synthetic_table(max_batch: int = 256) -> Table:
    params = CostModelParams(TargetCost(4.9, 0.02, 512, 0.03, 27.0), DrafterCost(0.03, 0.4, 0.001),
                             OverheadCost(0.1, 0.0005))
    rows = [Row((1, 32), 4, 128, tier=160, budget_mode="fill-tier"), Row((33, 64), 2, 128),
            Row((65, max_batch), 0, 0)]
    tiers = sorted({*range(8, max_batch + 1, 8), 160, 192})
    pol = Policy(tiers, rows, Online(0.05, 0.1, 1, 15, [0.8] * 15))
    return Table(SCHEMA, Hardware("cpu"), Software("0.1.0", "x"),
                 Workload("qwen3-8b", "eagle-1l", "autoregressive", 1, "bfloat16", 2048, 15, max_batch),
                 Costs(params, CostError(1, 0.0, 0.0)), policy=pol)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("policy", nargs="?", help="policy YAML (default: a synthetic 256-batch table)")
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    planner = load(args.policy, on_gpu_mismatch="ignore") if args.policy else Planner(synthetic_table())
    sizes = [1 + i % planner.max_batch for i in range(args.calls)]
    assert all(planner.plan(b).tier is not None for b in range(1, planner.max_batch + 1))
    plan = planner.plan
    t0 = time.perf_counter()
    for b in sizes:
        plan(b)
    us = (time.perf_counter() - t0) / args.calls * 1e6
    print(f"{'calls':>10} {'us/call':>8}\n{args.calls:>10} {us:>8.3f}")
    out = Path(__file__).parent / "results" / "bench_planner.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"calls": args.calls, "us_per_call": us, "max_batch": planner.max_batch}, indent=1))


if __name__ == "__main__":
    main()
