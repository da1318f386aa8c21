import warnings

import pytest

from spectune.errors import TableError
from spectune.runtime.planner import Plan, Planner, PolicyMismatch, PolicyMismatchWarning, load
from spectune.runtime.table import Row, write_table
from tests.tables import make_params, make_policy, make_profile, make_workload

TIERS = [4, 8, 16, 32, 64]


def make_table(rows=None, tiers=TIERS, policy=True, **online):  # online: Online fields over the defaults
    params = make_params((5.0, 0.01, 512, 0.0, 20.0), (0.0, 0.4, 0.001), (0.05, 0.0))
    rows = rows or [
        Row((1, 4), 4, 4, tier=8, budget_mode="fill-tier"),  # budget(b) = min(4b, 8 - b)
        Row((5, 8), 2, 12),  # fixed: min(2b, 12)
        Row((9, 16), 0, 0),
    ]
    online = dict(ema=0.3, hysteresis=0.05, min_k=1, max_k=6, prior=[0.8] * 6) | online
    return make_profile(params, make_workload(6, 16, target="t", context_len=1024), hardware="NVIDIA H200",
                        policy=make_policy(tiers, rows, **online) if policy else None)


@pytest.mark.parametrize("b, expect", [
    (1, Plan(4, 4, 8)), (3, Plan(4, 5, 8)), (4, Plan(4, 4, 8)),
    (5, Plan(2, 10, 16)), (6, Plan(2, 12, 32)), (8, Plan(2, 12, 32)),
    (9, Plan(0, 0, 16)), (16, Plan(0, 0, 16)), (17, Plan(0, 0, 32)),
])
def test_lookup_at_range_edges(b, expect):
    assert Planner(make_table()).plan(b) == expect


def test_beyond_max_batch_is_clamped_and_counted():
    p = Planner(make_table())
    assert p.plan(40) == Plan(0, 0, 64)
    assert p.plan(65) == Plan(0, 0, None)  # no captured graph holds it: eager
    assert p.clamped == 2 and p.uncaptured == 1
    with pytest.raises(ValueError, match="batch_size"):
        p.plan(0)


def test_load_and_gpu_mismatch(tmp_path):
    path = tmp_path / "policy.yaml"
    write_table(make_table(), path)
    assert load(path, gpu_name="NVIDIA H200").plan(2).k == 4
    with pytest.warns(PolicyMismatchWarning, match="hardware.gpu"):
        load(path, gpu_name="NVIDIA A100")
    with pytest.raises(PolicyMismatch, match="hardware.gpu"):
        load(path, on_gpu_mismatch="refuse", gpu_name="NVIDIA A100")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(path, on_gpu_mismatch="ignore", gpu_name="NVIDIA A100")


def test_profile_without_policy_is_refused(tmp_path):
    path = tmp_path / "profile.yaml"
    write_table(make_table(policy=False), path)
    with pytest.raises(TableError, match="policy"):
        load(path)


def step(p: Planner, b: int, rate: float, n: int) -> Plan:
    plan = p.plan(b)
    for _ in range(n):
        plan = p.plan(b)
        k = plan.k
        offered = [float(b)] * k
        accepted = [rate * b] * k
        p.observe(accepted, offered)
    return p.plan(b)


def test_observe_lowers_k_on_collapse_and_recovers():
    table = make_table(rows=[Row((1, 8), 4, 32), Row((9, 16), 0, 0)],
                       tiers=[2, 4, 8, 16, 24, 32, 40],
                       min_evidence=16)
    p = Planner(table)
    assert p.plan(8).k == 4
    low = step(p, 8, 0.1, 60)
    assert 1 <= low.k < 4
    high = step(p, 8, 0.95, 200)
    assert high.k >= 4
    # never a shape without a captured tier: 8 + budget <= 40
    assert high.tier is not None and 8 + high.verify_budget <= high.tier <= 40
    assert p.plan(12).k == 0  # plain rows are never corrected


def test_observe_respects_captured_tiers():
    table = make_table(rows=[Row((1, 8), 2, 16), Row((9, 16), 0, 0)], tiers=[8, 16, 24])
    p = Planner(table)
    plan = step(p, 8, 1.0, 100)
    assert 8 + plan.verify_budget <= 24 and plan.k <= 2


def test_too_little_evidence_keeps_the_table_k():
    # one request's counters (b = 1, ema 0.05: ~20 tested first drafts) never move K
    table = make_table(rows=[Row((1, 8), 4, 32), Row((9, 16), 0, 0)], tiers=[2, 4, 8, 16, 24, 32, 40],
                       ema=0.05, min_evidence=64)
    p = Planner(table)
    assert step(p, 1, 0.05, 300).k == 4 and p.evidence < 64 and p.drift < 0.2
    assert step(p, 8, 0.05, 300).k < 4 and p.evidence >= 64


def test_stationary_counters_keep_the_table_k():
    p = Planner(make_table(rows=[Row((1, 8), 4, 32), Row((9, 16), 0, 0)], tiers=[2, 4, 8, 16, 24, 32, 40],
                           ema=0.1, hysteresis=0.1, min_evidence=16))
    assert step(p, 8, 0.8, 200).k == 4 and p.drift == pytest.approx(1.0)
