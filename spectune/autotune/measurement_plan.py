"""What the measurement study measures: points, the plan, and the adaptive choice of points.

- A point is a :class:`PointSpec` (kind, batch, tokens, q | k) with a deterministic ``key``
  (``target:b=4:q=2``); the key is what workers claim, so no key is ever measured twice.
- Phases: ``seed`` (sparse grid: log-spaced batch sizes x a few q / K, every tier, a few overhead
  sizes, a few target points of odd token counts so the fit sees partial GEMM tiles), ``held_out``
  (>= 10 seeded random batch sizes off the grid, measured but not fitted; they give the reported
  error; one found infeasible is replaced, :func:`held_out_replacements`) and ``adaptive``: rounds
  of a few points each, chosen by refitting the cost model on bootstrap resamples and taking the
  candidates (any allowed batch x q / K) with the largest relative spread of predictions, doubled
  near batch sizes where the best K under a default geometric acceptance curve changes. A round's
  choice depends only on the finished points (sorted by key), so any number of workers choose the
  same rounds as one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectune.autotune.fit import TILES, FitError, fit_drafter, fit_target
from spectune.errors import SpectuneError
from spectune.runtime.costs import drafter_ms, target_ms
from spectune.runtime.table import DrafterKind, PointKind

DEFAULT_ACCEPT = 0.7  # survival s_i = DEFAULT_ACCEPT**i, only to find where the best K changes
BOOTSTRAPS = 8
KINDS: tuple[PointKind, ...] = ("target", "tier", "drafter", "overhead")


class StudyError(SpectuneError):
    """The measurement study cannot run (storage, plan)."""


@dataclass(frozen=True)
class PointSpec:
    kind: PointKind
    batch: int  # real requests
    tokens: int  # step tokens (target: batch*q; tier: the tier; drafter: batch*k; overhead: tokens)
    q: int | None = None  # target: tokens per request, 1..max_k+1
    k: int | None = None  # drafter: draft length, 1..max_k
    held_out: bool = False

    @property
    def size(self) -> int:
        return self.q if self.kind == "target" else self.k if self.kind == "drafter" else self.tokens  # type: ignore[return-value]

    @property
    def key(self) -> str:
        name = {"target": "q", "drafter": "k"}.get(self.kind, "n")
        return f"{self.kind}:b={self.batch}:{name}={self.size}" + (":held" if self.held_out else "")


def target_point(batch: int, q: int, held_out: bool = False) -> PointSpec:
    return PointSpec("target", batch, batch * q, q=q, held_out=held_out)


def drafter_point(batch: int, k: int, held_out: bool = False) -> PointSpec:
    return PointSpec("drafter", batch, batch * k, k=k, held_out=held_out)


@dataclass(frozen=True)
class StudyPlan:
    batch_sizes: tuple[int, ...]  # allowed batch sizes, increasing
    max_k: int
    drafter_kind: DrafterKind
    context_len: int
    adaptive_trials: int = 16
    held_out: int = 12
    per_round: int = 4
    seed: int = 0
    tiers: tuple[int, ...] = ()  # default: powers of two up to max_batch * (max_k + 1)
    overhead_source: str | None = "packing-metadata"

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise StudyError("batch_sizes: must be a non-empty list of sizes >= 1")
        if self.max_k < 1:
            raise StudyError(f"max_k: must be >= 1, got {self.max_k}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(set(self.batch_sizes))))
        if not self.tiers:
            object.__setattr__(self, "tiers", default_tiers(self.max_batch, self.max_k))

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def total_points(self) -> int:
        """Every point the study measures: seed grid, held-out points and the adaptive budget."""
        return len(seed_points(self)) + len(held_out_points(self)) + self.adaptive_trials




# ---------------------------------------------------------------------------------------------
# plan


def default_tiers(max_batch: int, max_k: int) -> tuple[int, ...]:
    top = max_batch * (max_k + 1)
    tiers, t = [], 1
    while t < top:
        tiers.append(t)
        t *= 2
    return tuple(tiers + [top])


def grid_batches(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Log-spaced batch sizes (powers of two snapped to the allowed ones, plus both ends)."""
    sizes = sorted(set(batch_sizes))
    if len(sizes) <= 6:
        return tuple(sizes)
    want = [2**i for i in range(int(math.log2(sizes[-1])) + 1)] + [sizes[0], sizes[-1]]

    def nearest(w: int) -> int:
        return min(sizes, key=lambda s: (abs(math.log(s / w)), s))

    return tuple(sorted({nearest(w) for w in want}))


