"""Held-out A/B: one policy served on several acceptance sources in one process (``spectune bench``).

One engine, its captured graphs and the plain reference outputs (they depend on the prompts only)
serve every source; per source the arms are plain, the simulator's best fixed K and its
neighbours, and auto, each ``--repeats`` times interleaved (order rotated per repeat). Writes
OUT/bench_heldout_<source>_<tag>.json per source and prints auto / best other arm and auto / plain
(means over repeats with 95 % intervals) per source and concurrency.

Time on the H200 (qwen3-8b + eagle-1l, bf16; measured 2026-12-01): prompt 288 + 64 new tokens
keeps the tuned context 320; with the requests of ``PROMPTS`` (the batch stays full for one to two
waves, so the full-load window ``full_tok_s`` is long enough) two sources at c = 1, 16, 64, 256 took
~4 minutes each after ~100 s of setup (a third did not fit one 10-minute call), and five sources
at c = 16, 64 took 365 s in all:

    PYTHONPATH=. python benchmarks/heldout_ab.py --sources humaneval,mtbench --out $OUT
    PYTHONPATH=. python benchmarks/heldout_ab.py --sources humaneval,mtbench,drift,low,high --concurrency 16,64 --out $OUT
    PYTHONPATH=. python benchmarks/heldout_ab.py --sources drift@1/16/256,humaneval,mtbench --concurrency 1,256 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SOURCES = {
    "humaneval": "spectune/data/traces/humaneval-ngram.jsonl.gz",
    "mtbench": "spectune/data/traces/mtbench-ngram.jsonl.gz",
    "high": "curve:" + ",".join(f"{0.9 ** i:.6g}" for i in range(1, 16)),
    "low": "curve:" + ",".join(f"{0.55 ** i:.6g}" for i in range(1, 16)),
    "tuned": "public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench",
}
DRIFT = ("high", "low")  # the "drift" source: high for the first half of each run's requests, then low
POLICY = "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml"
# requests per concurrency (others: 2 waves): at c >= 16 two or three waves, so the batch stays
# full (rows == concurrency) for at least a wave -- the full-load window, ``full_tok_s``; at c = 1,
# 24 requests: with 6 (~70 steps a run) which requests a repeat draws moved every arm, and three
# repeats of 0.9^i gave auto / fixed:9 0.978 [0.911, 1.046] on the H200; 24 gave 0.995 [0.980, 1.011].
# At c = 32 (the DFlash protocol) 256 requests, eight waves: over two (64) the trials and probes,
# a fixed number of steps, weigh on ~40 full-load steps -- DFlash 0.9^i read 0.976-0.978 of fixed:7
# there in every call, 0.984 [0.967, 1.001] over 256 (H200, 2026-12-05); a server runs longer still
PROMPTS = {1: 24, 16: 48, 32: 256, 64: 128, 256: 320}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", required=True, help=f"comma list of {', '.join([*SOURCES, 'drift'])}; "
                   "NAME@C1/C2 serves that source at its own concurrencies (default: --concurrency); a source "
                   "named twice runs once, at the union of its concurrencies")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--policy", default=POLICY)
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=288)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=None, help="requests per concurrency (default: PROMPTS)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per timed run")
    p.add_argument("--device", default=None)
    p.add_argument("--target", default=None)
    p.add_argument("--tag", default="h200", help="file name suffix")
    p.add_argument("--fused", action="store_true",
                   help="the fused decoder layers (spectune bench --fused): serve a table profiled with them")
    p.add_argument("--mixed-prefill", action="store_true", help="prompts inside the steps (spectune bench --mixed-prefill)")
    p.add_argument("--no-admit-ahead", action="store_true",
                   help="with --mixed-prefill: no admission ahead (spectune bench --no-admit-ahead)")
    p.add_argument("--await-ends", action="store_true",
                   help="the host reads the last step's tokens where a row may have ended (spectune bench --await-ends)")
    return p.parse_args(argv)


def served(name: str) -> tuple[str | None, str | None]:
    """(acceptance, drift) of a named source."""
    if name == "drift":
        return None, f"{SOURCES[DRIFT[0]]},{SOURCES[DRIFT[1]]}"
    if name not in SOURCES:
        raise SystemExit(f"heldout_ab: unknown source {name!r} (known: {', '.join([*SOURCES, 'drift'])})")
    return SOURCES[name], None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from spectune.engine.bench import BenchConfig, run_sources
    from spectune.engine.bench_accounting import captured_runs
    from spectune.errors import SpectuneError

    picked = [n.strip().partition("@") for n in args.sources.split(",") if n.strip()]
    names: list[str] = []  # each source once, where first named: a source named twice (``x@64,x@1``)
    own: dict[str, list[int]] = {}  # runs once at the union of its concurrencies (its file is one)
    try:
        base = [int(c) for c in args.concurrency.split(",")]
        for n, _, cs in picked:
            if n not in own:
                names.append(n)
            own[n] = sorted(set(own.get(n, [])) | set([int(c) for c in cs.split("/")] if cs else base))
        conc = sorted(set(base) | {c for cs in own.values() for c in cs})
    except ValueError:
        print(f"heldout_ab: error: --sources/--concurrency: concurrencies must be integers, got "
              f"{args.sources!r} / {args.concurrency!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = args.prompts if args.prompts is not None else {c: PROMPTS.get(c, 2 * c) for c in conc}
    config = BenchConfig(policy=args.policy, out=str(out / "unused.json"), concurrency=conc, prompts=prompts,
                         max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len, device=args.device,
                         target=args.target, time_limit_s=args.time_limit, repeats=args.repeats, progress=False,
                         predict_at_measured_accept=False, fused=args.fused, mixed_prefill=args.mixed_prefill,
                         await_ends=args.await_ends, admit_ahead=not args.no_admit_ahead)
    jobs = [(*served(n), str(out / f"bench_heldout_{n}_{args.tag}.json"), own[n]) for n in names]
    try:
        results = run_sources(config, jobs)
    except SpectuneError as exc:
        print(f"heldout_ab: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'source':>10} {'conc':>5} {'metric':>8} {'best other':>10} {'auto/best [95%]':>24} "
          f"{'auto/plain [95%]':>24} {'timed out':>9}")
    for name, res in zip(names, results, strict=True):
        timed_out = {}
        for a in res["summary"]["arms"]:
            timed_out[a["concurrency"]] = timed_out.get(a["concurrency"], 0) + a["timed_out"]
        for key, label in (("summary_full_load", "full"), ("summary", "run")):
            for r in res[key]["ratios"]:
                print(f"{name:>10} {r['concurrency']:>5} {label:>8} {r['best_other']:>10} "
                      f"{_ci(r['vs_best_other'], r['vs_best_other_ci95']):>24} "
                      f"{_ci(r['vs_plain'], r['vs_plain_ci95']):>24} {timed_out.get(r['concurrency'], 0):>9}")
    captured = [f"{n}: {run}" for n, res in zip(names, results, strict=True) for run in captured_runs(res["rows"])]
    if captured:
        print(f"warning: {len(captured)} timed runs captured CUDA graphs inside the run: {', '.join(captured)}",
              file=sys.stderr)
    (out / f"heldout_summary_{args.tag}.json").write_text(json.dumps(
        {n: {"full_load": r["summary_full_load"], "run": r["summary"], "acceptance": r["header"]["acceptance"],
             "tuned_acceptance": r["header"]["tuned_acceptance"]} for n, r in zip(names, results, strict=True)},
        indent=1) + "\n")
    return 0


def _ci(v: float | None, lo_hi: list[float] | None) -> str:
    return f"{v:.3f} [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if v is not None and lo_hi else "-"


if __name__ == "__main__":
    sys.exit(main())
