"""The measured-residual correction of the target cost fit, and tuning for a context length."""

from __future__ import annotations

import dataclasses
import math

import pytest

from spectune.errors import TableError
from spectune.runtime.costs import CostModel, TargetResiduals, consistent_rows
from spectune.runtime.costs import target_ms as fit_ms
from spectune.runtime.planner import step_ms
from spectune.runtime.table import CostModelParams, DrafterCost, OverheadCost, Point, TargetCost

TARGET = TargetCost(weight_ms=6.0, token_ms=0.02, knee_tokens=256.0, compute_ms=0.01, kv_ms_per_mtok=30.0)
PARAMS = CostModelParams(TARGET, DrafterCost(0.0, 0.5, 0.0), OverheadCost(0.01, 0.0))
CTX = 2048


def grid(wobble) -> list[Point]:
    """Target points on a batch x q grid whose time is the fit times ``wobble(b, q)``."""
    pts = []
    for b in (1, 4, 16, 64):
        for q in (1, 2, 4, 8):
            n = b * q
            pts.append(Point("target", b, n, fit_ms(TARGET, n, b, CTX) * wobble(b, q), q=q))
    return pts


def test_residuals_are_exact_on_the_grid_and_interpolate_between():
    wob = {1: 1.0, 2: 1.04, 4: 1.01, 8: 1.06}  # q 4 a little faster than q 2: within the noise
    pts = grid(lambda b, q: wob[q] * (1.01 if b == 16 else 1.0))
    res = TargetResiduals.from_points(TARGET, pts, CTX)
    assert res is not None
    model = CostModel(PARAMS, "autoregressive", CTX, res)
    for p in pts:
        assert model.target_ms(p.tokens, p.batch) == pytest.approx(p.ms, rel=1e-9)
    # between q 2 and 4 at batch 4: geometric mean of the two ratios at the log midpoint
    mid = model.target_ms(4 * math.sqrt(8), 4) / fit_ms(TARGET, 4 * math.sqrt(8), 4, CTX)
    assert mid == pytest.approx(math.sqrt(1.04 * 1.01), rel=1e-9)
    # between batch 4 and 16 (log midpoint 8) at 8 tokens: row 4 at 8 tokens (q 2: 1.04), row 16
    # below its fewest tokens (16, q 1: 1.0 x 1.01); rows are interpolated along tokens, then batch
    assert res.factor(8, 8) == pytest.approx(math.sqrt(1.04 * 1.01), rel=1e-9)
    # past the ends: the nearest row / column
    assert res.factor(10_000, 64) == pytest.approx(wob[8], rel=1e-9)
    assert res.factor(1, 0.5) == pytest.approx(1.0, rel=1e-9)


def test_residuals_need_rows_of_three_points_and_skip_held_out_and_infeasible():
    pts = grid(lambda b, q: 1.0)
    pts += [Point("target", 3, 6, 99.0, q=2), Point("target", 4, 12, 99.0, q=3, held_out=True),
            Point("target", 4, 64, None, q=16), Point("drafter", 4, 4, 99.0, k=1)]
    res = TargetResiduals.from_points(TARGET, pts, CTX)
    assert res is not None and len(res.rows) == 4  # batch 3 has one point: no row
    assert res.factor(12, 4) == pytest.approx(1.0)
    assert TargetResiduals.from_points(TARGET, pts[:2], CTX) is None


def test_a_noise_spike_is_left_out_and_the_row_kept():
    # batch 16: the plain step measured 4x slow (a preempted CPU), slower than 16 x 2 tokens
    pts = grid(lambda b, q: 4.2 if (b, q) == (16, 1) else 1.0)
    grid_rows, notes = consistent_rows(TARGET, pts, CTX)
    assert dict(grid_rows)[16].keys() == {32, 64, 128}
    assert len(notes) == 1 and notes[0].startswith("batch 16: left out") and "16 tokens" in notes[0]
    model = CostModel(PARAMS, "autoregressive", CTX, TargetResiduals.from_points(TARGET, pts, CTX))
    assert model.target_ms(16, 16) == pytest.approx(fit_ms(TARGET, 16, 16, CTX), rel=1e-9)


def test_a_row_left_with_too_few_consistent_points_is_refused():
    # batch 4: times fall with tokens at every step, far beyond noise
    pts = grid(lambda b, q: {1: 4.0, 2: 2.0, 4: 1.0, 8: 0.5}[q] if b == 4 else 1.0)
    grid_rows, notes = consistent_rows(TARGET, pts, CTX)
    assert 4 not in dict(grid_rows) and {1, 16, 64} <= dict(grid_rows).keys()
    assert any(n.startswith("batch 4: row refused") for n in notes)


