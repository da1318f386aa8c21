"""The seed experiment on the GPU: fixed K5 / K7 vs adaptive max K 7 under a verify budget of 5
drafts per request, with the budget allocated by (a) the drafter's confidences, (b) each
request's history, (c) uniformly -- goodput and mean acceptance length, with the real suffix
drafter's traces replayed token by token.

Setup (the bench's, ``spectune.engine.bench.build``): the qwen3-8b target shape and a 1-layer
EAGLE drafter with random weights on the H200, bf16, paged Triton attention, CUDA graphs. Per
concurrency the plain arm runs first; its greedy outputs are the requests' continuations. Per
dataset and repeat, the replay drafter loads the trace set token by token
(``ReplayDrafter.load_tokens``: right/wrong, offered drafts and the drafter's confidence per draft
position, confidences calibrated by per-position tables fitted on the other prompt split,
replayed requests in a seeded order per repeat; docs/BENCH_METHOD.md says what is exact and what
is approximated), then every arm runs once, in an order rotated per repeat:

  K5, K7         every request drafts K, all offered drafts verified
  conf/hist/unif max K 7, budget 5 x batch drafts per step, the allocation ranking by the trace's
                 confidences / the request's accepted history from the trace's population rates /
                 a constant (equal shares)

Per arm: decode goodput (output tokens of decode steps / decode seconds) and mean acceptance length
(tokens per request-step, bonus included; over the steps before any divergence from the plain
output), mean and Student-t 95 % interval over repeats, and per repeat the ratio to K5 (paired:
same replayed requests), its mean and interval.

Time on one H200 (per decode step from benchmarks/results/bench_ab_bf16_ctx320_h200.json: ~9 ms
at c = 1 to ~30 ms at c = 128 with K 7; prefill ~30 000 tokens/s): prompts 256 + 64 new tokens,
requests 6 / 32 / 128 / 192 at c = 1 / 16 / 64 / 128 make ~3 / 1.5 / 2.5 / 5 s per run, 5 arms x
3 repeats x 2 datasets ~ 5 min, plus ~1.5 min of setup and warm-up; ``--deadline-s`` (default
420 s) starts no new run past it and records what was skipped.

    PYTHONPATH=. python benchmarks/seed_experiment_gpu.py --out-dir $OUT
    PYTHONPATH=. python benchmarks/seed_experiment_gpu.py --device cpu --target tiny \\
        --concurrency 1,2 --prompts 3 --max-new-tokens 8 --prompt-len 8 --repeats 2   # CPU check

Writes OUT/seed_experiment_gpu.json (rewritten after every run) and OUT/seed_experiment_gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = {d: ROOT / "spectune" / "data" / "traces" / f"{d}-suffix.jsonl.gz" for d in ("humaneval", "mtbench")}
POLICY = ROOT / "spectune" / "profiles" / "nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml"
PROMPTS = {1: 6, 16: 32, 64: 128, 128: 192}  # requests per concurrency (others: 2 waves)
MAX_K, BUDGET = 7, 5
ARMS = ("K5", "K7", "conf", "hist", "unif")
ALLOCATION = {"conf": "confidence", "hist": "history", "unif": "uniform"}
WARMUP_TOKENS = 8


class BudgetPolicy:
    """Max K drafts per request, ``per_request`` x batch of them verified: the allocation picks."""

    def __init__(self, k: int, per_request: int, tiers: tuple[int, ...]):
        self.k, self.per_request, self.tiers = k, per_request, tiers

    def plan(self, batch_size: int) -> Any:
        from spectune.runtime.planner import Plan, smallest_tier

        budget = self.per_request * batch_size
        tier = smallest_tier(self.tiers, batch_size + budget)
        if tier is None:  # past the largest tier: what it holds
            budget = max(0, self.tiers[-1] - batch_size)
            tier = smallest_tier(self.tiers, batch_size + budget)
        return Plan(self.k if budget > 0 else 0, budget, tier)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.environ.get("OUT"), help="output folder (default $OUT)")
    p.add_argument("--datasets", default="humaneval,mtbench")
    p.add_argument("--policy", default=str(POLICY), help="policy table: tiers, workload (target, drafter, dtype)")
    p.add_argument("--concurrency", default="1,16,64,128")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=None, help="requests per concurrency (default: PROMPTS)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per timed run")
    p.add_argument("--deadline-s", type=float, default=420.0, help="no new run starts after this")
    p.add_argument("--device", default=None)
    p.add_argument("--target", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def policy_of(arm: str, tiers: tuple[int, ...]) -> Any:
    from spectune.engine.bench import FixedPolicy

    if arm in ("K5", "K7"):
        return FixedPolicy(int(arm[1:]), tiers)
    if arm == "plain":
        return FixedPolicy(0, tiers)
    return BudgetPolicy(MAX_K, BUDGET, tiers)


def warm(setup: Any, c: int, requests: list[Any], done: set[tuple[int, int]], policy: Any) -> None:
    """Graphs of this concurrency's shapes and one short untimed run, once per (c, K)."""
    from spectune.engine.engine import Request

    k = policy.plan(c).k
    if (c, k) in done:
        return
    setup.engine.prepare([k], c)
    short = [Request(r.prompt, min(r.max_new_tokens, WARMUP_TOKENS)) for r in requests[:c]]
    setup.engine.run(short, policy, concurrency=c)
    done.add((c, k))