def _draft_lengths(max_k: int) -> tuple[int, ...]:
    return tuple(sorted({1, max(1, (max_k + 1) // 4), max_k}))


def _q_values(max_k: int) -> tuple[int, ...]:
    qs = [1]
    while qs[-1] * 2 <= max_k + 1:
        qs.append(qs[-1] * 2)
    return tuple(sorted(set(qs + [max_k + 1])))


def off_tile_targets(plan: StudyPlan) -> list[PointSpec]:
    """Target points whose token counts are odd (an odd batch size near 1.5x each grid size from
    4 up, x q = 3 and q = max_k when odd): the grid's counts are powers of two times its batch
    sizes, whole GEMM tiles, so without these the fit cannot see what a partial tile costs."""
    grid = grid_batches(plan.batch_sizes)
    odd = [s for s in plan.batch_sizes if s % 2 and s not in grid]
    qs = sorted({q for q in (3, plan.max_k) if q % 2 and 1 < q <= plan.max_k + 1})
    pts: list[PointSpec] = []
    for g in grid:
        if g < 4 or not odd or not qs:
            continue
        b = min(odd, key=lambda s: (abs(math.log(s / (1.5 * g))), s))
        if abs(math.log(b / (1.5 * g))) > math.log(1.25):
            continue
        pts += [target_point(b, q) for q in qs]
    return list({p.key: p for p in pts}.values())


def seed_points(plan: StudyPlan) -> list[PointSpec]:
    grid = grid_batches(plan.batch_sizes)
    pts = [target_point(b, q) for b in grid for q in _q_values(plan.max_k)]
    pts += off_tile_targets(plan)
    pts += [drafter_point(b, k) for b in grid for k in _draft_lengths(plan.max_k)]
    pts += [PointSpec("tier", max(1, min(plan.max_batch, t // 2)), t) for t in plan.tiers]
    pts += [PointSpec("overhead", b, n) for b in grid for n in sorted({b, b * (plan.max_k + 1)})]
    return pts


def held_out_points(plan: StudyPlan) -> list[PointSpec]:
    """Seeded random target/drafter points at batch sizes off the grid (grid sizes only if none)."""
    rng = np.random.default_rng(plan.seed + 7919)
    grid = set(grid_batches(plan.batch_sizes))
    off = [b for b in plan.batch_sizes if b not in grid] or list(plan.batch_sizes)
    seen = {p.key + ":held" for p in off_tile_targets(plan)}  # never the shape of a fitted point
    pts: list[PointSpec] = []
    for _ in range(plan.held_out * 20):
        if len(pts) >= plan.held_out:
            break
        b = int(rng.choice(off))
        if len(pts) % 3 == 2:
            p = drafter_point(b, int(rng.integers(1, plan.max_k + 1)), held_out=True)
        else:
            p = target_point(b, int(rng.integers(1, plan.max_k + 2)), held_out=True)
        if p.key not in seen:
            seen.add(p.key)
            pts.append(p)
    return pts


HELD_OUT_RETRIES = 2  # replacements for infeasible held-out points: at most 2x the planned count
FIT_MODEL = {"target": ("target", "tier"), "drafter": ("drafter",)}  # kinds timed on one model


def held_out_budget(plan: StudyPlan) -> int:
    """Every held-out key the study may enqueue: the planned points and their replacements."""
    return len(held_out_points(plan)) + HELD_OUT_RETRIES * plan.held_out


def held_out_replacements(plan: StudyPlan, records: Sequence[dict[str, Any]], exclude: set[str]) -> list[PointSpec]:
    """Held-out points in place of the infeasible ones (out of memory), one per missing feasible point.

    Drawn (seeded by how many held-out keys exist, so a resumed study draws the same) from batch
    sizes below the smallest infeasible batch on that model at any token count -- the KV cache
    grows with the batch, activations with the tokens, and a smaller batch with more tokens that
    failed bounds the batch too -- off the grid when any is left, never a fitted point's shape,
    never a key in ``exclude`` (every key ever enqueued). Empty when no held-out point is infeasible."""
    held = [r for r in records if r.get("held_out")]
    if all(r.get("feasible") for r in held):
        return []
    planned = held_out_points(plan)
    fitted = {p.key for p in seed_points(plan)} | {k for k in exclude if not k.endswith(":held")}
    rng = np.random.default_rng(plan.seed + 7919 + sum(1 for k in exclude if k.endswith(":held")))
    grid = set(grid_batches(plan.batch_sizes))
    picks: list[PointSpec] = []
    rest: list[PointSpec] = []
    for kind, make, sizes in (("target", target_point, range(1, plan.max_k + 2)),
                              ("drafter", drafter_point, range(1, plan.max_k + 1))):
        bound = min((r["batch"] for r in records if not r.get("feasible") and r["kind"] in FIT_MODEL[kind]),
                    default=plan.max_batch + 1)
        below = [b for b in plan.batch_sizes if b < bound]
        batches = [b for b in below if b not in grid] or below
        cands = [p for b in batches for s in sizes
                 if (p := make(b, s, held_out=True)).key not in exclude and make(b, s).key not in fitted]
        pool = [cands[int(i)] for i in rng.permutation(len(cands))]
        need = sum(1 for p in planned if p.kind == kind) - sum(1 for r in held if r["kind"] == kind and r.get("feasible"))
        picks += pool[:max(0, need)]
        rest += pool[max(0, need):]
    short = len(planned) - sum(1 for r in held if r.get("feasible")) - len(picks)
    return picks + rest[:max(0, short)]  # a model with no room left: the other one fills in


# ---------------------------------------------------------------------------------------------
# adaptive choice


def _candidates(plan: StudyPlan) -> list[PointSpec]:
    sizes = plan.batch_sizes
    if len(sizes) > 96:  # thin very long ranges: ~96 log-spaced candidates are plenty
        sizes = tuple(sorted({sizes[int(i)] for i in np.geomspace(1, len(sizes), 96) - 1}))
    pts = [target_point(b, q) for b in sizes for q in range(1, plan.max_k + 2)]
    return pts + [drafter_point(b, k) for b in sizes for k in range(1, plan.max_k + 1)]


def _fit_parts(recs: Sequence[dict[str, Any]], plan: StudyPlan, tiles: Sequence[int] = TILES) -> tuple[Any, Any]:
    tgt = [r for r in recs if r["kind"] in ("target", "tier")]
    dft = [r for r in recs if r["kind"] == "drafter"]
    t = fit_target([r["tokens"] for r in tgt], [r["batch"] for r in tgt], [r["ms"] for r in tgt], plan.context_len,
                   tiles=tiles)
    d = fit_drafter([r["batch"] for r in dft], [r["k"] for r in dft], [r["ms"] for r in dft],
                    plan.drafter_kind, plan.context_len)
    return t, d


def _predict(parts: tuple[Any, Any], p: PointSpec, plan: StudyPlan) -> float:
    t, d = parts
    if p.kind == "drafter":
        return drafter_ms(d, plan.drafter_kind, p.batch, p.k or 0, plan.context_len)
    return target_ms(t, p.tokens, p.batch, plan.context_len)


def best_k_by_batch(parts: tuple[Any, Any], plan: StudyPlan, accept: float = DEFAULT_ACCEPT) -> dict[int, int]:
    """argmax_K of predicted goodput b * (1 + sum accept^i) / step_ms for each allowed batch size."""
    out = {}
    for b in plan.batch_sizes:
        def goodput(k: int, b: int = b) -> float:
            step = _predict(parts, drafter_point(b, k), plan) if k else 0.0
            step += _predict(parts, target_point(b, k + 1), plan)
            return b * sum(accept**i for i in range(k + 1)) / max(step, 1e-9)
        out[b] = max(range(plan.max_k + 1), key=goodput)
    return out


def choose_adaptive(plan: StudyPlan, records: Sequence[dict[str, Any]], exclude: set[str], n: int) -> list[PointSpec]:
    """Up to ``n`` unmeasured candidates where bootstrap fits disagree most (x2 near a K switch)."""
    # sorted by key: the choice depends on which points finished, never on the order they did
    recs = sorted((r for r in records if r.get("feasible") and not r.get("held_out") and r["kind"] != "overhead"),
                  key=lambda r: r["key"])
    cands = [p for p in _candidates(plan) if p.key not in exclude]
    if not cands or n <= 0:
        return []
    rng = np.random.default_rng(plan.seed + len(recs))
    full: tuple[Any, Any] | None = None
    with contextlib.suppress(FitError):
        full = _fit_parts(recs, plan)
    tiles = (full[0].tile_tokens,) if full is not None else (1,)  # the bootstraps keep the full fit's tile
    preds = []
    for _ in range(BOOTSTRAPS):
        sample = [recs[i] for i in rng.integers(0, len(recs), len(recs))]
        with contextlib.suppress(FitError):
            parts = _fit_parts(sample, plan, tiles)
            preds.append([_predict(parts, p, plan) for p in cands])
    if len(preds) < 2:
        return cands[:: max(1, len(cands) // n)][:n]
    arr = np.asarray(preds)  # [bootstraps, candidates]
    score = arr.std(axis=0) / np.maximum(arr.mean(axis=0), 1e-9)
    if full is not None:
        best = best_k_by_batch(full, plan)
        sizes = plan.batch_sizes
        near: set[int] = set()
        for lo, hi in zip(sizes[:-1], sizes[1:], strict=True):
            if best[lo] != best[hi]:
                near.update((lo, hi))
        score = score * np.array([2.0 if p.batch in near else 1.0 for p in cands])
    picks: list[PointSpec] = []
    used: set[tuple[str, int]] = set()
    for i in np.argsort(-score, kind="stable"):
        p = cands[int(i)]
        if (p.kind, p.batch) not in used:
            picks.append(p)
            used.add((p.kind, p.batch))
        if len(picks) >= n:
            break
    return picks


