"""What the two states of batch 1 are worth on the recorded traces alone (CPU, no planner).

Each shipped trace set's requests are replayed token by token at batch 1 (their first
``--tokens`` output tokens, as the bench's 64-token requests play them): a step of K drafts at
output index n accepts min(runs[n], K) and moves on by that + 1. Steps are timed by a policy
table's cost model at batch 1. Printed against plain decoding: the best fixed K, and the best
rule "K after a hit (the newest known step drafted and its first draft was accepted), plain
otherwise, K = 1 after m known plain steps in a row" over K and m, where the host knows every
step before the one it plans (``late`` 0) or all but the last (``late`` 1: an engine's host that
runs a step ahead of the counters it has read). A bound on what ``Planner._burst_plan`` can
find, not what it finds (it learns the two states' rates and keeps its own choice after a miss).

    PYTHONPATH=. python benchmarks/trace_two_states.py --out two_states.json   # ~1 min
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

from spectune.autotune.acceptance_sources import load_traces
from spectune.io import atomic_write_text
from spectune.runtime.planner import load, smallest_tier, step_ms

TABLE = "spectune/profiles/nvidia-h100_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml"
TRACES = ("mtbench-ngram", "humaneval-ngram", "mtbench-suffix", "humaneval-suffix")
Rule = Callable[[Sequence[tuple[int, int]]], int]  # known (K, accepted) per step -> K


def goodput(runs: Sequence[Sequence[int]], ms: dict[int, float], rule: Rule, tokens: int, late: int) -> float:
    """Tokens per ms of ``rule`` over the requests' first ``tokens`` output tokens."""
    out = time = 0.0
    for run in runs:
        n, steps = 0, []
        while n < min(len(run), tokens):
            k = rule(steps[: len(steps) - late] if late else steps)
            a = min(int(run[n]), k)
            steps.append((k, a))
            out, time, n = out + a + 1, time + ms[k], n + a + 1
    return out / time


def two_states(hi: int, every: int) -> Rule:
    def rule(known: Sequence[tuple[int, int]]) -> int:
        if known and known[-1][0] and known[-1][1] >= 1:
            return hi
        plain = 0
        while plain < len(known) and known[-1 - plain][0] == 0:
            plain += 1
        return 1 if plain >= every or not known else 0
    return rule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default=TABLE)
    ap.add_argument("--tokens", type=int, default=63)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    planner = load(a.table, on_gpu_mismatch="ignore")
    ms = {k: step_ms(planner.cost, 1, k, smallest_tier(planner.tiers, 1 + k)) for k in range(8)}
    rows = []
    print(f"{'traces':18s} {'best fixed K':>14s} {'two states, late 0':>22s} {'late 1':>16s}")
    for name in TRACES:
        runs = [r.runs for r in load_traces(f"spectune/data/traces/{name}.jsonl.gz", max_k=15).replay]
        plain = goodput(runs, ms, lambda _: 0, a.tokens, 0)
        fixed = max((goodput(runs, ms, lambda _, k=k: k, a.tokens, 0) / plain, k) for k in range(1, 8))
        best = {}
        for late in (0, 1):
            best[late] = max((goodput(runs, ms, two_states(hi, m), a.tokens, late) / plain, hi, m)
                             for hi in (2, 3, 4, 6) for m in (2, 4, 8, 16))
        rows.append({"traces": name, "best_fixed": fixed[0], "best_fixed_k": fixed[1],
                     **{f"two_states_late{late}": {"x_plain": g, "k": hi, "every": m} for late, (g, hi, m) in best.items()}})
        print(f"{name:18s} {fixed[0]:9.3f} (K {fixed[1]}) {best[0][0]:11.3f} (K {best[0][1]}, m {best[0][2]:2d}) "
              f"{best[1][0]:7.3f} (K {best[1][1]}, m {best[1][2]:2d})")
    if a.out:
        atomic_write_text(a.out, json.dumps({"table": a.table, "tokens": a.tokens, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