def record(arm: str, c: int, dataset: str, repeat: int, res: Any) -> dict[str, Any]:
    return {"dataset": dataset, "concurrency": c, "arm": arm, "repeat": repeat,
            "decode_tok_s": res.decode_tok_s, "mean_accept_len": res.mean_accept_len,
            "mean_accept_len_clean": res.mean_accept_len_clean, "steps": res.steps, "tokens": res.tokens,
            "seconds": round(res.seconds, 4), "decode_ms": round(res.decode_ms, 3), "timed_out": res.timed_out,
            "completed": sum(res.done), "diverged_requests": sum(d is not None for d in res.diverged_at),
            "k_hist": {str(k): v for k, v in sorted(res.k_hist.items())}}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dataset, c, arm): means and 95 % intervals over repeats, and the paired ratio to K5."""
    from spectune.engine.bench_accounting import mean_interval

    by: dict[tuple[str, int, str], dict[int, dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r:
            by.setdefault((r["dataset"], r["concurrency"], r["arm"]), {})[r["repeat"]] = r
    out = []
    for (d, c, arm), runs in sorted(by.items()):
        entry: dict[str, Any] = {"dataset": d, "concurrency": c, "arm": arm, "repeats": len(runs)}
        for field in ("decode_tok_s", "mean_accept_len_clean"):
            stat = mean_interval([x[field] for x in runs.values() if x[field]])
            entry[field] = None if stat is None else [round(v, 4) for v in stat]
            base = by.get((d, c, "K5"), {})
            ratios = [x[field] / base[i][field] for i, x in runs.items() if i in base and x[field] and base[i][field]]
            stat = mean_interval(ratios)
            entry[f"{field}_vs_K5"] = None if stat is None else [round(v, 4) for v in stat]
        out.append(entry)
    return out


def _cell(v: list[float] | None, pct: bool = False) -> str:
    if not v:
        return "-"
    if pct:
        return f"{(v[0] - 1) * 100:+.1f}% [{(v[1] - 1) * 100:+.1f}, {(v[2] - 1) * 100:+.1f}]"
    return f"{v[0]:.4g} [{v[1]:.4g}, {v[2]:.4g}]"


def markdown(summary: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [f"Seed experiment: {header['target']} + {header['drafter']}, {header['dtype']}, {header['gpu']}, "
             f"prompt {header['prompt_len']} + {header['max_new_tokens']} new tokens, {header['repeats']} repeats; "
             "mean [95% interval]; vs K5: paired ratio per repeat", ""]
    for field, name in (("decode_tok_s", "decode goodput (tok/s)"), ("mean_accept_len_clean", "mean acceptance length")):
        plain = {s["concurrency"]: s for s in summary if s["arm"] == "plain"}
        for d in sorted({s["dataset"] for s in summary if s["arm"] != "plain"}):
            lines += [f"### {d}: {name}", "", "| concurrency | plain | " + " | ".join(ARMS) + " |",
                      "|---|---|" + "---|" * len(ARMS)]
            for c in sorted({s["concurrency"] for s in summary if s["dataset"] == d}):
                here = {s["arm"]: s for s in summary if s["dataset"] == d and s["concurrency"] == c}
                p = plain.get(c, {}).get(field) if field == "decode_tok_s" else [1.0, 1.0, 1.0]
                cells = [_cell(p)]
                for arm in ARMS:
                    s = here.get(arm)
                    cell = _cell(s[field]) if s else "-"
                    if s and arm != "K5":
                        cell += f" ({_cell(s[f'{field}_vs_K5'], pct=True)})"
                    cells.append(cell)
                lines.append(f"| {c} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.out_dir:
        print("seed_experiment_gpu: --out-dir: not given and $OUT is not set", file=sys.stderr)
        return 2
    import torch

    from spectune.autotune.hardware import hardware_facts, parse_device
    from spectune.engine.bench import BenchConfig, BenchError, build, exact_float32, rotated
    from spectune.engine.trace_replay import load_trace_replay
    from spectune.errors import SpectuneError
    from spectune.io import atomic_write_text
    from spectune.runtime.planner import load

    t_start = time.monotonic()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        conc = sorted({int(c) for c in args.concurrency.split(",")})
        datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
        unknown = [d for d in datasets if d not in TRACES]
        if unknown or not conc or min(conc) < 1 or args.repeats < 1:
            raise BenchError(f"--datasets/--concurrency/--repeats: bad value ({unknown or args.concurrency})")
        device = parse_device(args.device, BenchError)
        planner = load(args.policy, on_gpu_mismatch="warn")
        replays = {d: load_trace_replay(str(TRACES[d]), MAX_K) for d in datasets}
    except (SpectuneError, ValueError) as exc:
        print(f"seed_experiment_gpu: error: {exc}", file=sys.stderr)
        return 2
    counts = {c: args.prompts or PROMPTS.get(c, 2 * c) for c in conc}
    dtype = args.dtype or (planner.table.workload.dtype if device.type == "cuda" else "float32")
    config = BenchConfig(policy=args.policy, out=str(out / "unused.json"), target=args.target, device=str(device),
                         dtype=dtype, seed=args.seed, progress=False)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    header: dict[str, Any] = {}

    def write(complete: bool) -> None:
        summary = summarise(rows)
        data = {"header": {**header, "complete": complete, "elapsed_s": round(time.monotonic() - t_start, 1)},
                "rows": rows, "errors": errors, "summary": summary}
        atomic_write_text(out / "seed_experiment_gpu.json", json.dumps(data, indent=1) + "\n")
        if complete:
            atomic_write_text(out / "seed_experiment_gpu.md", markdown(summary, header) + "\n")

    with exact_float32(device, dtype):
        setup = build(config, planner, device, conc, [0, 5, MAX_K], False, max(counts.values()), args.prompt_len,
                      args.max_new_tokens)
        tiers = setup.engine.tiers
        header = {"gpu": hardware_facts(device).gpu, "target": setup.target, "drafter": setup.drafter,
                  "dtype": setup.dtype, "device": str(device), "prompt_len": args.prompt_len,
                  "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "budget_per_request": BUDGET,
                  "max_k": MAX_K, "requests": {str(c): n for c, n in counts.items()}, "seed": args.seed,
                  "traces": {d: r.describe() for d, r in replays.items()}, "policy": str(args.policy),
                  "torch": torch.__version__, "setup_s": round(time.monotonic() - t_start, 1)}
        print(f"setup {header['setup_s']} s: {header['target']} + {header['drafter']} on {header['gpu']}", flush=True)
        warmed: set[tuple[int, int]] = set()
        for c in conc:
            requests = setup.requests[: counts[c]]
            try:
                plain = setup.engine.run(requests, policy_of("plain", tiers), concurrency=c)
                rows.append(record("plain", c, "-", 0, plain))
            except Exception as exc:  # one bad point must not end the run
                errors.append({"concurrency": c, "arm": "plain", "error": repr(exc), "trace": traceback.format_exc()})
                print(f"c={c} plain: error {exc!r}", flush=True)
                continue
            for d in datasets:
                for r in range(args.repeats):
                    tables = replays[d].tables(len(requests), args.max_new_tokens, args.seed, r)
                    for arm in rotated(ARMS, r):
                        if time.monotonic() - t_start > args.deadline_s:
                            errors.append({"dataset": d, "concurrency": c, "arm": arm, "repeat": r,
                                           "error": "skipped: --deadline-s reached"})
                            continue
                        try:
                            setup.replay.load_tokens(plain.outputs, tables, prior=replays[d].rates)
                            if arm in ALLOCATION:
                                setup.replay.set_allocation(ALLOCATION[arm])
                            policy = policy_of(arm, tiers)
                            warm(setup, c, requests, warmed, policy)
                            res = setup.engine.run(requests, policy, concurrency=c, time_limit_s=args.time_limit,
                                                   reference=plain.outputs)
                            rows.append(record(arm, c, d, r, res))
                            print(f"{d} c={c} {arm} #{r}: {res.decode_tok_s or 0:.1f} tok/s, "
                                  f"accept len {res.mean_accept_len_clean or 0:.3f}", flush=True)
                        except Exception as exc:
                            errors.append({"dataset": d, "concurrency": c, "arm": arm, "repeat": r,
                                           "error": repr(exc), "trace": traceback.format_exc()})
                            print(f"{d} c={c} {arm} #{r}: error {exc!r}", flush=True)
                        write(False)
    write(True)
    print(markdown(summarise(rows), header), flush=True)
    if errors:
        print(f"{len(errors)} runs failed or were skipped (see errors in the JSON)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
