"""Drafter confidences on held-out prompts, and verify-budget allocation replayed from real traces.

For each trace set (default: the suffix drafter's MT-Bench and HumanEval sets) the requests are
split as recorded (prompt i in file order -> split i % 2: even = calibration, odd = held-out):

1. per-position acceptance P(draft j accepted | drafts < j accepted, j offered), both splits;
2. calibration: tables fitted on the calibration split (``acceptance_sources.calibrate``; one
   over all positions, and one per draft position), reliability and ECE on the held-out split,
   raw and through the tables;
3. acceptance only (no costs), held-out requests replayed at concurrency 1, 16, 64, 128
   (``autotune.allocation_replay``): fixed K5, fixed K7, and max K 7 with a verify budget of
   5 drafts per request allocated by (a) confidences through the per-position tables, (b) per-request history from
   the calibration split's population rates, (c) uniform water filling. 95% intervals: bootstrap
   over held-out prompts (resampled with replacement, paired across policies).

    python benchmarks/drafter_acceptance.py [--traces A.jsonl.gz ...] [--boot 200]

With ``--refs`` (the recorder's --ref-cache), ``--gguf`` and the prompt files it also re-runs the
suffix drafter over the recorded greedy outputs: at K7 this must give the recorded steps, at K5 it
gives the exact concurrency-1 K5 figure that the replay approximates with cut K7 steps.

Prints markdown tables and writes benchmarks/results/drafter_acceptance.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from spectune.autotune.acceptance_sources import position_tables
from spectune.autotune.allocation_replay import ReplayResult, population_rates, replay
from spectune.autotune.confidence import ece, reliability, verified_samples
from spectune.io import atomic_write_text
from spectune.models.specdecode import read_traces
from spectune.models.suffix_drafter import SuffixDrafter
from spectune.models.trace_steps import RequestSteps, request_steps, split

ROOT = Path(__file__).resolve().parents[1]
TRACES = [ROOT / "spectune" / "data" / "traces" / f"{d}-suffix.jsonl.gz" for d in ("mtbench", "humaneval")]
K = 7
CONCURRENCY = (1, 16, 64, 128)
BUDGET = 5.0  # verify budget per request of the adaptive policies
POLICIES = ("K5", "K7", "confidence", "history", "uniform")


def per_position(reqs: list[RequestSteps]) -> list[float | None]:
    out: list[float | None] = []
    for j in range(K):
        reached = sum(int(r.known[:, j].sum()) for r in reqs)
        right = sum(int((r.known[:, j] & r.right[:, j]).sum()) for r in reqs)
        out.append(round(right / reached, 4) if reached else None)
    return out


def run_policies(reqs: list[RequestSteps], b: int, tables: Any, rates: np.ndarray, seed: int) -> dict[str, ReplayResult]:
    rounds = max(1, math.ceil(2 * b / len(reqs)))  # enough requests to keep the batch full
    common = {"concurrency": b, "rounds": rounds, "seed": seed}
    return {
        "K5": replay(reqs, policy="fixed", k=5, **common),
        "K7": replay(reqs, policy="fixed", k=K, **common),
        "confidence": replay(reqs, policy="confidence", k=K, per_request=BUDGET, position_calibration=tables,
                             **common),
        "history": replay(reqs, policy="history", k=K, per_request=BUDGET, rates=rates, **common),
        "uniform": replay(reqs, policy="uniform", k=K, per_request=BUDGET, **common),
    }


def interval(values: list[float]) -> list[float]:
    return [round(float(np.percentile(values, 2.5)), 4), round(float(np.percentile(values, 97.5)), 4)]


def analyse(path: Path, boot: int, seed: int) -> dict[str, Any]:
    reqs = request_steps(read_traces(path), K)
    calib, held = split(reqs)
    table, by_pos = position_tables(calib, K)
    h_conf, h_ok, h_pos = verified_samples(held)
    one_conf, _, _ = verified_samples(held, table=table)
    t_conf, _, _ = verified_samples(held, position_tables=by_pos)
    rates = population_rates(calib, K)
    out: dict[str, Any] = {
        "file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "requests": {"calibration": len(calib), "held_out": len(held)},
        "steps": {"calibration": int(sum(len(r.offered) for r in calib)), "held_out": int(sum(len(r.offered) for r in held))},
        "per_position": {"calibration": per_position(calib), "held_out": per_position(held)},
        "calibration_table": [list(row) for row in table] if table else None,
        "calibration_tables_by_position": [[list(row) for row in t] if t else None for t in by_pos],
        "population_rates": [round(float(x), 4) for x in rates],
        "ece_held_out": {"raw": round(ece(h_conf, h_ok), 4), "one_table": round(ece(one_conf, h_ok), 4),
                         "calibrated": round(ece(t_conf, h_ok), 4)},
        "reliability_held_out": {
            name: [vars(r) for r in reliability(c, h_ok)] for name, c in (("raw", h_conf), ("calibrated", t_conf))
        },
        "ece_held_out_by_position": {
            str(j): round(ece(t_conf[h_pos == j], h_ok[h_pos == j]), 4) for j in range(1, K + 1) if (h_pos == j).any()
        },
        "replay": {},
    }
    rng = np.random.default_rng(seed)
    for b in CONCURRENCY:
        point = run_policies(held, b, by_pos, rates, seed)
        draws: dict[str, list[float]] = {p: [] for p in POLICIES}
        ratios: dict[str, list[float]] = {p: [] for p in POLICIES}
        for _ in range(boot):
            sample = [held[i] for i in rng.integers(0, len(held), len(held))]
            got = run_policies(sample, b, by_pos, rates, seed)
            for p in POLICIES:
                draws[p].append(got[p].mean_accept_len)
                ratios[p].append(got[p].mean_accept_len / got["K5"].mean_accept_len)
        out["replay"][str(b)] = {
            p: {"mean_accept_len": round(point[p].mean_accept_len, 4), "ci95": interval(draws[p]),
                "vs_K5": round(point[p].mean_accept_len / point["K5"].mean_accept_len, 4),
                "vs_K5_ci95": interval(ratios[p]), "drafts_verified_per_request_step": round(point[p].granted_per_step, 3)}
            for p in POLICIES
        }
    return out


def markdown(name: str, r: dict[str, Any]) -> str:
    pos = " | ".join("-" if x is None else f"{x:.3f}" for x in r["per_position"]["held_out"])
    posc = " | ".join("-" if x is None else f"{x:.3f}" for x in r["per_position"]["calibration"])
    lines = [f"### {name}: {r['requests']['calibration']} calibration / {r['requests']['held_out']} held-out prompts, "
             f"{r['steps']['calibration']} / {r['steps']['held_out']} steps", "",
             "Conditional acceptance at draft position j: P(draft j right | drafts 1..j-1 right, j offered)", "",
             "| split | " + " | ".join(f"pos {j}" for j in range(1, K + 1)) + " |",
             "|---|" + "---|" * K, f"| calibration | {posc} |", f"| held-out | {pos} |", "",
             f"ECE on held-out: raw {r['ece_held_out']['raw']:.3f}, one calibration table "
             f"{r['ece_held_out']['one_table']:.3f}, a table per position {r['ece_held_out']['calibrated']:.3f}", "",
             "| conf bin | drafts (raw) | mean conf (raw) | accepted (raw) | drafts (cal.) | mean conf (cal.) | accepted (cal.) |",
             "|---|---|---|---|---|---|---|"]
    raw = {(round(x["lo"], 1)): x for x in r["reliability_held_out"]["raw"]}
    cal = {(round(x["lo"], 1)): x for x in r["reliability_held_out"]["calibrated"]}
    for lo in sorted(set(raw) | set(cal)):
        cells = []
        for d in (raw, cal):
            x = d.get(lo)
            cells += [str(x["count"]), f"{x['mean_conf']:.3f}", f"{x['accept_rate']:.3f}"] if x else ["0", "-", "-"]
        lines.append(f"| {lo:.1f}-{lo + 0.1:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "| concurrency | K5 | K7 | adaptive, confidence | adaptive, history | adaptive, uniform |",
              "|---|---|---|---|---|---|"]
    for b, row in r["replay"].items():
        cells = []
        for p in POLICIES:
            x = row[p]
            lo, hi = x["ci95"]
            cell = f"{x['mean_accept_len']:.3f} [{lo:.3f}, {hi:.3f}]"
            if p != "K5":
                rlo, rhi = x["vs_K5_ci95"]
                cell += f" ({(x['vs_K5'] - 1) * 100:+.1f}% [{(rlo - 1) * 100:+.1f}, {(rhi - 1) * 100:+.1f}])"
            cells.append(cell)
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    drafts = " / ".join(f"{row[p]['drafts_verified_per_request_step']:.2f}" for p in POLICIES
                        for row in [r["replay"][str(CONCURRENCY[-1])]])
    lines += ["", f"Drafts verified per request-step at concurrency {CONCURRENCY[-1]} ({' / '.join(POLICIES)}): {drafts}"]
    return "\n".join(lines)


def rerun(prompts: list[tuple[str, list[int]]], outputs: dict[str, list[int]], k: int) -> dict[str, list[int]]:
    """Accepted drafts per step of the suffix drafter re-run over the recorded greedy outputs at
    draft length ``k``, splits and order as recorded (the target's greedy tokens are the output)."""
    drafters = [SuffixDrafter(), SuffixDrafter()]
    steps: dict[str, list[int]] = {}
    for index, (request, ids) in enumerate(prompts):
        if request not in outputs:
            continue
        d, out, at = drafters[index % 2], outputs[request], 0
        d.rollback(0)
        steps[request] = []
        while at < len(out):
            draft = d.propose(ids + out[:at], k).tokens
            a = next((j for j, t in enumerate(draft) if at + j >= len(out) or out[at + j] != t), len(draft))
            steps[request].append(a)
            at += a + 1
        d.remember(out)
    return steps


def exact_check(name: str, r: dict[str, Any], records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Re-run the drafter at K7 (must give the recorded steps) and K5 (the exact K5 figure the
    replay approximates) at concurrency 1 on the held-out prompts."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from record_traces import load_prompts
    from transformers import AutoTokenizer

    dataset = name.split("-")[0]
    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = load_prompts(dataset, Path(getattr(args, dataset)), tok)
    recorded = {req.request: req for req in request_steps(records, K)}
    outputs = {}
    for request, _ in prompts:
        f = Path(args.refs) / f"{request}-{args.max_new_tokens}.json"
        if request in recorded and f.exists():
            outputs[request] = json.loads(f.read_text())
    k7, k5 = rerun(prompts, outputs, K), rerun(prompts, outputs, 5)
    held = {req.request for req in split(list(recorded.values()))[1]} & set(outputs)
    # the last step of a request may verify past the recorded output (the target's tokens there are
    # unknown): compare every other step
    same = sum(int(a == b) for q in recorded if q in k7 for a, b in zip(recorded[q].accepted[:-1], k7[q][:-1], strict=False))
    total = sum(min(len(recorded[q].accepted), len(k7[q])) - 1 for q in recorded if q in k7)
    exact5 = [a for q in held for a in k5[q]]
    replay5 = [min(int(a), 5) for q in held for a in recorded[q].accepted]
    return {"k7_steps_equal_recorded": [same, total],
            "k5_c1_exact_mean_accept_len": round(1 + float(np.mean(exact5)), 4),
            "k5_c1_replayed_mean_accept_len": round(1 + float(np.mean(replay5)), 4),
            "held_out_prompts": len(held)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", nargs="+", default=[str(t) for t in TRACES])
    p.add_argument("--boot", type=int, default=200, help="bootstrap resamples of the held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "drafter_acceptance.json"))
    p.add_argument("--gguf", default=None, help="with --refs: re-run the drafter exactly (tokenizer from this file)")
    p.add_argument("--refs", default=None, help="record_traces --ref-cache folder (greedy outputs)")
    p.add_argument("--mtbench", default=None, help="MT-Bench question.jsonl (with --refs)")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl.gz (with --refs)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="of the recorded outputs in --refs")
    args = p.parse_args(argv)
    results = {}
    for t in args.traces:
        path = Path(t)
        name = path.name.removesuffix(".jsonl.gz")
        results[name] = analyse(path, args.boot, args.seed)
        if args.refs and args.gguf:
            results[name]["exact_rerun"] = exact_check(name, results[name], read_traces(path), args)
            print(name, "exact re-run:", results[name]["exact_rerun"])
        print(markdown(name, results[name]), "\n", flush=True)
    meta = {"k": K, "budget_per_request": BUDGET, "concurrency": list(CONCURRENCY), "boot": args.boot,
            "seed": args.seed, "split": "prompt i (file order) -> calibration if i is even, held-out if odd"}
    atomic_write_text(Path(args.out), json.dumps({"meta": meta, "traces": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
