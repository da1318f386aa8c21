"""Refit a profile's cost model from the points it already holds, with the current fit code.

A profile keeps every measured point (``costs.points``, held-out ones marked), so a change of the
cost model's form (the GEMM tile, the parallel drafter's knee) can be applied to an old profile
without measuring again; the held-out error is recomputed on the same held-out points. Writes the
new profile (atomically) and prints the old and new fit::

    python benchmarks/refit_profile.py benchmarks/results/profile_fp8_h200/nvidia-h200_qwen3-8b_eagle-1l.fp8.yaml \\
        --out /tmp/refit.fp8.yaml

A policy table tuned on the old profile is not changed: tune again on the new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from spectune.autotune.fit import FitError, fit_cost_model, held_out_error
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.table import Table, read_table, write_table


def refit(table: Table) -> Table:
    """``table`` with its cost model and held-out error refitted from its own points."""
    w, costs = table.workload, table.costs
    if costs is None or not costs.points:
        raise FitError("costs.points: the profile holds no measured points to refit from")
    records = [{"kind": p.kind, "batch": p.batch, "tokens": p.tokens, "q": p.q, "k": p.k, "ms": p.ms,
                "feasible": p.ms is not None, "held_out": p.held_out, "power_w": p.power_w}
               for p in costs.points]
    params = fit_cost_model(records, drafter_kind=w.drafter_kind, context_len=w.context_len,
                            overhead_source=costs.model.overhead.source)
    params = dataclasses.replace(params, overhead=costs.model.overhead)  # measured apart: kept as it is
    error = held_out_error(CostModel(params, w.drafter_kind, w.context_len), records)
    return dataclasses.replace(table, costs=dataclasses.replace(costs, model=params, error=error))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="profile YAML from `spectune profile`")
    ap.add_argument("--out", required=True, help="refitted profile YAML path")
    a = ap.parse_args(argv)
    try:
        old = read_table(a.profile)
        if old.policy is not None:
            raise FitError(f"{a.profile}: a policy table; refit its profile and tune again")
        new = refit(old)
        write_table(new, Path(a.out))
    except SpectuneError as exc:
        print(f"refit_profile: error: {exc}", file=sys.stderr)
        return 2
    for name, t in (("before", old), ("after", new)):
        e, tg = t.costs.error, t.costs.model.target
        print(f"{name:>6}: held-out median {e.median_rel:.2%} / max {e.max_rel:.2%} on {e.held_out} points; "
              f"target tile {tg.tile_tokens}, knee {tg.knee_tokens:.0f} tokens")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
