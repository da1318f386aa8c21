"""Held-out evaluation: the shipped H200 policy, tuned on one acceptance source, served (in the
simulator) on others -- the real trace sets, a high and a low curve, a shift from one to the other
half-way, a two-class mixture -- at concurrency 1..256, against plain decoding and every fixed K
1..7 (``spectune.autotune.whatif.compare_open``, also ``benchmarks/sim_heldout.py``). Never judge a
policy only on the acceptance it was tuned on."""

from __future__ import annotations

from pathlib import Path

import pytest

from spectune.autotune.whatif import compare_open, heldout_sources
from spectune.runtime.table import read_table

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "spectune" / "profiles" / "nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml"
PUBLIC = "public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench"
SERVED = {n: v for n, v in heldout_sources().items() if n != "extreme-mixture"}  # extreme: docs/BENCHMARKS.md
CONCURRENCY = (1, 16, 64, 256)
# auto / the best of plain and fixed K 1..7, at every (source, concurrency). At batch 1 the
# estimate's window holds a handful of requests, and on a two-class mixture the controller moves
# with them; elsewhere >= 0.98 holds with room.
FLOOR, FLOOR_BATCH1 = 0.98, 0.97


@pytest.fixture(scope="module")
def table():
    return read_table(POLICY)


def test_the_served_sources_cover_every_shipped_trace_set():
    traces = sorted(p.name.split(".")[0] for p in (ROOT / "spectune" / "data" / "traces").glob("*.jsonl.gz"))
    assert traces and set(traces) <= set(SERVED)
    assert SERVED["drift"][1] is not None and SERVED["high-0.9"][1] is None


@pytest.mark.slow
@pytest.mark.parametrize("source", list(SERVED))
def test_policy_holds_on_traffic_it_was_not_tuned_on(table, source):
    assert "public:EAGLE-3" in table.acceptance["source"]  # tuned on the public curve, not on these
    acc, drift = SERVED[source]
    rows = compare_open(table, acc, CONCURRENCY, drift=drift)
    for r in rows:
        floor = FLOOR_BATCH1 if r["concurrency"] == 1 else FLOOR
        assert r["auto_over_best"] >= floor, f"{source} c={r['concurrency']}: auto = {r['auto_over_best']:.3f} x {r['best_other']}"
        assert r["auto_over_plain"] >= 0.99, f"{source} c={r['concurrency']}: auto below plain"
    if drift is None:  # not vacuous: on stationary traffic auto cannot beat the best arm by much (on a
        # drift it can: no single fixed K fits both halves, and the controller follows the shift)
        assert min(r["auto_over_best"] for r in rows) <= 1.05


@pytest.mark.slow
def test_policy_matches_the_best_fixed_k_on_its_tuned_acceptance(table):
    for r in compare_open(table, PUBLIC, CONCURRENCY, seeds=(0, 1)):
        assert r["auto_over_best"] >= 0.985, f"c={r['concurrency']}: {r['auto_over_best']:.3f} x {r['best_other']}"
