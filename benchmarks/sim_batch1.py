"""Concurrency 1 under the bench's protocol, simulated: the shipped ctx320 tables on every held-out
source, with the counters read late as an engine's host reads them.

`spectune bench` (and ``heldout_ab.py``) at c = 1 serves 24 requests of 64 new tokens and keeps
one planner across its repeats after a training run; here ``spectune simulate``'s path
(``whatif.simulate_table``) does the same (``--requests 24 --decode-tokens 63``, a shared
planner, ``--repeats`` seeds pooled) for each table and source, and prints auto / the best other
arm and auto / plain at full load. The simulator hands each step's counters to the planner
before the next plan; an engine whose host runs two steps ahead (``spectune.engine``: it reads
the counters of the step before last) is played with ``--late 1``: each step's counters are
handed over one plan later. ``--planner REV`` runs a git revision's planner instead of the
working copy's (``planner_trace.planner_at``). Writes JSON.

    PYTHONPATH=. python benchmarks/sim_batch1.py --late 1 --out new_late1.json      # ~6 min on 2 cores
    PYTHONPATH=. python benchmarks/sim_batch1.py --late 1 --planner HEAD~1 --out old_late1.json
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_trace import planner_at  # noqa: E402
from sim_tables import served_models  # noqa: E402

from spectune.autotune.whatif import WhatIf, simulate_table  # noqa: E402
from spectune.io import atomic_write_text  # noqa: E402
from spectune.runtime import planner as current  # noqa: E402

SOURCES = ("mtbench-ngram", "humaneval-ngram", "mtbench-suffix", "humaneval-suffix", "high-0.9", "low-0.55",
           "drift", "two-class", "tuned")


class Late:
    """A planner whose ``observe`` gets each step's counters ``late`` plans after the simulator
    hands them over (the rest of the planner as it is)."""

    def __init__(self, planner: Any, late: int):
        self._planner, self._late, self._queue = planner, late, []

    def observe(self, accepted: Any, tested: Any) -> None:
        self._queue.append((list(accepted), list(tested)))
        if len(self._queue) > self._late:
            self._planner.observe(*self._queue.pop(0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="*", help="policy tables (default: every shipped ctx320 table)")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--late", type=int, default=0, help="plans between a step and the planner reading its counters")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planner", metavar="REV", help="a git revision's planner.py (default: the working copy's)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.late < 0:
        raise SystemExit("sim_batch1: --late must be >= 0")
    module = planner_at(a.planner) if a.planner else current
    tables = a.tables or sorted(glob.glob(str(Path(__file__).resolve().parent.parent / "spectune/profiles/*ctx320.policy.yaml")))
    cells: dict[str, list[float]] = {}
    for table in tables:
        base = module.load(table, on_gpu_mismatch="ignore")
        for src in a.sources.split(","):
            acc, drift = served_models(src, base)

            def make(table: str = table) -> Any:
                planner = module.load(table, on_gpu_mismatch="ignore")
                return Late(planner, a.late) if a.late else planner
            what = WhatIf(make, acc, drift=drift, requests=lambda c: 24, repeats=a.repeats, decode_tokens=63,
                          shared=True, seed=a.seed)
            rows = simulate_table(what, [1], None)["rows"]
            auto = next(r for r in rows if r["arm"] == "auto")
            plain = next(r for r in rows if r["arm"] == "plain")
            key = f"{Path(table).name}|{src}"
            cells[key] = [auto["full_ratio_vs_best_other"], auto["full_tok_s"] / plain["full_tok_s"]]
            print(f"{Path(table).name[:44]:44s} {src:17s} {cells[key][0]:.4f} {cells[key][1]:.4f}", flush=True)
    traces = [v for k, v in cells.items() if "gram" in k or "suffix" in k]
    if traces:
        print(f"trace cells: mean {sum(v[0] for v in traces) / len(traces):.4f} of the best other arm, "
              f"{sum(v[0] < 0.98 for v in traces)} of {len(traces)} under 0.98, "
              f"{sum(v[1] < 0.99 for v in traces)} under 0.99 x plain")
    if a.out:
        atomic_write_text(a.out, json.dumps({"planner": a.planner or "working copy", "late": a.late, "seed": a.seed,
                                             "repeats": a.repeats, "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
