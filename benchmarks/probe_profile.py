"""A profile-like cost surface from the H200 probe figures (until a measured profile ships).

Reads a probe JSON (rows of batch ``bs``, tokens per request ``q``, ``target_ms``, ``draft_ms``:
the drafter time of K = q - 1 sequential drafter steps), fits the runtime cost model with
``spectune.autotune.fit`` and writes a cost-only profile YAML (no capture points: every tier is
free to capture, no overhead measured). Every point is kept and scored in ``costs.error``.

    python benchmarks/probe_profile.py /work/shared/data/h200_probe_step_costs.json \
        benchmarks/profiles/h200_probe_qwen3-8b_eagle-1l.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from spectune import __version__
from spectune.autotune.fit import fit_drafter, fit_target, relative_errors
from spectune.runtime.costs import CostModel
from spectune.runtime.table import (
    SCHEMA,
    CostError,
    CostModelParams,
    Costs,
    Hardware,
    OverheadCost,
    Point,
    Software,
    Table,
    Workload,
    write_table,
)

CONTEXT = 2048
MAX_K = 15
MAX_BATCH = 256


def probe_points(rows: list[dict]) -> list[Point]:
    out = []
    for r in rows:
        b, q = int(r["bs"]), int(r["q"])
        out.append(Point("target", b, b * q, float(r["target_ms"]), q=q))
        if q > 1:
            out.append(Point("drafter", b, b * (q - 1), float(r["draft_ms"]), k=q - 1))
    return out


def probe_profile(probe: dict) -> Table:
    pts = probe_points(probe["rows"])
    tgt = [p for p in pts if p.kind == "target"]
    dft = [p for p in pts if p.kind == "drafter"]
    target = fit_target([p.tokens for p in tgt], [p.batch for p in tgt], [p.ms for p in tgt], CONTEXT)
    drafter = fit_drafter([p.batch for p in dft], [p.k for p in dft], [p.ms for p in dft], "autoregressive", CONTEXT)
    params = CostModelParams(target, drafter, OverheadCost(0.0, 0.0, source="none"))
    model = CostModel(params, "autoregressive", CONTEXT)
    errs = relative_errors(model, [{"kind": p.kind, "batch": p.batch, "tokens": p.tokens, "k": p.k, "ms": p.ms}
                                   for p in pts])
    env = probe.get("env", {})
    nvml = probe.get("nvml", {})
    limit = nvml.get("nvmlDeviceGetEnforcedPowerLimit")
    return Table(
        SCHEMA,
        Hardware(nvml.get("name", "NVIDIA H200"), capability="9.0", driver="580.159.04",
                 power_limit_w=None if limit is None else limit / 1000.0),
        Software(__version__, str(env.get("torch", "unknown")), str(env.get("triton", "")) or None),
        Workload("qwen3-8b", "eagle-1l", "autoregressive", 1, "bfloat16", CONTEXT, MAX_K, MAX_BATCH, "cuda"),
        Costs(params, CostError(len(errs), float(np.median(errs)), float(np.max(errs))), timer="cuda-graph",
              points=pts),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", help="probe JSON (e.g. h200_probe_step_costs.json)")
    ap.add_argument("out", help="profile YAML to write")
    args = ap.parse_args()
    table = probe_profile(json.loads(Path(args.probe).read_text()))
    write_table(table, args.out)
    e = table.costs.error
    print(f"fit over {e.held_out} points: median {e.median_rel * 100:.1f}%, max {e.max_rel * 100:.1f}% error")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
