"""Prefill inside the step against separate prefill forwards: one bench per prefill mode, one table.

    PYTHONPATH=. python benchmarks/mixed_prefill.py --out-dir $OUT \
        [--policy spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml] \
        [--modes separate,mixed:256,mixed:512] [--concurrency 32,64] [--arms plain,auto] [--repeats 2]

Each mode is a ``spectune bench`` run (``run_bench``, the fused decoder) on the same prompts and
served acceptance; ``mixed:N`` is ``--mixed-prefill --prefill-budget N`` (an admission of more
than N prompt tokens at once takes separate forwards), ``mixed:N:rR`` the same with the ride limit
R (``--ride-limit R``: more than R at once separate), ``mixed:N:all`` lets every prompt ride; a
last part ``:pM`` caps the prompt pieces a riding step carries at M (``--ride-pieces``, default
16; ``mixed:256:all:p64`` at concurrency <= 64 is the engine before the cap, whose pieces'
attention launch had a slot per engine row); a last part ``:plan`` runs auto's riding steps at
``plan(batch)`` instead of ``Planner.plan_ride`` (``mixed:256:all:plan`` beside ``mixed:256:all``
is the A/B of plan_ride in one call); a last part ``:ahead`` admits ahead (``--admit-ahead``: a
request that may end by the next step lends its slot to a successor whose prompt rides in that
step and who joins as the slot frees; ``mixed:256:ahead`` beside ``mixed:256`` is its A/B). Every mode's results JSON is written to
``--out-dir`` as ``bench_<mode>.json``, then ``mixed_prefill.json`` holds the table:
per (mode, concurrency, arm) the mean over repeats of end-to-end output tok/s (the whole run,
prefill included), decode tok/s (steps only), TTFT mean / p99 and ITL p50 / p99, and end to end
over the *separate* mode's decode tok/s of the same arm (the issue's "end to end / decode": what
the engine delivers with admissions against what its decode steps alone run at). A mode that
fails is reported and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from spectune.engine.bench import BenchConfig, run_bench
from spectune.io import atomic_write_text
from spectune.runtime.prefill_plan import RIDE_PIECES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import first_line, int_list, say  # noqa: E402  (the probes' shared helpers)

POLICY = "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml"
FIELDS = ("output_tok_s", "decode_tok_s", "ttft_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "steps",
          "hard_mismatches")


RIDE_ALL = 1 << 30  # a ride limit no admission passes: every prompt rides


def parse_mode(text: str) -> tuple[str, int | None, int | None, int, bool, bool]:
    """(name, budget, ride limit, pieces a step, ride-aware, ahead): separate -> no budget; mixed:N ->
    budget N, bursts of more than N prompt tokens separate (the engine's default); mixed:N:all ->
    every prompt rides; mixed:N:rR -> bursts of more than R separate; a part pM caps the pieces a step carries at M (default ``RIDE_PIECES``);
    a last part ``plan`` runs auto's riding steps at ``plan(batch)`` (the rule before
    ``Planner.plan_ride``: the A/B of it in one call); a last part ``ahead`` admits ahead."""
    if text == "separate":
        return text, None, None, RIDE_PIECES, True, False
    parts = text.split(":")
    ahead = len(parts) > 2 and parts[-1] == "ahead"
    if ahead:
        parts.pop()
    aware = not (len(parts) > 2 and parts[-1] == "plan")
    if not aware:
        parts.pop()
    pieces = RIDE_PIECES
    if len(parts) > 2 and parts[-1][:1] == "p" and parts[-1][1:].isdigit() and int(parts[-1][1:]) >= 1:
        pieces = int(parts.pop()[1:])
    limit = parts[2] if len(parts) == 3 else ""  # all, or rR: a ride limit of R prompt tokens
    if not (parts[0] == "mixed" and len(parts) in (2, 3) and parts[1].isdigit() and int(parts[1]) >= 1
            and (len(parts) == 2 or limit == "all" or (limit[:1] == "r" and limit[1:].isdigit() and int(limit[1:]) >= 1))):
        raise SystemExit(f"--modes: {text!r} is not separate or mixed:N[:all|:rR][:pM][:plan][:ahead] (N >= 1 prompt tokens "
                         "a step, R >= 1 the ride limit, M >= 1 pieces a step)")
    ride = RIDE_ALL if limit == "all" else int(limit[1:]) if limit else None
    return text, int(parts[1]), ride, pieces, aware, ahead


def mean_rows(rows: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, float]]:
    """(concurrency, arm) -> mean of FIELDS over its repeats (and the repeat count)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["concurrency"], r["arm"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        cell: dict[str, float] = {"repeats": len(rs)}
        for f in FIELDS:
            vals = [float(r[f]) for r in rs if r.get(f) is not None]
            if vals:
                cell[f] = max(vals) if f == "hard_mismatches" else statistics.fmean(vals)
        out[key] = cell
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--policy", default=POLICY)
    ap.add_argument("--modes", default="separate,mixed:256,mixed:512")
    ap.add_argument("--concurrency", default="32,64")
    ap.add_argument("--arms", default="plain,auto")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--no-fused", action="store_true", help="the unfused decoder (default: fused)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    modes = [parse_mode(m.strip()) for m in args.modes.split(",") if m.strip()]
    concurrency = int_list(args.concurrency, "--concurrency", example="32,64")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table: dict[str, Any] = {"policy": args.policy, "concurrency": concurrency, "arms": args.arms,
                             "repeats": args.repeats, "fused": not args.no_fused, "modes": {}}
    for mode, budget, ride_limit, pieces, aware, ahead in modes:
        t0 = time.perf_counter()
        path = out_dir / f"bench_{mode.replace(':', '_')}.json"
        config = BenchConfig(policy=args.policy, out=str(path), concurrency=concurrency, arms=args.arms,
                             repeats=args.repeats, fused=not args.no_fused, mixed_prefill=budget is not None,
                             prefill_budget=budget or 256, ride_limit=ride_limit, ride_pieces=pieces,
                             ride_aware=aware, admit_ahead=ahead,
                             prompt_len=args.prompt_len,
                             max_new_tokens=args.max_new_tokens, device=args.device, progress=False)
        try:
            res = run_bench(config)
        except Exception as exc:  # one failed mode is reported, the next one runs
            say(f"{mode}: FAILED {first_line(exc)}")
            table["modes"][mode] = {"error": first_line(exc)}
            continue
        cells = mean_rows(res["rows"])
        table["modes"][mode] = {f"{c}/{arm}": cell for (c, arm), cell in sorted(cells.items())}
        table["modes"][mode]["seconds"] = round(time.perf_counter() - t0, 1)
        header = res["header"]
        for key in ("gpu", "driver", "torch", "triton", "prompt_len", "max_new_tokens"):
            table.setdefault(key, header.get(key))
        say(f"{mode}: {table['modes'][mode]['seconds']} s")
    base = table["modes"].get("separate", {})
    say(f"{'mode':<12} {'c':>4} {'arm':<6} {'e2e tok/s':>10} {'decode':>9} {'e2e/sep.decode':>14} "
        f"{'TTFT ms':>8} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'hard':>5}")
    for mode, cells in table["modes"].items():
        for key, cell in cells.items():
            if not isinstance(cell, dict):
                continue
            ref = base.get(key, {}).get("decode_tok_s")
            ratio = cell["output_tok_s"] / ref if ref else None
            cell["e2e_over_separate_decode"] = ratio
            c, arm = key.split("/")
            say(f"{mode:<12} {c:>4} {arm:<6} {cell['output_tok_s']:>10.0f} {cell['decode_tok_s']:>9.0f} "
                f"{ratio if ratio is not None else float('nan'):>14.3f} {cell.get('ttft_ms', 0):>8.1f} "
                f"{cell.get('ttft_p99_ms', 0):>8.1f} {cell.get('itl_p50_ms', 0):>8.2f} {cell.get('itl_p99_ms', 0):>8.2f} "
                f"{int(cell.get('hard_mismatches', 0)):>5}")
    atomic_write_text(out_dir / "mixed_prefill.json", json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
