import numpy as np
import pytest

from spectune.autotune.fit import (
    FitError,
    fit_cost_model,
    fit_drafter,
    fit_overhead,
    fit_power,
    fit_target,
    held_out_error,
)
from spectune.runtime.costs import CostModel, drafter_ms, target_ms
from spectune.runtime.table import (
    CostModelParams,
    DrafterCost,
    OverheadCost,
    PowerModel,
    TargetCost,
)

CTX = 2048
TRUE = TargetCost(weight_ms=5.0, token_ms=0.002, knee_tokens=128, compute_ms=0.025, kv_ms_per_mtok=30.0)


def target_data(p: TargetCost, noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [(b * q, b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for q in (1, 2, 4, 8, 16)]
    rows += [(t, max(1, t // 2)) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)]
    n, b = (np.array(x, float) for x in zip(*rows, strict=True))
    y = np.array([target_ms(p, ni, bi, CTX) for ni, bi in zip(n, b, strict=True)])
    return n, b, y * (1 + noise * rng.standard_normal(len(y)))


@pytest.mark.parametrize("noise", [0.0, 0.005])
def test_target_roofline_recovered(noise):
    got = fit_target(*target_data(TRUE, noise), CTX)
    for name in ("weight_ms", "compute_ms", "kv_ms_per_mtok"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    assert got.knee_tokens == pytest.approx(TRUE.knee_tokens, rel=0.15)
    assert got.kv_verify_ms_per_mtok < 0.05 * TRUE.kv_ms_per_mtok


def test_target_interpolates_unseen_batch_sizes():
    got = fit_target(*target_data(TRUE, 0.005), CTX)
    for b, q in [(3, 5), (37, 3), (100, 1), (200, 7)]:
        assert target_ms(got, b * q, b, CTX) == pytest.approx(target_ms(TRUE, b * q, b, CTX), rel=0.03)


def test_target_verify_kv_term_recovered():
    true = TargetCost(5.0, 0.002, 128, 0.025, 30.0, kv_verify_ms_per_mtok=80.0)
    got = fit_target(*target_data(true, 0.0), CTX)
    assert got.kv_verify_ms_per_mtok == pytest.approx(80.0, rel=0.05)
    assert got.kv_ms_per_mtok == pytest.approx(30.0, rel=0.05)


def test_one_outlier_is_trimmed():
    n, b, y = target_data(TRUE, 0.002)
    y[7] *= 4.0  # a preempted measurement
    got = fit_target(n, b, y, CTX)
    assert got.weight_ms == pytest.approx(TRUE.weight_ms, rel=0.03)
    assert got.kv_ms_per_mtok == pytest.approx(TRUE.kv_ms_per_mtok, rel=0.05)


def _with_odd_tokens(p: TargetCost, noise: float, seed: int = 0):
    # the seed grid plus odd token counts (odd batch x odd q), as the study seeds them
    n, b, y = target_data(p, noise, seed)
    rng = np.random.default_rng(seed + 1)
    odd = [(bb * q, bb) for bb in (7, 13, 25, 49, 97, 193) for q in (3, 7)]
    n2, b2 = (np.array(x, float) for x in zip(*odd, strict=True))
    y2 = np.array([target_ms(p, ni, bi, CTX) for ni, bi in zip(n2, b2, strict=True)])
    y2 *= 1 + noise * rng.standard_normal(len(y2))
    return np.concatenate([n, n2]), np.concatenate([b, b2]), np.concatenate([y, y2])


@pytest.mark.parametrize("tile", [32, 64, 128])
def test_gemm_tile_is_chosen_from_odd_token_counts(tile):
    true = TargetCost(5.0, 0.002, 128, 0.025, 30.0, tile_tokens=tile)
    got = fit_target(*_with_odd_tokens(true, 0.003), CTX)
    assert got.tile_tokens == tile
    for bb, q in [(29, 10), (45, 5), (59, 4), (150, 3)]:  # partial tiles the fit never saw
        assert target_ms(got, bb * q, bb, CTX) == pytest.approx(target_ms(true, bb * q, bb, CTX), rel=0.02)


def test_no_tile_without_evidence():
    # a GPU without tile steps: odd token counts show none, so no tiling is chosen
    assert fit_target(*_with_odd_tokens(TRUE, 0.003), CTX).tile_tokens == 1
    # token counts all whole tiles of 128 past the knee cannot tell tiles apart: no tiling
    tiled = TargetCost(5.0, 0.002, 128, 0.025, 30.0, tile_tokens=128)
    n, b, y = target_data(tiled, 0.0)
    assert fit_target(n, b, y, CTX).tile_tokens == 1


@pytest.mark.parametrize("kind,true", [
    ("autoregressive", DrafterCost(fixed_ms=0.1, step_ms=0.4, token_ms=0.003)),
    ("parallel", DrafterCost(fixed_ms=0.6, step_ms=0.0, token_ms=0.002, kv_ms_per_mtok=5.0)),
    # the H200 DFlash drafter's shape: weight-bound to ~220 tokens, then compute bound
    ("parallel", DrafterCost(fixed_ms=0.6, step_ms=0.0, token_ms=0.0023, kv_ms_per_mtok=0.8, compute_ms=0.0015,
                             knee_tokens=220.0)),
])
def test_drafter_recovered(kind, true):
    rng = np.random.default_rng(1)
    pts = [(b, k) for b in (1, 4, 16, 64, 256) for k in (1, 3, 7, 15)]
    b, k = (np.array(x, float) for x in zip(*pts, strict=True))
    y = np.array([drafter_ms(true, kind, bi, int(ki), CTX) for bi, ki in pts]) * (1 + 0.003 * rng.standard_normal(len(pts)))
    got = fit_drafter(b, k, y, kind, CTX)
    for bi, ki in [(3, 2), (100, 9), (256, 15)]:
        assert drafter_ms(got, kind, bi, ki, CTX) == pytest.approx(drafter_ms(true, kind, bi, ki, CTX), rel=0.03)
    assert got.token_ms == pytest.approx(true.token_ms, rel=0.05)


def test_autoregressive_drafter_knee_recovered_and_never_invented():
    # the H200 qwen3-32b EAGLE drafter's shape: each draft step's b rows turn compute-bound past
    # ~126 (its lm_head GEMM); a linear fit under-predicts batch 256 by ~8 %
    rng = np.random.default_rng(2)
    pts = [(b, k) for b in (1, 4, 16, 32, 64, 128, 192, 256) for k in (1, 4, 15)]
    b, k = (np.array(x, float) for x in zip(*pts, strict=True))
    noise = 1 + 0.003 * rng.standard_normal(len(pts))
    kneed = DrafterCost(fixed_ms=0.01, step_ms=0.8, token_ms=0.0045, compute_ms=0.004, knee_tokens=126.0)
    linear = DrafterCost(fixed_ms=0.01, step_ms=0.8, token_ms=0.0045)
    for true in (kneed, linear):
        y = np.array([drafter_ms(true, "autoregressive", bi, int(ki), CTX) for bi, ki in pts]) * noise
        got = fit_drafter(b, k, y, "autoregressive", CTX)
        for bi, ki in [(3, 2), (100, 9), (160, 6), (256, 15)]:
            want = drafter_ms(true, "autoregressive", bi, ki, CTX)
            assert drafter_ms(got, "autoregressive", bi, ki, CTX) == pytest.approx(want, rel=0.015)
        if true is kneed:
            assert got.compute_ms > 0 and got.knee_tokens == pytest.approx(126.0, rel=0.25)
        else:  # within noise no knee: it would trade token_ms against compute_ms
            assert got.compute_ms == 0.0


def test_overhead_and_power():
    n = np.array([1, 8, 64, 256, 1024, 4096], float)
    o = fit_overhead(n, 0.05 + 0.0004 * n, source="pack-kernel")
    assert (o.base_ms, o.token_ms, o.source) == (pytest.approx(0.05), pytest.approx(0.0004), "pack-kernel")
    true = PowerModel(idle_w=120.0, busy_w=650.0, saturate_tokens=512.0)
    w = [true.idle_w + (true.busy_w - true.idle_w) * min(1, x / true.saturate_tokens) for x in n]
    got = fit_power(n, w)
    assert got.idle_w == pytest.approx(120.0, rel=0.02) and got.busy_w == pytest.approx(650.0, rel=0.02)
    assert fit_power(n, [None] * len(n)) is None


def test_too_few_points_is_a_fit_error():
    with pytest.raises(FitError, match="target"):
        fit_target([1, 2], [1, 2], [5.0, 5.1], CTX)


def test_held_out_error_and_exclusion():
    params = CostModelParams(TRUE, DrafterCost(0.1, 0.4, 0.003), OverheadCost(0.05, 0.0))
    model = CostModel(params, "autoregressive", CTX)
    base = [
        {"kind": "target", "batch": 3, "tokens": 9, "q": 3, "k": None},
        {"kind": "target", "batch": 50, "tokens": 50, "q": 1, "k": None},
        {"kind": "drafter", "batch": 7, "tokens": 28, "q": None, "k": 4},
    ]
    factors = [1.10, 0.80, 1.0]  # measured = predicted * factor
    recs = []
    for r, f in zip(base, factors, strict=True):
        pred = model.drafter_ms(r["batch"], r["k"]) if r["kind"] == "drafter" else model.target_ms(r["tokens"], r["batch"])
        recs.append(r | {"ms": pred * f, "held_out": True, "feasible": True})
    recs.append(base[0] | {"ms": None, "held_out": True, "feasible": False})  # infeasible: not counted
    err = held_out_error(model, recs)
    expect = sorted(abs(1 / f - 1) for f in factors)
    assert err.held_out == 3
    assert err.median_rel == pytest.approx(expect[1]) and err.max_rel == pytest.approx(expect[2])


def test_fit_cost_model_leaves_out_held_out_and_infeasible():
    n, b, y = target_data(TRUE, 0.0)
    recs = [{"kind": "target", "batch": int(bi), "tokens": int(ni), "ms": float(yi), "feasible": True}
            for ni, bi, yi in zip(n, b, y, strict=True)]
    recs += [{"kind": "drafter", "batch": bb, "tokens": bb * k, "k": k, "feasible": True,
              "ms": drafter_ms(DrafterCost(0.1, 0.4, 0.003), "autoregressive", bb, k, CTX)}
             for bb in (1, 8, 64) for k in (1, 4)]
    recs.append({"kind": "target", "batch": 8, "tokens": 8, "ms": 1e3, "feasible": True, "held_out": True})
    recs.append({"kind": "target", "batch": 9, "tokens": 9, "ms": None, "feasible": False})
    params = fit_cost_model(recs, drafter_kind="autoregressive", context_len=CTX)
    assert params.target.weight_ms == pytest.approx(TRUE.weight_ms, rel=0.02)
    assert params.overhead.base_ms == 0.0 and params.power is None


def test_a_tile_never_stands_in_for_the_weight_read():
    # a tiny CPU profile (batch 1-2, K <= 1: 1-4 tokens) must not pick a tile (16 here, before the
    # fix), whose rounded column is constant and would take the weight read's place
    n = np.array([1.0, 2.0, 2.0, 4.0, 1.0, 2.0, 4.0])
    b = np.array([1.0, 1.0, 2.0, 2.0, 1.0, 1.0, 2.0])
    y = np.array([2.689, 2.176, 2.283, 3.281, 1.954, 2.746, 1.668])  # noisy wall-clock times
    got = fit_target(n, b, y, 256)
    assert got.tile_tokens == 1 and got.weight_ms + got.token_ms > 0
    got.validate("costs.model.target")
