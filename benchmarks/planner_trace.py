"""Does a planner change keep every plan? The planner of a git revision beside the working copy's.

A change meant only to make the controller faster (or clearer) must return the same plans and
leave the same estimate behind, to the last bit. This script loads ``spectune/runtime/planner.py``
as it is at ``--against`` (``git show REV:path``) beside the one imported from the working tree,
serves both the same synthetic traffic on every shipped policy table (or the tables named) and
compares, per (table, workload), the plans each step returned and the state at the end (rates,
bounds, choices, resets, probes, trials, drift, phi, clamped steps). Workloads: acceptance that
shifts every 16 steps (counters of every position), acceptance that holds still and a drift half
way (counters of the plan's K positions, as an engine reports them), each at batch 1, 32, the
table's largest, a server's batch (a random walk) and a batch that jumps every step; step times
within +-8 % of the cost model. Prints one line per workload that differs and a summary; exit 1
if any differs.

    PYTHONPATH=. python benchmarks/planner_trace.py --against HEAD          # ~1 min on 2 cores
    PYTHONPATH=. python benchmarks/planner_trace.py --against HEAD~3 --steps 500 spectune/profiles/x.policy.yaml
"""

from __future__ import annotations

import argparse
import glob
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner import served_batches  # noqa: E402  (the server's batch walk)

import spectune.runtime.planner as current  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLANNER = "spectune/runtime/planner.py"
MODES = ("shift", "steady", "drift")


def planner_at(rev: str, source: Path | None = None) -> ModuleType:
    """The planner module as it is at git revision ``rev`` (or the file ``source``), imported
    under a name of its own beside the working copy's."""
    if source is None:
        try:
            text = subprocess.run(["git", "show", f"{rev}:{PLANNER}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise SystemExit(f"planner_trace: --against {rev}: no {PLANNER} there ({detail.strip()})") from None
        where = f"{rev}:{PLANNER}"
    else:
        text, where = source.read_text(), str(source)
    module = ModuleType("planner_reference")
    sys.modules[module.__name__] = module  # (a dataclass looks its module up while it is made)
    exec(compile(text, where, "exec"), module.__dict__)
    return module


def trace(planner: Any, steps: int, sizes: list[int], mode: str, seed: int = 0) -> list[Any]:
    """The plans of ``steps`` steps of one workload and the state left behind."""
    rng = random.Random(seed)
    planner.reset_online()
    n, out = planner.k_hi, []
    for i in range(steps):
        b = sizes[i % len(sizes)]
        plan = planner.plan(b)
        out.append(tuple(plan))
        r = {"shift": 0.9 if (i // 16) % 2 == 0 else 0.3, "steady": 0.75, "drift": 0.9 if i < steps // 2 else 0.5}[mode]
        r = min(0.99, max(0.01, r + rng.uniform(-0.15, 0.15)))
        k = n if mode == "shift" else plan.k
        tested = [b * r ** j if j < k else 0.0 for j in range(n)]
        planner.observe([t * r for t in tested], tested)
        ms = planner._model_ms[b].get(plan, 10.0) if 0 < b <= planner.max_batch else 10.0
        planner.observe_time(b, plan, ms * (1.0 + rng.uniform(-0.08, 0.08)))
    out.append((planner.rates, planner.rate_bounds, planner.choices(), planner.changes, planner.probes,
                planner.trials, planner.drift, planner.phi, planner.clamped))
    return out


def workloads(max_batch: int) -> list[tuple[str, list[int]]]:
    return [("batch 1", [1]), ("batch 32", [min(32, max_batch)]), (f"batch {max_batch}", [max_batch]),
            ("a server's batch", served_batches(max_batch)),
            ("a new batch each step", [1 + (i * 37) % max_batch for i in range(512)])]


def compare(old: ModuleType, new: ModuleType, tables: list[str], steps: int) -> tuple[int, list[str]]:
    """(workloads compared, one line per workload whose plans or end state differ)."""
    n, diffs = 0, []
    for path in tables:
        a = old.load(path, on_gpu_mismatch="ignore")
        b = new.load(path, on_gpu_mismatch="ignore")
        for mode in MODES:
            for name, sizes in workloads(a.max_batch):
                n += 1
                ta, tb = trace(a, steps, sizes, mode), trace(b, steps, sizes, mode)
                if ta != tb:
                    first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta) - 1)
                    where = "end state" if first == len(ta) - 1 else f"step {first}: {ta[first]} -> {tb[first]}"
                    diffs.append(f"{Path(path).name}, {mode}, {name}: {where}")
    return n, diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="*", help="policy tables (default: every table under spectune/profiles)")
    ap.add_argument("--against", default="HEAD", help="git revision whose planner is the reference (default HEAD)")
    ap.add_argument("--against-file", default=None, help="a planner.py file as the reference instead of a revision")
    ap.add_argument("--steps", type=int, default=3000, help="steps per workload (default 3000)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    tables = args.tables or sorted(glob.glob(str(ROOT / "spectune/profiles/*.policy.yaml")))
    for t in tables:
        if not Path(t).is_file():
            ap.error(f"{t}: no such policy table")
    old = planner_at(args.against, Path(args.against_file) if args.against_file else None)
    n, diffs = compare(old, current, tables, args.steps)
    for line in diffs:
        print("differs:", line)
    ref = args.against_file or args.against
    print(f"{len(tables)} tables x {n // max(1, len(tables))} workloads: {n - len(diffs)} of {n} the same as {ref}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
