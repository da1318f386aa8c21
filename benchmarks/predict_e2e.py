"""The simulator's end-to-end prediction (decode steps + separate prefill forwards) beside measured
bench runs, on CPU: the cost model's prefill checked against GPU results it was not fitted on.

    PYTHONPATH=. python benchmarks/predict_e2e.py RESULTS.json [...] [--out FILE]

For every (concurrency, arm) of each results JSON that ran separate prefill forwards (the bench
without ``--mixed-prefill``), the bench's own prediction is recomputed from its header (policy,
served acceptance, prompt length, new tokens; requests per concurrency from the rows) with
``runtime.prefill_plan.prefill_ms``: the engine's prefill schedule (pieces of <= 512 tokens, <= 4096 a forward, padded
to the graph buckets) at the profile's target step time. Prints measured and predicted end-to-end
and decode tok/s, and their errors (measured / predicted - 1), mean over the repeats.
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
from spectune.engine.bench import FixedPolicy, bench_tiers, parse_arm, widen
from spectune.engine.bench_accounting import SIM_REQUESTS
from spectune.io import atomic_write_text
from spectune.runtime.planner import Planner, load
from spectune.runtime.prefill_plan import prefill_ms


def predict_file(path: Path, root: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    h = data["header"]
    if h.get("mixed_prefill"):
        return []
    policy = Path(h["policy"])
    if not policy.exists():
        policy = root / "spectune" / "profiles" / policy.name
    planner = load(str(policy), on_gpu_mismatch="ignore")
    max_k = max(1, planner.k_hi)
    source = h["acceptance"].split(" (")[0]
    model = widen(resolve_acceptance(source, max_k), max_k)
    prompt_len, max_new = h["prompt_len"], h["max_new_tokens"]
    prefill = prefill_ms(planner.cost, prompt_len)  # the bench engine's chunk and forward size
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
            return FixedPolicy(k, tiers) if k is not None else Planner(planner.table)

        pred = predict_arm(planner.cost, model, make_policy, concurrency=c, requests=n, decode_tokens=max_new - 1,
                           context_len=prompt_len + max_new // 2, seeds=range(0, reps),
                           prior=tuned_prior(planner.table), prefill=prefill)
        out_m = statistics.fmean(r["output_tok_s"] for r in rows)
        dec_m = statistics.fmean(r["decode_tok_s"] for r in rows)
        out.append({"file": str(path), "prompt_len": prompt_len, "max_new_tokens": max_new, "concurrency": c,
                    "arm": arm, "repeats": len(rows), "output_tok_s": out_m, "predicted_output_tok_s": pred.output_tok_s,
                    "output_error": out_m / pred.output_tok_s - 1 if pred.output_tok_s else None,
                    "decode_tok_s": dec_m, "predicted_decode_tok_s": pred.goodput_tok_s,
                    "decode_error": dec_m / pred.goodput_tok_s - 1 if pred.goodput_tok_s else None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    rows = [r for f in args.results for r in predict_file(Path(f), root)]
    print(f"{'prompt/new':>10} {'c':>4} {'arm':<6} {'e2e':>8} {'pred':>8} {'err':>7} {'decode':>8} {'pred':>8} {'err':>7}")
    for r in rows:
        print(f"{r['prompt_len']:>4}/{r['max_new_tokens']:<5} {r['concurrency']:>4} {r['arm']:<6} {r['output_tok_s']:>8.0f} "
              f"{r['predicted_output_tok_s']:>8.0f} {r['output_error']:>+7.3f} {r['decode_tok_s']:>8.0f} "
              f"{r['predicted_decode_tok_s']:>8.0f} {r['decode_error']:>+7.3f}")
    if rows:
        errs = sorted(abs(r["output_error"]) for r in rows)
        print(f"end to end: median |error| {statistics.median(errs):.3f}, max {errs[-1]:.3f} over {len(rows)} cells")
    if args.out:
        atomic_write_text(Path(args.out), json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
