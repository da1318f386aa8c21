"""K schedule smoothing (search.smooth_choices) and row building (search.rows_from_choices)."""

import numpy as np
import pytest

from spectune.autotune.policy_search import (
    OperatingGrid,
    candidate_values,
    choose,
    room_tiers,
    rows_from_choices,
    search_policy,
    smooth_choices,
    tier_universe,
)
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Planner
from tests.autotune.test_policy_search import ACC, CAPTURE, KNEE, SMALL, _profile


def hand_grid(per_batch: list[dict[int, float]]) -> OperatingGrid:
    """One candidate per (b, K) with goodput ``tok_s`` [tokens/ms]: tokens = tok_s, ms = 1,
    full budget b*K in an exact tier (universe = every token count)."""
    top = max(b * (max(c) + 1) for b, c in enumerate(per_batch, start=1))
    g = OperatingGrid(list(range(1, top + 1)), [], [], [], [], [], [], np.ones(len(per_batch)),
                      np.ones(len(per_batch)), np.ones(len(per_batch)), np.ones((len(per_batch), 4)))
    for b, cands in enumerate(per_batch, start=1):
        ks = sorted(cands)
        g.k.append(np.array(ks))
        g.budget.append(np.array([b * k for k in ks]))
        g.tier_idx.append(np.array([b * (k + 1) - 1 for k in ks]))
        g.tokens.append(np.array([cands[k] for k in ks], dtype=float))
        g.ms.append(np.ones(len(ks)))
        g.joules.append(np.full(len(ks), np.nan))
    return g


# b = 1..6: the optimum flips 2/3; K = 3 wins by 0.3 % at b = 3, 4 and by 4 % at b = 6
FLIPS = [{2: 100.0, 3: 90.0}, {2: 100.0, 3: 99.0}, {2: 99.7, 3: 100.0}, {2: 99.7, 3: 100.0},
         {2: 100.0, 3: 99.9}, {2: 96.0, 3: 100.0}]


def _ks(choices):
    return [c.k for c in choices]


def test_flip_within_tolerance_merges_and_beyond_stays():
    g = hand_grid(FLIPS)
    mask = np.ones(len(g.universe), bool)
    raw = choose(g, mask)
    assert _ks(raw) == [2, 2, 3, 3, 2, 3]
    smooth, loss = smooth_choices(g, mask, raw, 0.005)
    assert _ks(smooth) == [2, 2, 2, 2, 2, 3]
    assert loss == pytest.approx(0.003)
    assert smooth[2].tok_s == pytest.approx(99.7 * 1000)  # the step of the new K, not the old one
    assert smooth_choices(g, mask, raw, 0.0) == (raw, 0.0)
    assert _ks(smooth_choices(g, mask, raw, 0.05)[0]) == [2] * 6


def test_plain_decoding_never_becomes_speculative():
    g = hand_grid([{0: 100.0, 1: 99.9}, {0: 100.0, 1: 99.9}, {0: 99.9, 1: 100.0}])
    mask = np.ones(len(g.universe), bool)
    raw = choose(g, mask)
    assert _ks(raw) == [0, 0, 1]
    smooth, loss = smooth_choices(g, mask, raw, 0.01)
    assert _ks(smooth) == [0, 0, 0] and loss == pytest.approx(0.001)  # K > 0 -> 0 within tolerance


@pytest.mark.parametrize("tol", [0.0, 0.005, 0.03])
def test_search_smoothing_bounds_loss_and_keeps_rows_honest(tol):
    cost = CostModel(SMALL, "autoregressive", 128)
    res = search_policy(cost, ACC, max_batch=64, max_k=6, capture=CAPTURE, trials=4, seed=2, smooth=tol)
    raw = search_policy(cost, ACC, max_batch=64, max_k=6, capture=CAPTURE, trials=4, seed=2, smooth=0.0)
    assert res.smooth_loss <= tol + 1e-12
    assert raw.raw_rows == len(raw.policy.rows)  # smoothing 0 keeps the rows (counted over the same tiers)
    assert len(res.policy.rows) <= res.raw_rows
    runs = lambda ch: 1 + sum(a.k != b.k for a, b in zip(ch, ch[1:], strict=False))  # noqa: E731
    assert runs(res.choices) <= runs(raw.choices)
    for c, r in zip(res.choices, raw.choices, strict=True):
        assert c.tok_s >= (1 - tol) * r.tok_s - 1e-9
        assert r.k > 0 or c.k == 0
    planner = Planner(_profile(SMALL, 64, 6, policy=res.policy))
    for c in res.choices:  # the rows reproduce every smoothed step exactly
        p = planner.plan(c.batch)
        assert (p.k, p.verify_budget, p.tier) == (c.k, c.budget, c.tier)
    for row in res.policy.rows:  # gain recomputed from the smoothed steps
        grp = [c.gain for c in res.choices if row.batch[0] <= c.batch <= row.batch[1]]
        assert row.gain == pytest.approx(np.mean(grp), abs=1e-4)
    # the captured tiers: the rows' own, plus the room the online controller needs (room_tiers)
    used = {c.tier for c in res.choices}
    room = room_tiers(cost, ACC, max_batch=64, max_k=6, universe=tier_universe(64, 6))
    assert used <= set(res.policy.tiers) <= used | set(room)


def test_full_budget_runs_become_one_fixed_row():
    cost = CostModel(KNEE, "autoregressive", 128)
    res = search_policy(cost, ACC, max_batch=64, max_k=6, capture=CAPTURE, trials=4, seed=1)
    fixed = [r for r in res.policy.rows if r.k > 0 and r.budget_mode == "fixed"]
    assert fixed and all(r.verify_budget == r.batch[1] * r.k for r in fixed)
    assert len(res.policy.rows) <= len(rows_from_choices(res.choices))  # without tiers: (K, tier) rows only


def test_candidate_values_respect_mask_and_latency_bound():
    g = hand_grid(FLIPS)
    mask = np.ones(len(g.universe), bool)
    mask[g.tier_idx[0][1]] = False  # b = 1, K = 3 tier not captured
    v = candidate_values(g, 0, mask)
    assert v[0] == 100.0 and v[1] == 0.0
    g.ms[1] = np.array([1.0, 3.0])
    assert candidate_values(g, 1, np.ones(len(g.universe), bool), latency_bound_ms=2.0)[1] == 0.0


def test_bad_tolerance_names_the_field():
    from spectune.autotune.policy_search import SearchError

    with pytest.raises(SearchError, match="smooth"):
        search_policy(CostModel(KNEE, "autoregressive", 128), ACC, max_batch=8, max_k=6, trials=1, smooth=1.5)
