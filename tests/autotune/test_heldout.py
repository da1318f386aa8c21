"""Held-out evaluation: the shipped H200 policy, tuned on one acceptance source, served (in the
simulator) on others -- the real trace sets, a high and a low curve, a shift from one to the other
half-way, a two-class mixture -- at
concurrency 1..256, against plain decoding and every fixed K 1..7. Never judge a policy only on
the acceptance it was tuned on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spectune.autotune.acceptance import load_acceptance
from spectune.autotune.simulator import FixedK, simulate
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Planner
from spectune.runtime.table import read_table

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "spectune" / "profiles" / "nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml"
TRACES = ROOT / "spectune" / "data" / "traces"


def curve(f) -> str:
    return ",".join(f"{f(i):.6f}" for i in range(1, 16))


SERVED = {
    **{path.name.split(".")[0]: str(path) for path in sorted(TRACES.glob("*.jsonl.gz"))},  # every shipped trace set
    "high-0.9": "curve:" + curve(lambda i: 0.9 ** i),
    "low-0.55": "curve:" + curve(lambda i: 0.55 ** i),
    "drift": "curve:" + curve(lambda i: 0.9 ** i) + " then curve:" + curve(lambda i: 0.55 ** i),
    "two-class": f"mixture:0.5*curve({curve(lambda i: 0.85 ** i)})+0.5*curve({curve(lambda i: 0.5 ** i)})",
}
CONCURRENCY = (1, 16, 64, 256)
# auto / the best of plain and fixed K 1..7, at every (source, concurrency). At batch 1 the
# estimate's window holds a handful of requests, and on a two-class mixture the controller moves
# with them (measured 0.980 there, 2 seeds x 4000 steps); elsewhere >= 0.98 holds with room.
FLOOR, FLOOR_BATCH1 = 0.98, 0.97


@pytest.fixture(scope="module")
def table():
    return read_table(POLICY)


def goodput(cost, acc, make_fn, c, ctx, seeds=(0, 1), drift=None):
    """Geometric mean over seeds (common random numbers across arms); batch 1 runs longer so
    that as many requests finish as at larger batches."""
    steps = 4000 if c == 1 else 1200
    logs = [math.log(simulate(cost, acc, make_fn(), concurrency=c, steps=steps, seed=s, context_len=ctx,
                              mean_output_tokens=128.0, drift=drift).goodput_tok_s) for s in seeds]
    return math.exp(sum(logs) / len(logs))


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SERVED))
def test_policy_holds_on_traffic_it_was_not_tuned_on(table, source):
    assert "public:EAGLE-3" in table.acceptance["source"]  # tuned on the public curve, not on these
    cost = CostModel.of(table)
    ctx = table.policy.context_len
    first, _, second = SERVED[source].partition(" then ")  # drift: the second half of arrivals
    acc = load_acceptance(first, max_k=table.workload.max_k)
    drift = load_acceptance(second, max_k=table.workload.max_k) if second else None
    worst = math.inf
    for c in CONCURRENCY:
        arms = {k: goodput(cost, acc, lambda k=k: FixedK(k), c, ctx, drift=drift) for k in range(8)}
        auto = goodput(cost, acc, lambda: Planner(table), c, ctx, drift=drift)  # a fresh planner per run
        best_k = max(arms, key=arms.__getitem__)
        ratio = auto / arms[best_k]
        worst = min(worst, ratio)
        floor = FLOOR_BATCH1 if c == 1 else FLOOR
        assert ratio >= floor, f"{source} c={c}: auto {auto:.0f} tok/s = {ratio:.3f} x fixed:{best_k}"
        assert auto >= 0.99 * arms[0], f"{source} c={c}: auto below plain"
    assert worst <= 1.05  # the comparison is not vacuous: auto cannot beat the best arm by much


@pytest.mark.slow
def test_policy_matches_the_best_fixed_k_on_its_tuned_acceptance(table):
    cost = CostModel.of(table)
    acc = load_acceptance("public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench", max_k=table.workload.max_k)
    for c in CONCURRENCY:
        best = max(goodput(cost, acc, lambda k=k: FixedK(k), c, table.policy.context_len) for k in range(8))
        assert goodput(cost, acc, lambda: Planner(table), c, table.policy.context_len) >= 0.985 * best
