"""Two workers sharing one GPU vs one worker: the merged study must give the same profile.

Runs the real command on one GPU, each run with its own journal file:
  1. ``spectune profile`` (one worker),
  2. ``spectune profile --workers 2 --device cuda:0`` (two processes sharing the GPU, one study;
     the per-GPU timing lock on, as ``--timing-lock auto`` sets it on CUDA),
  3. with ``--lock-off-too``: the same two workers with ``--timing-lock off`` (the contention the
     lock removes),
then compares each two-worker profile with the one-worker one: the point sets (grid and held-out
points must be equal; adaptive rounds follow measured times, so they may differ), every common
point's time, the fitted cost model's predictions over batch x q, duplicates, and who measured
what (workers, GPU UUIDs). Prints a table; writes JSON to --out-dir ($OUT, else benchmarks/results).

    python benchmarks/profile_two_workers.py --batch-sizes 1-8 --max-k 3 --trials 2 --lock-off-too   # H200, ~2 min
    python benchmarks/profile_two_workers.py --device cpu --target tiny --batch-sizes 1-4 --max-k 2   # dry run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_runs import compare, fmt_pct, log, out_dir, run_profile, write_json  # noqa: E402


def two_workers_vs_one(
    folder: Path,
    settings: dict[str, Any],
    *,
    lock_off_too: bool = False,
    one: dict[str, Any] | None = None,
    noise_run: bool = False,
) -> dict[str, Any]:
    """One worker, two workers with the timing lock (and without it); each compared with one.
    ``one``: a finished one-worker run of the same settings to reuse. ``noise_run``: a second
    one-worker run first, compared with the first as ``one_again``: the run-to-run noise of whole
    profiles (new processes, new captures), the yardstick for "equal within timing noise"."""
    one = one or run_profile(folder, "one", workers=1, **settings)
    runs = {"one": one}
    res: dict[str, Any] = {"settings": settings}
    if noise_run:
        runs["one_again"] = run_profile(folder, "one_again", workers=1, **settings)
        res["one_again"] = compare(one["yaml"], runs["one_again"]["yaml"], one["csv"], runs["one_again"]["csv"])
    modes = ["on"] + (["off"] if lock_off_too else [])
    for mode in modes:
        label = f"two_lock_{mode}"
        extra = [*settings.get("extra", ()), "--timing-lock", mode]
        runs[label] = run_profile(folder, label, workers=2, **{**settings, "extra": extra})
        res[label] = compare(one["yaml"], runs[label]["yaml"], one["csv"], runs[label]["csv"])
    res["runs"] = {k: {n: v for n, v in r.items() if n not in ("stdout",)} for k, r in runs.items()}
    return res


def print_table(res: dict[str, Any]) -> None:
    log(
        f"{'run':>13} {'wall s':>7} {'points':>6} {'dups':>4} {'grid eq':>7} {'pt med':>7} {'pt p90':>7} "
        f"{'signed':>7} {'fit med':>7} {'fit max':>7} {'held-out':>9}"
    )
    one = res["runs"]["one"]
    for label, r in res["runs"].items():
        c = res.get(label)
        if c is None:
            log(f"{label:>13} {r['wall_s']:>7} {'-':>6}")
            continue
        log(
            f"{label:>13} {r['wall_s']:>7} {c['points'][1]:>6} {c['duplicates'][1]:>4} "
            f"{c['grid_and_held_out_equal']!s:>7} {fmt_pct(c['point_rel_diff_median']):>7} "
            f"{fmt_pct(c['point_rel_diff_p90']):>7} {fmt_pct(c.get('point_rel_diff_signed_median')):>7} "
            f"{fmt_pct(c['model_target_rel_diff_median']):>7} "
            f"{fmt_pct(c['model_target_rel_diff_max']):>7} {fmt_pct(c['held_out_error'][1]):>9}"
        )
    first = next((res[k] for k in res if k.startswith("two_lock_")), None)
    if first is not None:
        log(
            f"one worker: {one['wall_s']} s, held-out error {fmt_pct(first['held_out_error'][0])}; "
            f"one run's replay spread (p80-p20)/median: {fmt_pct(first['replay_spread_median'])}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch-sizes", default="1-32")
    ap.add_argument("--max-k", type=int, default=7)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument(
        "--lock-off-too", action="store_true", help="also run two workers without the timing lock"
    )
    ap.add_argument("--noise-run", action="store_true", help="a second one-worker run: the run-to-run noise")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    settings = {
        "target": args.target,
        "device": args.device,
        "batch_sizes": args.batch_sizes,
        "max_k": args.max_k,
        "trials": args.trials,
    }
    res = two_workers_vs_one(
        Path(tempfile.mkdtemp(prefix="spectune-two-workers-")),
        settings,
        lock_off_too=args.lock_off_too,
        noise_run=args.noise_run,
    )
    c = res["two_lock_on"]
    log(
        f"grid + held-out point sets equal: {c['grid_and_held_out_equal']}; duplicates {c['duplicates']}; "
        f"two-worker split {c['workers_two']}"
    )
    print_table(res)
    write_json(out_dir(args.out_dir) / "profile_two_workers.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
