"""How the measurement study scales with local workers (CPU; fixed-length points).

Runs the tiny preset's CPU profile study (``spectune profile`` defaults: batch 1-16, K <= 7, 8
adaptive trials: 73 points) through ``run_profile(ProfileConfig(workers=N))`` — the code path of
``spectune profile --workers N`` — with every point's measurement a fixed-length sleep that
reports a synthetic roofline time (so the point set is deterministic and the cost model fits).
For each N: wall time (process start included), points, duplicates, and whether the point set
equals the one-worker run's. Prints a table; writes JSON to $OUT or benchmarks/results/.

    python benchmarks/scale_workers.py --workers 1 2 4 --point-s 0.5
    python benchmarks/scale_workers.py --storage postgresql://user@/db?host=/tmp/sock   # each N its own study
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from spectune.autotune.measurement_study import PointSpec
from spectune.autotune.profiler import ProfileConfig, run_profile


class SleepRoofline:
    """Fixed-length measurement: sleeps ``point_s``, reports a roofline time of the step."""

    def __init__(self, point_s: float):
        self.point_s = point_s

    def __call__(self, step: PointSpec) -> SimpleNamespace:
        time.sleep(self.point_s)
        ms = 0.1 + 0.3 * (step.k or 1) + 0.002 * step.tokens if step.kind == "drafter" else (
            0.05 + 0.0005 * step.tokens if step.kind == "overhead" else 2.0 + 0.01 * max(0, step.tokens - 64))
        cap = (0.01 * step.tokens, 2.0 + step.tokens / 64) if step.kind == "tier" else (None, None)
        return SimpleNamespace(median_ms=ms, p20_ms=ms, p80_ms=ms, reps=1, mode="fake", capture_s=cap[0],
                               capture_mib=cap[1])


def same_step(spec: PointSpec) -> PointSpec:
    return spec


def run_one(workers: int, point_s: float, folder: Path, storage: str | None) -> dict:
    out = folder / f"w{workers}.yaml"
    name = f"scale-w{workers}-{uuid.uuid4().hex[:6]}"
    config = ProfileConfig(device="cpu", out=str(out), storage=storage or str(out) + ".journal", study_name=name,
                           workers=workers, progress=False)
    start = time.perf_counter()
    _, frame = run_profile(config, timer=SleepRoofline(point_s), measure_point=same_step)
    wall = time.perf_counter() - start
    keys = Counter(frame["key"])
    return {"workers": workers, "wall_s": round(wall, 2), "measure_s": round(measure_span(config), 2), "points": len(frame), "duplicates": sum(
        n - 1 for n in keys.values() if n > 1), "per_worker": dict(Counter(frame["worker"])), "keys": sorted(keys)}


def measure_span(config: ProfileConfig) -> float:
    """Seconds from the first point claimed to the last one finished (process start excluded)."""
    import optuna

    from spectune.autotune.study_storage import open_storage

    study = optuna.load_study(study_name=config.study_name, storage=open_storage(config.storage))
    done = [t for t in study.trials if t.datetime_complete is not None and t.datetime_start is not None]
    return (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--point-s", type=float, default=0.5, help="seconds each point's measurement takes")
    ap.add_argument("--storage", default=None, help="RDB URL (default: a journal file per run)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="spectune-scale-"))
    rows = [run_one(n, args.point_s, folder, args.storage) for n in args.workers]
    base = next((r for r in rows if r["workers"] == 1), rows[0])
    print(f"{'workers':>7} {'wall s':>8} {'x 1':>6} {'measuring s':>11} {'x 1':>6} {'points':>6} {'dups':>4} "
          f"{'same points':>11}  per worker")
    for r in rows:
        r["ratio"] = round(r["wall_s"] / base["wall_s"], 3)
        r["measure_ratio"] = round(r["measure_s"] / base["measure_s"], 3)
        r["same_points"] = r["keys"] == base["keys"]
        print(f"{r['workers']:>7} {r['wall_s']:>8.2f} {r['ratio']:>6.3f} {r['measure_s']:>11.2f} "
              f"{r['measure_ratio']:>6.3f} {r['points']:>6} {r['duplicates']:>4} {str(r['same_points']):>11}  "
              f"{sorted(r['per_worker'].values())}")
    dest = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "scale_workers.json"
    storage_kind = "postgresql" if args.storage else "journal"
    path.write_text(json.dumps({"point_s": args.point_s, "storage": storage_kind, "cpus": os.cpu_count(),
                                "rows": [{k: v for k, v in r.items() if k != "keys"} for r in rows]}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