@pytest.mark.parametrize("b", [1, 3, 4, 16, 40, 64, 100])
def test_a_corrected_step_never_beats_plain_decoding_of_its_batch(b):
    # residuals that make more tokens look cheaper than plain (within the noise, so kept)
    pts = grid(lambda bb, q: {1: 1.1, 2: 0.97, 4: 0.96, 8: 1.0}[q])
    model = CostModel(PARAMS, "autoregressive", CTX, TargetResiduals.from_points(TARGET, pts, CTX))
    plain = model.target_ms(b, b, verify=False)
    for n in range(b, b * 9):
        assert model.target_ms(n, b) >= plain
        assert model.target_ms(n, b, verify=False) >= plain


def test_step_time_uses_the_corrected_target():
    res = TargetResiduals.from_points(TARGET, grid(lambda b, q: 0.9), CTX)
    fit, corrected = CostModel(PARAMS, "autoregressive", CTX), CostModel(PARAMS, "autoregressive", CTX, res)
    drafter = fit.drafter_ms(4, 3)
    assert step_ms(corrected, 4, 3, 16) - drafter - fit.overhead_ms(16) == pytest.approx(
        0.9 * (step_ms(fit, 4, 3, 16) - drafter - fit.overhead_ms(16)))


def test_tune_for_a_shorter_context_records_it_and_the_planner_uses_it(tmp_path):
    from spectune.autotune.tune_pipeline import tune
    from spectune.runtime.planner import Planner
    from spectune.runtime.table import read_table, write_table
    from tests.tables import make_params, make_profile, make_workload

    profile = make_profile(make_params((6.0, 0.02, 64.0, 0.05, 30.0), (0.0, 0.5, 0.0), (0.01, 0.0)),
                           make_workload(3, 8))
    res = tune(profile, "curve:0.8,0.6,0.45", trials=3, context_len=64)
    assert res.table.policy is not None and res.table.policy.context_len == 64
    path = tmp_path / "p.yaml"
    write_table(res.table, path)
    back = read_table(path)
    assert back.policy is not None and back.policy.context_len == 64
    assert Planner(back).cost.context_len == 64 and back.workload.context_len == profile.workload.context_len
    plain = tune(profile, "curve:0.8,0.6,0.45", trials=3)
    assert plain.table.policy is not None and plain.table.policy.context_len is None
    assert Planner(plain.table).cost.context_len == profile.workload.context_len
    bad = dataclasses.replace(res.table.policy, context_len=0)
    from spectune.errors import TableError
    with pytest.raises(TableError, match="context_len"):
        bad.validate("policy")


def test_past_the_knee_a_partial_tile_costs_a_whole_one():
    tiled = TargetCost(weight_ms=6.0, token_ms=0.02, knee_tokens=256.0, compute_ms=0.01, kv_ms_per_mtok=30.0,
                       tile_tokens=64)
    assert fit_ms(tiled, 290, 29, 2048) == pytest.approx(fit_ms(tiled, 320, 29, 2048) - 0.02 * 30)
    assert fit_ms(tiled, 257, 29, 2048) > fit_ms(TARGET, 257, 29, 2048) + 0.01 * 62
    # below the knee the weight read dominates: tiles change nothing
    assert fit_ms(tiled, 100, 10, 2048) == pytest.approx(fit_ms(TARGET, 100, 10, 2048))
    with pytest.raises(TableError, match="tile_tokens"):
        TargetCost(6.0, 0.02, 256.0, 0.01, 30.0, tile_tokens=0).validate("costs.model.target")


def test_scaled_params_scale_the_time_of_each_part_alone():
    """``CostModelParams.scaled``: the weight read, the target's per-token / KV terms, the drafter
    and the overhead each scale their own part of a step's time, and only theirs."""
    params = CostModelParams(TARGET, DrafterCost(0.2, 0.5, 0.003, kv_ms_per_mtok=2.0, compute_ms=0.001, knee_tokens=64.0),
                             OverheadCost(0.05, 0.0002, source="x"))
    model = CostModel(params, "autoregressive", CTX)
    assert params.scaled() == params
    b, k, n = 16, 4, 80

    def parts(p: CostModelParams) -> tuple[float, float, float]:
        m = CostModel(p, "autoregressive", CTX)
        return m.target_ms(n, b), m.drafter_ms(b, k), m.overhead_ms(n)

    t0, d0, o0 = parts(params)
    t, d, o = parts(params.scaled(drafter=1.4))
    assert (t, o) == (t0, o0) and d == pytest.approx(1.4 * d0, rel=1e-12)
    t, d, o = parts(params.scaled(weight=1.2, token=1.2))
    assert (d, o) == (d0, o0) and t == pytest.approx(1.2 * t0, rel=1e-12)
    t, d, o = parts(params.scaled(overhead=0.5))
    assert (t, d) == (t0, d0) and o == pytest.approx(0.5 * o0, rel=1e-12)
    w = params.scaled(weight=2.0)  # the weight read alone: the step's other target terms stay
    assert CostModel(w, "autoregressive", CTX).target_ms(n, b) - model.target_ms(n, b) == pytest.approx(TARGET.weight_ms)
    assert w.target.knee_tokens == TARGET.knee_tokens and w.drafter.knee_tokens == 64.0
    assert w.overhead.source == "x"
