"""Cost-model fitting: measured points -> :class:`~spectune.runtime.table.CostModelParams`.

Every fit is a non-negative least-squares problem on *relative* residuals (rows divided by the
measured ms), so a 5 ms point and a 100 ms point weigh the same; the target's knee is found by a
1-D search over candidate token counts. Formulas are the ones evaluated in
:mod:`spectune.runtime.costs`.

Identifiability at one context length c: b*c and the token count n are told apart only by target
points with q > 1 (n = b*q) and by tier points (n padded above b). For the autoregressive drafter
K*b and K*b*c are the same column, so the whole per-token cost goes to ``token_ms`` and
``kv_ms_per_mtok`` stays 0; for the parallel drafter the constant goes to ``fixed_ms``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
from scipy.optimize import nnls

from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel, drafter_ms, target_ms
from spectune.runtime.table import (
    CostError,
    CostModelParams,
    DrafterCost,
    DrafterKind,
    OverheadCost,
    PowerModel,
    TargetCost,
)

Values: TypeAlias = Sequence[float] | np.ndarray


class FitError(SpectuneError):
    """Too few or unusable points to fit a part of the cost model."""


# held-out relative error past which a profile is flagged: its predictions (and every gain of a
# table tuned on it) are not to be trusted (H200 profiles: median 2-3 %, max 6-12 %)
WARN_MEDIAN_REL = 0.10
WARN_MAX_REL = 0.30


def error_warning(error: CostError) -> str | None:
    """One line when the held-out error passes WARN_MEDIAN_REL or WARN_MAX_REL, else None."""
    if error.held_out == 0:
        return "the cost model was checked on no held-out point: its error is unknown"
    if error.median_rel <= WARN_MEDIAN_REL and error.max_rel <= WARN_MAX_REL:
        return None
    return (f"the cost model is off by {error.median_rel:.1%} (median) / {error.max_rel:.1%} (max) on "
            f"{error.held_out} held-out points, past {WARN_MEDIAN_REL:.0%} / {WARN_MAX_REL:.0%}: predicted "
            "step times and gains are that uncertain")


def _nnls_rel(x: np.ndarray, ms: np.ndarray) -> tuple[np.ndarray, float]:
    # minimise sum(((x @ coef) - ms) / ms)^2 with coef >= 0
    w = 1.0 / np.maximum(ms, 1e-9)
    coef, _ = nnls(x * w[:, None], np.ones_like(ms), maxiter=50 * x.shape[1])
    resid = (x @ coef) * w - 1.0
    return coef, float(resid @ resid)


def _knee_candidates(tokens: np.ndarray) -> np.ndarray:
    lo, hi = float(tokens.min()), float(tokens.max())
    grid = np.geomspace(max(lo, 1.0), max(hi, 1.0), 48) if hi > lo else np.array([hi])
    return np.unique(np.concatenate([np.unique(tokens), grid]))


def _best_knee(x: np.ndarray, col: int, tokens: np.ndarray, rounded: np.ndarray, ms: np.ndarray, *,
               skip_constant: bool = False, scale: np.ndarray | None = None,
               keep: Callable[[float, np.ndarray], bool] | None = None) -> tuple[float, float, np.ndarray] | None:
    """The 1-D knee search of a roofline fit: column ``col`` of ``x`` (written in place) takes
    max(0, rounded - knee) (times ``scale``, e.g. the steps that pay it) for each knee of
    ``_knee_candidates(tokens)``; returns (relative SSE, knee, coefficients) of the smallest SSE
    among the knees ``keep`` accepts, or None. With ``skip_constant``, a knee whose column is the
    same nonzero value for every point is skipped."""
    best: tuple[float, float, np.ndarray] | None = None
    for knee in _knee_candidates(tokens):
        column = np.maximum(0.0, rounded - knee)
        if scale is not None:
            column = column * scale
        if skip_constant and np.ptp(column) == 0.0 and column[0] > 0.0:
            continue
        x[:, col] = column
        coef, sse = _nnls_rel(x, ms)
        if (best is None or sse < best[0] - 1e-12) and (keep is None or keep(sse, coef)):
            best = (sse, float(knee), coef)
    return best


def _outliers(rel_resid: np.ndarray) -> np.ndarray:
    """Mask of points to drop once: far off the fit (> max(5%, 4x median)), at most 10% of them."""
    r = np.abs(rel_resid)
    bad = r > max(0.05, 4.0 * float(np.median(r)))
    if bad.sum() > len(r) // 10 or len(r) - bad.sum() < 5:
        return np.zeros_like(bad)
    return bad


# candidate GEMM row tiles past the knee; the fit keeps one only where cross-validation folds prefer it
TILES = (1, 16, 32, 64, 128)
CV_FOLDS = 10


def fit_target(tokens: Values, batch: Values, ms: Values, context: float,
               *, trim: bool = True, tiles: Sequence[int] = TILES) -> TargetCost:
    """Fit t(n, b) = weight + token*n + compute*max(0, tile(n)-knee) + (kv + kv_verify*[n>b]) * b*c/1e6.

    The tile is the one of ``tiles`` with the smallest cross-validated relative error
    (``CV_FOLDS`` folds of the points in key order), kept over a smaller one only when it is at
    least 2 % better: points whose token counts are all whole tiles cannot tell tiles apart, and
    then the fit keeps no tiling. With ``trim``, a few points far off the first fit (a throttled
    or preempted measurement) are dropped and the fit is repeated once."""
    n = np.asarray(tokens, float)  # [P] step tokens (padded)
    b = np.asarray(batch, float)  # [P] real requests
    y = np.asarray(ms, float)  # [P]
    if len(y) < 3:
        raise FitError(f"target: need at least 3 feasible points, got {len(y)}")
    if len(tiles) > 1:
        # a tile needs room: at least 4 of it in the measured range, else its rounded column is
        # nearly constant and trades against weight_ms (at tokens 1..4 a tile of 128 is all of it)
        room = [t for t in tiles if t == 1 or 4 * t <= float(n.max())] or [min(tiles)]
        tiles = (_cv_tile(n, b, y, context, room),) if len(room) > 1 else (int(room[0]),)
    if trim:
        first = fit_target(n, b, y, context, trim=False, tiles=tiles)
        pred = np.array([target_ms(first, ni, bi, context) for ni, bi in zip(n, b, strict=True)])
        bad = _outliers(pred / y - 1.0)
        if bad.any():
            return fit_target(n[~bad], b[~bad], y[~bad], context, trim=False, tiles=tiles)
        return first
    tile = int(tiles[0])
    nt = np.ceil(n / tile) * tile
    kv = b * context / 1e6
    verify = (n > b).astype(float)
    x = np.stack([np.ones_like(n), n, np.zeros_like(n), kv, kv * verify], axis=1)
    # a tiled column that is the same for every point would only stand in for weight_ms
    best = _best_knee(x, 2, n, nt, y, skip_constant=tile > 1)
    if best is None:  # every knee was skipped: no tiling
        return fit_target(n, b, y, context, trim=False, tiles=(1,))
    _, knee, c = best
    if c[2] <= 0.0:
        knee, tile = float(n.max()), 1  # no compute-bound segment inside the measured range
    return TargetCost(
        weight_ms=float(c[0]), token_ms=float(c[1]), knee_tokens=knee, compute_ms=float(c[2]),
        kv_ms_per_mtok=float(c[3]), kv_verify_ms_per_mtok=float(c[4]), tile_tokens=tile,
    )


def _cv_tile(n: np.ndarray, b: np.ndarray, y: np.ndarray, context: float, tiles: Sequence[int]) -> int:
    folds = min(CV_FOLDS, len(y))
    if folds < 3:
        return int(min(tiles))
    which = np.arange(len(y)) % folds
    errors = {}
    for tile in sorted(tiles):
        err = []
        for f in range(folds):
            fit, held = which != f, which == f
            if fit.sum() < 3:
                continue
            p = fit_target(n[fit], b[fit], y[fit], context, trim=False, tiles=(tile,))
            err += [abs(target_ms(p, ni, bi, context) / yi - 1.0) for ni, bi, yi in zip(n[held], b[held], y[held], strict=True)]
        errors[tile] = float(np.mean(err)) if err else math.inf
    best = min(tiles)
    for tile in sorted(tiles):
        if errors[tile] < 0.98 * errors[best]:
            best = tile
    return int(best)


def fit_drafter(
    batch: Values, k: Values, ms: Values, kind: DrafterKind, context: float,
    *, trim: bool = True,
) -> DrafterCost:
    b = np.asarray(batch, float)  # [P]
    kk = np.asarray(k, float)  # [P] draft length, >= 1
    y = np.asarray(ms, float)  # [P]
    if len(y) < 2:
        raise FitError(f"drafter: need at least 2 feasible points, got {len(y)}")
    if trim:
        first = fit_drafter(b, kk, y, kind, context, trim=False)
        pred = np.array([drafter_ms(first, kind, bi, int(ki), context) for bi, ki in zip(b, kk, strict=True)])
        bad = _outliers(pred / y - 1.0)
        return fit_drafter(b[~bad], kk[~bad], y[~bad], kind, context, trim=False) if bad.any() else first
    if kind == "autoregressive":
        # fixed + K * (step + token * b + compute * max(0, b - knee))   (K*b*c is the K*b column at
        # one context). Each draft step runs b rows; past the knee its GEMMs (the drafter's lm_head
        # above all: 151 936 x 5 120 for qwen3-32b's) turn compute-bound. Linear in b, the fit
        # under-predicted the H200 qwen3-32b drafter at batch 256 by 7-10 % (10-fold cross-
        # validated error of the four H200 profiles' drafter points 1.3-2.3 % linear, 0.6-0.8 % with
        # the knee). Kept, as the parallel drafter's, only where it at least halves the squared error.
        x = np.stack([np.ones_like(b), kk, kk * b, np.zeros_like(b)], axis=1)
        c, linear = _nnls_rel(x[:, :3], y)
        kneed = _best_knee(x, 3, b, b, y, scale=kk, keep=lambda sse, coef: sse < 0.5 * linear and coef[3] > 0.0)
        if kneed is None:
            return DrafterCost(fixed_ms=float(c[0]), step_ms=float(c[1]), token_ms=float(c[2]), kv_ms_per_mtok=0.0)
        _, knee, c = kneed
        return DrafterCost(fixed_ms=float(c[0]), step_ms=float(c[1]), token_ms=float(c[2]), kv_ms_per_mtok=0.0,
                           compute_ms=float(c[3]), knee_tokens=knee)
    # parallel: fixed + token * n + compute * max(0, n - knee) + kv * b*c/1e6, n = b*K (one forward, a
    # target-like roofline; the knee by the same 1-D search). Linear in n, the fit over-predicted the
    # H200 DFlash drafter by 3-10 % between 200 and 400 tokens, its weight-bound stretch.
    # The knee is kept only where it at least halves the squared error: within noise a spurious knee
    # would trade token_ms against compute_ms.
    n = b * kk
    x = np.stack([np.ones_like(b), n, np.zeros_like(n), b * context / 1e6], axis=1)
    c, linear = _nnls_rel(x, y)
    kneed = _best_knee(x, 2, n, n, y, keep=lambda sse, coef: sse < 0.5 * linear and coef[2] > 0.0)
    _, knee, c = kneed if kneed is not None else (linear, 0.0, c)
    return DrafterCost(fixed_ms=float(c[0]), step_ms=0.0, token_ms=float(c[1]), kv_ms_per_mtok=float(c[3]),
                       compute_ms=float(c[2]), knee_tokens=knee)


def fit_overhead(tokens: Sequence[float], ms: Sequence[float], source: str | None = None) -> OverheadCost:
    n = np.asarray(tokens, float)
    y = np.asarray(ms, float)
    if len(y) == 0:
        return OverheadCost(base_ms=0.0, token_ms=0.0, source="none")
    x = np.stack([np.ones_like(n), n], axis=1)
    c, _ = _nnls_rel(x, y)
    return OverheadCost(base_ms=float(c[0]), token_ms=float(c[1]), source=source)


def fit_power(tokens: Sequence[float], watts: Sequence[float | None]) -> PowerModel | None:
    """idle + (busy - idle) * min(1, n / saturate); None with fewer than 3 readings."""
    pairs = [(float(n), float(w)) for n, w in zip(tokens, watts, strict=True) if w is not None and not math.isnan(w)]
    if len(pairs) < 3:
        return None
    n = np.array([p[0] for p in pairs])
    w = np.array([p[1] for p in pairs])
    best: tuple[float, float, np.ndarray] | None = None
    for sat in _knee_candidates(n):
        frac = np.minimum(1.0, n / sat)
        x = np.stack([1.0 - frac, frac], axis=1)  # w = idle*(1-frac) + busy*frac
        coef, sse = _nnls_rel(x, w)
        if best is None or sse < best[0]:
            best = (sse, float(sat), coef)
    assert best is not None
    _, sat, (idle, busy) = best
    return PowerModel(idle_w=float(idle), busy_w=float(max(busy, idle)), saturate_tokens=sat)


def _usable(records: Iterable[Mapping[str, Any]], kinds: tuple[str, ...]) -> list[Mapping[str, Any]]:
    return [
        r for r in records
        if r["kind"] in kinds and r.get("feasible", True) and not r.get("held_out", False)
        and r.get("ms") is not None and r["ms"] > 0
    ]


def fit_cost_model(
    records: Sequence[Mapping[str, Any]], *, drafter_kind: DrafterKind, context_len: int,
    overhead_source: str | None = None,
) -> CostModelParams:
    """Fit all parts from point records (keys: kind, batch, tokens, q, k, ms, power_w,
    feasible, held_out). Held-out and infeasible points are left out."""
    tgt = _usable(records, ("target", "tier"))
    dft = [r for r in _usable(records, ("drafter",)) if (r.get("k") or 0) >= 1]
    ovh = _usable(records, ("overhead",))
    target = fit_target([r["tokens"] for r in tgt], [r["batch"] for r in tgt], [r["ms"] for r in tgt], context_len)
    drafter = fit_drafter([r["batch"] for r in dft], [r["k"] for r in dft], [r["ms"] for r in dft],
                          drafter_kind, context_len)
    overhead = fit_overhead([r["tokens"] for r in ovh], [r["ms"] for r in ovh], overhead_source)
    power = fit_power([r["tokens"] for r in tgt], [r.get("power_w") for r in tgt])
    return CostModelParams(target=target, drafter=drafter, overhead=overhead, power=power)


def predict_ms(model: CostModel, record: Mapping[str, Any]) -> float:
    kind = record["kind"]
    if kind in ("target", "tier"):
        return model.target_ms(record["tokens"], record["batch"])
    if kind == "drafter":
        return model.drafter_ms(record["batch"], int(record["k"]))
    if kind == "overhead":
        return model.overhead_ms(record["tokens"])
    raise FitError(f"kind: unknown point kind {kind!r}")


def relative_errors(model: CostModel, records: Iterable[Mapping[str, Any]]) -> list[float]:
    """|predicted - measured| / measured for each feasible record with a time."""
    out = []
    for r in records:
        if r.get("feasible", True) and r.get("ms") is not None and r["ms"] > 0:
            out.append(abs(predict_ms(model, r) - r["ms"]) / r["ms"])
    return out


def held_out_error(model: CostModel, records: Sequence[Mapping[str, Any]]) -> CostError:
    """Median / max relative error over the held-out target and drafter points."""
    held = [r for r in records if r.get("held_out", False) and r["kind"] in ("target", "tier", "drafter")]
    errs = relative_errors(model, held)
    if not errs:
        return CostError(held_out=0, median_rel=0.0, max_rel=0.0)
    return CostError(held_out=len(errs), median_rel=float(np.median(errs)), max_rel=float(np.max(errs)))
