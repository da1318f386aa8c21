"""The simulator with and without the reference engine's host lag, against measured bench runs.

The engine's host plans step s while the device runs step s - 1, so it holds the tokens of step
s - 2: a request that ended on a step that emitted two or more of its tokens is not known to be
done, rides one more step as an idle row (one slot, no drafts, no output: ``idle_rows`` in each
bench row) and its successor is admitted after it. ``simulate(host_lag=True)`` plays that
(``simulator._finished``); the bench's predictions use it. For each run of the given
``spectune bench`` results (a curve or public acceptance; trace replays are skipped), per
(concurrency, arm): the measured decode tok/s (mean over repeats), the prediction without and
with the lag (the bench's own prediction path, ``whatif.predict_arm``, its seeds and requests),
and the idle rows measured and simulated. A policy table of the header's file name beside a
results file is the one its runs used (a shipped table re-tuned since would predict other plans).

    PYTHONPATH=. python benchmarks/sim_host_lag.py benchmarks/results/heldout_h200_v17/bench_heldout_tuned_h200.json \\
        benchmarks/results/dflash_h200_v19/bench_heldout_*_dflash_c32_p*.json --out benchmarks/results/sim_host_lag.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from spectune.autotune.acceptance import resolve_acceptance
from spectune.autotune.simulator import simulate
from spectune.autotune.whatif import parse_arm, predict_arm, tuned_prior
from spectune.engine.bench import FixedPolicy
from spectune.engine.bench_accounting import SIM_REQUESTS
from spectune.errors import SpectuneError
from spectune.io import atomic_write_text
from spectune.runtime.planner import load


def served_source(header: dict[str, Any]) -> str | None:
    """The acceptance a run served, where the simulator takes it as it is (a curve or a public
    figure); None for a trace replay or a drift."""
    first = str(header.get("acceptance", "")).split(" ")[0]
    return first if first.startswith(("curve:", "public:")) and not header.get("drift") else None


def cells(path: Path, concurrency: set[int] | None) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    header = data["header"]
    source = served_source(header)
    if source is None:
        print(f"{path.name}: skipped (served {str(header.get('acceptance'))[:40]!r}: not a curve or public figure)",
              file=sys.stderr)
        return []
    policy = Path(header["policy"])
    if (path.parent / policy.name).exists():  # the table the run used, kept beside its results
        policy = path.parent / policy.name  # (the shipped one may have been re-tuned since)
    elif not policy.exists() and (Path(__file__).parent / policy).exists():
        policy = Path(__file__).parent / policy  # a run made from benchmarks/ (``../spectune/...``)
    planner = load(str(policy), on_gpu_mismatch="ignore")
    tiers = [int(t) for t in str(header["tiers"]).split(",")]
    acceptance = resolve_acceptance(source, max(1, planner.k_hi))
    prior = tuned_prior(planner.table)
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in data["rows"]:
        if concurrency is None or row["concurrency"] in concurrency:
            groups.setdefault((row["concurrency"], row["arm"]), []).append(row)
    out = []
    for (c, arm), rows in groups.items():
        k = parse_arm(arm)

        def make(k: int | None = k) -> Any:
            return FixedPolicy(k, tiers) if k is not None else planner.fresh()

        n = rows[0]["completed"]
        seeds = range(int(header.get("seed", 0)), int(header.get("seed", 0)) + max(1, -(-SIM_REQUESTS // n)))
        decode_tokens, context = header["max_new_tokens"] - 1, header["prompt_len"] + header["max_new_tokens"] // 2
        kw = dict(concurrency=c, requests=n, decode_tokens=decode_tokens, context_len=context, seeds=seeds, prior=prior)
        before = predict_arm(planner.cost, acceptance, make, **kw).goodput_tok_s
        after = predict_arm(planner.cost, acceptance, make, host_lag=True, **kw).goodput_tok_s
        idle = [simulate(planner.cost, acceptance, make(), concurrency=c, context_len=context, steps=1_000_000,
                         requests=n, seed=s, mean_output_tokens=decode_tokens, workload="closed", lengths="fixed",
                         prior=prior, host_lag=True).idle_rows for s in seeds]
        measured = statistics.fmean(r["decode_tok_s"] for r in rows)
        out.append({"file": path.name, "gpu": header.get("gpu"), "concurrency": c, "arm": arm, "requests": n,
                    "repeats": len(rows), "measured_tok_s": measured, "predicted_tok_s": before,
                    "predicted_host_lag_tok_s": after,
                    "error": before / measured - 1 if before else None,
                    "error_host_lag": after / measured - 1 if after else None,
                    "idle_rows": statistics.fmean(r["idle_rows"] for r in rows),
                    "idle_rows_simulated": statistics.fmean(idle)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="spectune bench results JSON files")
    ap.add_argument("--concurrency", help="only these concurrencies (comma list)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    try:
        only = {int(c) for c in a.concurrency.split(",")} if a.concurrency else None
        rows = [r for f in a.results for r in cells(Path(f), only)]
    except (OSError, ValueError, KeyError, SpectuneError) as exc:
        print(f"sim_host_lag: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 2
    print(f"{'file':40} {'c':>4} {'arm':>8} {'measured':>9} {'pred':>8} {'err':>7} {'lag':>8} {'err':>7} "
          f"{'idle':>6} {'sim':>6}")
    for r in rows:
        print(f"{r['file'][:40]:40} {r['concurrency']:>4} {r['arm']:>8} {r['measured_tok_s']:>9.0f} "
              f"{r['predicted_tok_s'] or 0:>8.0f} {r['error'] or 0:>+7.3f} {r['predicted_host_lag_tok_s'] or 0:>8.0f} "
              f"{r['error_host_lag'] or 0:>+7.3f} {r['idle_rows']:>6.0f} {r['idle_rows_simulated']:>6.0f}")
    spec = [r for r in rows if r["arm"] != "plain" and r["error"] is not None and r["error_host_lag"] is not None]
    summary = {}
    if spec:
        for key in ("error", "error_host_lag"):
            errs = [abs(r[key]) for r in spec]
            summary[key] = {"median_abs": statistics.median(errs), "max_abs": max(errs)}
        print(f"drafting arms ({len(spec)}): median |error| {summary['error']['median_abs']:.3f} -> "
              f"{summary['error_host_lag']['median_abs']:.3f}, max {summary['error']['max_abs']:.3f} -> "
              f"{summary['error_host_lag']['max_abs']:.3f}")
    if a.out:
        atomic_write_text(a.out, json.dumps({"results": a.results, "summary": summary, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
