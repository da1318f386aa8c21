"""The simulator's end-to-end prediction (decode steps + prefill) beside measured bench runs, on
CPU: the cost model's prefill checked against GPU results it was not fitted on.

    PYTHONPATH=. python benchmarks/predict_e2e.py RESULTS.json [...] [--out FILE]

For every (concurrency, arm) of each results JSON, the bench's own prediction is recomputed from
its header (policy, served acceptance, prompt length, new tokens, prefill mode; requests per
concurrency from the rows). Separate prefill forwards (the bench without ``--mixed-prefill``) are
priced by ``runtime.prefill_plan.prefill_ms``: the engine's prefill schedule (pieces of <= 512
tokens, <= 4096 a forward, padded to the graph buckets) at the profile's target step time. With
``--mixed-prefill`` the prompts ride in the steps (``runtime.prefill_plan.Riding``: the header's
``prefill_budget`` and ``ride_limit``; a header without a ride limit is a run from before the
limit existed, where every prompt rode), each riding step's target priced at its tier + prompt
tokens, at the shape the run's planner gave it (``plan_ride``; a header without ``ride_shapes`` is
a run from before it, whose riding steps ran ``plan(batch)``). Prints measured and predicted end-to-end and decode tok/s, and their errors (measured /
predicted - 1), mean over the repeats, with a summary per prefill mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from spectune.autotune.acceptance import resolve_acceptance
from spectune.autotune.whatif import predict_arm, tuned_prior
from spectune.engine.bench import FixedPolicy, bench_tiers, parse_arm
from spectune.engine.bench_accounting import SIM_REQUESTS
from spectune.io import atomic_write_text
from spectune.runtime.planner import load
from spectune.runtime.prefill_plan import Riding, prefill_ms

RIDE_ALL = 1 << 30  # the ride limit of a run from before the limit existed: every prompt rode


def predict_file(path: Path, root: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    h = data["header"]
    policy = Path(h["policy"])
    if not policy.exists():
        policy = root / "spectune" / "profiles" / policy.name
    planner = load(str(policy), on_gpu_mismatch="ignore")
    max_k = max(1, planner.k_hi)
    source = h["acceptance"].split(" (")[0]
    model = resolve_acceptance(source, max_k).widened(max_k)
    prompt_len, max_new = h["prompt_len"], h["max_new_tokens"]
    prefill = prefill_ms(planner.cost, prompt_len)  # the bench engine's chunk and forward size
    ride, mode = None, "separate"
    if h.get("mixed_prefill"):
        limit = h.get("ride_limit") or RIDE_ALL  # (no limit in the header: every prompt rode)
        # (no piece cap in the header: a run from before the cap, a step took any number of pieces)
        ride = Riding(prompt_len, h["prefill_budget"], limit, max_pieces=h.get("ride_pieces") or RIDE_ALL)
        mode = f"ride:{ride.budget}" + (":all" if limit == RIDE_ALL else f":{limit}")
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in data["rows"]:
        groups.setdefault((r["concurrency"], r["arm"]), []).append(r)
    concurrency = sorted({c for c, _ in groups})
    out = []
    for (c, arm), rows in sorted(groups.items()):
        k = parse_arm(arm)
        tiers = tuple(bench_tiers(planner.tiers, concurrency, [0] + ([k] if k else [])))
        n = rows[0]["completed"]
        reps = max(1, -(-SIM_REQUESTS // n))

        def make_policy(k: int | None = k, tiers: tuple[int, ...] = tiers) -> Any:
            if k is not None:
                return FixedPolicy(k, tiers)
            # riding steps as the run shaped them: ``plan_ride``, else ``plan(batch)`` (a ``:plan``
            # mode's run, or one from before plan_ride, whose header has no ride_shapes)
            policy = planner.fresh()
            policy.ride_aware = h.get("ride_shapes") == "plan_ride"
            return policy

        pred = predict_arm(planner.cost, model, make_policy, concurrency=c, requests=n, decode_tokens=max_new - 1,
                           context_len=prompt_len + max_new // 2, seeds=range(0, reps),
                           prior=tuned_prior(planner.table), prefill=prefill, ride=ride)
        out_m = statistics.fmean(r["output_tok_s"] for r in rows)
        # what the measured run took beyond the prediction, per riding step the simulator ran
        excess = None
        if ride is not None and pred.ride_steps:
            excess = (statistics.fmean(r["seconds"] for r in rows) - pred.seconds) * 1e3 / pred.ride_steps
        dec_m = statistics.fmean(r["decode_tok_s"] for r in rows)
        out.append({"file": str(path), "prefill": mode, "prompt_len": prompt_len, "max_new_tokens": max_new, "concurrency": c,
                    "arm": arm, "repeats": len(rows), "output_tok_s": out_m, "predicted_output_tok_s": pred.output_tok_s,
                    "output_error": out_m / pred.output_tok_s - 1 if pred.output_tok_s else None,
                    "decode_tok_s": dec_m, "predicted_decode_tok_s": pred.goodput_tok_s,
                    "decode_error": dec_m / pred.goodput_tok_s - 1 if pred.goodput_tok_s else None,
                    "predicted_ride_steps": pred.ride_steps if ride is not None else None,
                    "excess_ms_per_ride_step": excess})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    rows = [r for f in args.results for r in predict_file(Path(f), root)]
    print(f"{'prefill':<14} {'prompt/new':>10} {'c':>4} {'arm':<6} {'e2e':>8} {'pred':>8} {'err':>7} {'decode':>8} "
          f"{'pred':>8} {'err':>7} {'rides':>6} {'ms/ride':>8}")
    for r in rows:
        print(f"{r['prefill']:<14} {r['prompt_len']:>4}/{r['max_new_tokens']:<5} {r['concurrency']:>4} {r['arm']:<6} "
              f"{r['output_tok_s']:>8.0f} "
              f"{r['predicted_output_tok_s']:>8.0f} {r['output_error']:>+7.3f} {r['decode_tok_s']:>8.0f} "
              f"{r['predicted_decode_tok_s']:>8.0f} {r['decode_error']:>+7.3f} "
              + (f"{r['predicted_ride_steps']:>6.0f} {r['excess_ms_per_ride_step']:>8.2f}"
                 if r["excess_ms_per_ride_step"] is not None else ""))
    for mode in sorted({r["prefill"] for r in rows}):
        errs = sorted(abs(r["output_error"]) for r in rows if r["prefill"] == mode)
        signed = statistics.fmean(r["output_error"] for r in rows if r["prefill"] == mode)
        print(f"{mode}: end to end median |error| {statistics.median(errs):.3f}, max {errs[-1]:.3f}, "
              f"mean {signed:+.3f} over {len(errs)} cells")
    if args.out:
        atomic_write_text(Path(args.out), json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
