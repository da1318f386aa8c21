"""Two workers sharing one GPU vs one worker: the merged study must give the same profile.

Runs the real command twice on one GPU, each with its own journal file:
  1. ``spectune profile`` (one worker),
  2. ``spectune profile --workers 2 --device cuda:0`` (two processes sharing the GPU, one study),
then compares the two profiles: the point sets (grid and held-out points must be equal; adaptive
rounds follow measured times, so they may differ), every common point's time, the fitted cost
model's predictions over batch x q, duplicates, and who measured what (workers, GPU UUIDs).
This checks correctness, not speed: two processes share one GPU, so some contention in their
times is expected and shown. Prints a table; writes JSON to $OUT or benchmarks/results/.

    python benchmarks/profile_two_workers.py                      # H200: qwen3-8b, batch 1-32, K <= 7 (< 5 min)
    python benchmarks/profile_two_workers.py --device cpu --target tiny --batch-sizes 1-4 --max-k 2   # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd


def run_profile(folder: Path, label: str, args: argparse.Namespace, workers: int) -> dict[str, Any]:
    out = folder / f"{label}.yaml"
    cmd = [sys.executable, "-m", "spectune.cli", "profile", "--target", args.target, "--device", args.device,
           "--batch-sizes", args.batch_sizes, "--max-k", str(args.max_k), "--trials", str(args.trials),
           "--out", str(out), "--no-progress", "--workers", str(workers)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return {"label": label, "workers": workers, "wall_s": round(time.perf_counter() - start, 1), "yaml": out,
            "csv": out.with_suffix(".csv"), "command": " ".join(cmd)}


def compare(one_yaml: Path, two_yaml: Path, one_csv: Path, two_csv: Path) -> dict[str, Any]:
    """Point sets, per-point time ratios and model predictions of two profiles."""
    from spectune.runtime.costs import CostModel
    from spectune.runtime.table import read_table

    a, b = pd.read_csv(one_csv), pd.read_csv(two_csv)
    first = {"seed", "held_out"}
    grid_a = set(a.loc[a["phase"].isin(first), "key"])
    grid_b = set(b.loc[b["phase"].isin(first), "key"])
    common = sorted(set(a["key"]) & set(b["key"]))
    ms_a, ms_b = a.set_index("key")["ms"], b.set_index("key")["ms"]
    rel = [abs(ms_b[k] / ms_a[k] - 1) for k in common if pd.notna(ms_a[k]) and pd.notna(ms_b[k]) and ms_a[k] > 0]
    ta, tb = read_table(one_yaml), read_table(two_yaml)
    wl = ta.workload
    ma = CostModel(ta.costs.model, wl.drafter_kind, wl.context_len)
    mb = CostModel(tb.costs.model, wl.drafter_kind, wl.context_len)
    pred = [abs(mb.target_ms(bs * q, bs) / ma.target_ms(bs * q, bs) - 1)
            for bs in range(1, wl.max_batch + 1) for q in range(1, wl.max_k + 2)]
    return {
        "grid_and_held_out_equal": grid_a == grid_b, "points": [len(a), len(b)], "common_points": len(common),
        "duplicates": [int(a["key"].duplicated().sum()), int(b["key"].duplicated().sum())],
        "point_rel_diff_median": statistics.median(rel) if rel else None,
        "point_rel_diff_p90": sorted(rel)[int(0.9 * (len(rel) - 1))] if rel else None,
        "model_target_rel_diff_median": statistics.median(pred), "model_target_rel_diff_max": max(pred),
        "held_out_error": [ta.costs.error.median_rel, tb.costs.error.median_rel],
        "workers_two": b["worker"].value_counts().to_dict(),
        "gpu_uuids": sorted({str(u) for u in pd.concat([a["gpu_uuid"], b["gpu_uuid"]]).dropna()}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch-sizes", default="1-32")
    ap.add_argument("--max-k", type=int, default=7)
    ap.add_argument("--trials", type=int, default=4)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="spectune-two-workers-"))
    one = run_profile(folder, "one", args, 1)
    two = run_profile(folder, "two", args, 2)
    res = compare(one["yaml"], two["yaml"], one["csv"], two["csv"])
    print(f"{'run':>5} {'workers':>7} {'wall s':>7} {'points':>6}")
    for r, n in ((one, res["points"][0]), (two, res["points"][1])):
        print(f"{r['label']:>5} {r['workers']:>7} {r['wall_s']:>7} {n:>6}")
    print(f"grid + held-out point sets equal: {res['grid_and_held_out_equal']}; duplicates {res['duplicates']}; "
          f"two-worker split {res['workers_two']}")
    print(f"common points {res['common_points']}: |two/one - 1| median {res['point_rel_diff_median']:.2%}, "
          f"p90 {res['point_rel_diff_p90']:.2%}")
    print(f"fitted target model over batch x q: median {res['model_target_rel_diff_median']:.2%}, "
          f"max {res['model_target_rel_diff_max']:.2%}; held-out error {res['held_out_error']}")
    dest = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "profile_two_workers.json"
    res["runs"] = [{k: str(v) if isinstance(v, Path) else v for k, v in r.items()} for r in (one, two)]
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
