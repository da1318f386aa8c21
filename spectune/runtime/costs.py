"""Cost model evaluation: predicted step times (ms) and power from fitted parameters.

The parameter dataclasses live in :mod:`spectune.runtime.table` (they are part of the YAML);
this module evaluates them (pure arithmetic, cheap enough for the runtime planner); fitting lives in
:mod:`spectune.autotune.fit`.

Words: b = real requests in the step, n = step tokens (padded to the captured tier when the
runtime pads), c = context length, K = draft length.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from spectune.runtime.table import (
    CostModelParams,
    DrafterCost,
    DrafterKind,
    OverheadCost,
    Point,
    PowerModel,
    Table,
    TargetCost,
)


def target_ms(p: TargetCost, tokens: float, batch: float, context: float, *, verify: bool | None = None) -> float:
    # weight-bound floor, then compute-bound past the knee, plus KV read of b x c;
    # verify (default: tokens > batch) adds the extra KV cost of query length > 1
    kv = p.kv_ms_per_mtok + (p.kv_verify_ms_per_mtok if (tokens > batch if verify is None else verify) else 0.0)
    return (
        p.weight_ms
        + p.token_ms * tokens
        + p.compute_ms * max(0.0, tiled(tokens, p.tile_tokens) - p.knee_tokens)
        + kv * batch * context / 1e6
    )


def tiled(tokens: float, tile: int) -> float:
    """``tokens`` rounded up to a whole number of tiles of ``tile`` rows."""
    return tokens if tile <= 1 else math.ceil(tokens / tile) * tile


def drafter_ms(p: DrafterCost, kind: DrafterKind, batch: float, k: int, context: float) -> float:
    if k <= 0:
        return 0.0  # K = 0: the drafter does not run
    steps, per_step = (k, batch) if kind == "autoregressive" else (1, batch * k)
    compute = p.compute_ms * max(0.0, per_step - p.knee_tokens) if p.compute_ms else 0.0
    return p.fixed_ms + steps * (p.step_ms + p.token_ms * per_step + compute + p.kv_ms_per_mtok * batch * context / 1e6)


def overhead_ms(p: OverheadCost, tokens: float) -> float:
    return p.base_ms + p.token_ms * tokens


def power_w(p: PowerModel | None, tokens: float) -> float | None:
    if p is None:
        return None
    frac = min(1.0, tokens / p.saturate_tokens) if p.saturate_tokens > 0 else 1.0
    return p.idle_w + (p.busy_w - p.idle_w) * frac


MIN_ROW_POINTS = 3  # a batch size enters the residual grid with at least this many token counts
# relative slack on "more tokens cannot be faster": a point slower by more than this than a point
# with more tokens at the same batch size is inconsistent (CPU wall-clock noise reaches ~10 %)
RESIDUAL_NOISE = 0.15


@dataclass(frozen=True)
class TargetResiduals:
    """Measured / fitted target time at the profile's grid points, interpolated between them.

    The roofline fit is smooth; the GPU is not (a GEMM that needs one more tile at some M, a
    kernel switch): at qwen3-8b on an H200 the fit is 6.8 % slow at 32 x 4 tokens and 1 % slow at
    32 x 8, enough to pick K 4 over K 3 where K 3 measures 3 % faster. The factor at (b, n) is
    linear in log2 n along each measured batch size, then linear in log2 b between the two
    nearest measured batch sizes; constant past the ends. Grid rows are batch sizes with >=
    ``MIN_ROW_POINTS`` token counts (the seed grid; single adaptive points would bend a row).

    Consistency (``consistent_rows``): along a batch size a step cannot get faster with more
    tokens beyond ``RESIDUAL_NOISE``. Of a pair that breaks it, the point farther from the fit is
    dropped (a noise spike on a shared CPU: 8.09 ms at 16 x 16 tokens beside 1.91 ms at 16 x 32),
    until the row is consistent; a row left with fewer than ``MIN_ROW_POINTS`` points is refused.
    ``CostModel.target_ms`` also never returns less than plain decoding of the same batch for a
    step with at least that many tokens, so a gain over plain is at most K + 1."""

    log_batches: tuple[float, ...]  # ascending log2 batch of each row
    rows: tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]  # per row: log2 tokens, log ratio

    @classmethod
    def from_points(cls, params: TargetCost, points: Sequence[Point], context_len: float) -> TargetResiduals | None:
        grid, _ = consistent_rows(params, points, context_len)
        if not grid:
            return None
        rows = tuple((tuple(math.log2(n) for n in sorted(row)), tuple(row[n] for n in sorted(row)))
                     for _, row in grid)
        return cls(tuple(math.log2(b) for b, _ in grid), rows)

    def factor(self, tokens: float, batch: float) -> float:
        lb, ln = math.log2(max(batch, 1.0)), math.log2(max(tokens, 1.0))
        i = bisect.bisect_left(self.log_batches, lb)
        if i == 0 or i == len(self.log_batches):
            return math.exp(_interp(ln, *self.rows[min(i, len(self.rows) - 1)]))
        x0, x1 = self.log_batches[i - 1], self.log_batches[i]
        w = (lb - x0) / (x1 - x0)
        return math.exp((1 - w) * _interp(ln, *self.rows[i - 1]) + w * _interp(ln, *self.rows[i]))


def consistent_rows(params: TargetCost, points: Sequence[Point], context_len: float
                    ) -> tuple[list[tuple[int, dict[int, float]]], list[str]]:
    """The residual grid [(batch, {tokens: log(measured / fit)})] and a note per point dropped or
    row refused (TargetResiduals doc). Repeated (batch, tokens) points: their median."""
    seen: dict[int, dict[int, list[float]]] = {}
    for p in points:
        if p.kind == "target" and not p.held_out and p.ms is not None and p.ms > 0 and p.tokens >= 1:
            seen.setdefault(p.batch, {}).setdefault(p.tokens, []).append(p.ms)
    grid: list[tuple[int, dict[int, float]]] = []
    notes: list[str] = []
    for b in sorted(seen):
        ms = {n: statistics.median(v) for n, v in seen[b].items()}
        if len(ms) < MIN_ROW_POINTS:
            continue
        fit = {n: target_ms(params, n, b, context_len) for n in ms}
        if min(fit.values()) <= 0:
            continue
        dropped = _drop_inconsistent(ms, fit)
        notes += [f"batch {b}: left out {ms_n:.3g} ms at {n} tokens ({why})" for n, ms_n, why in dropped]
        if len(ms) < MIN_ROW_POINTS:
            notes.append(f"batch {b}: row refused, {len(ms)} consistent points left (< {MIN_ROW_POINTS})")
            continue
        grid.append((b, {n: math.log(ms[n] / fit[n]) for n in ms}))
    return grid, notes


def _drop_inconsistent(ms: dict[int, float], fit: dict[int, float]) -> list[tuple[int, float, str]]:
    """Remove from ``ms`` (tokens -> ms, one batch size) points until no point is slower than one
    with more tokens by more than RESIDUAL_NOISE; of the worst pair, the one farther from the fit
    goes. Returns (tokens, ms, reason) of each point removed."""
    out: list[tuple[int, float, str]] = []
    while True:
        ns = sorted(ms)
        worst, pair = 1.0 + RESIDUAL_NOISE, None
        for i, lo in enumerate(ns):
            for hi in ns[i + 1:]:
                if ms[lo] / ms[hi] > worst:
                    worst, pair = ms[lo] / ms[hi], (lo, hi)
        if pair is None:
            return out
        lo, hi = pair
        gone, kept = (lo, hi) if abs(math.log(ms[lo] / fit[lo])) >= abs(math.log(ms[hi] / fit[hi])) else (hi, lo)
        out.append((gone, ms[gone], f"{ms[lo]:.3g} ms at {lo} is slower than {ms[hi]:.3g} ms at {hi} tokens; "
                                    f"the point at {kept} is nearer the fit"))
        del ms[gone]


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    j = bisect.bisect_left(xs, x)
    if j == 0:
        return ys[0]
    if j == len(xs):
        return ys[-1]
    w = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    return (1 - w) * ys[j - 1] + w * ys[j]


@dataclass(frozen=True)
class CostModel:
    """Evaluates one GPU's fitted costs for one workload (drafter kind and context fixed);
    ``residuals`` (``CostModel.of``) corrects the target fit toward the measured grid."""

    params: CostModelParams
    drafter_kind: DrafterKind
    context_len: int
    residuals: TargetResiduals | None = None

    @classmethod
    def of(cls, table: Table, *, residuals: bool = True) -> CostModel:
        """The cost model of a profile or policy table, corrected by its measured target points
        (measured at ``workload.context_len``), evaluated at the context the policy was tuned
        for (``policy.context_len``) when it names one."""
        wl, costs = table.workload, table.costs
        res = TargetResiduals.from_points(costs.model.target, costs.points, wl.context_len) if residuals else None
        tuned = table.policy.context_len if table.policy is not None else None
        return cls(costs.model, wl.drafter_kind, tuned or wl.context_len, res)

    def target_ms(self, tokens: float, batch: float, context: float | None = None, *,
                  verify: bool | None = None) -> float:
        c = self.context_len if context is None else context
        ms = target_ms(self.params.target, tokens, batch, c, verify=verify)
        if self.residuals is None:
            return ms  # the fit alone is non-decreasing in tokens (its coefficients are >= 0)
        ms *= self.residuals.factor(tokens, batch)
        if tokens > batch:
            # a step of b requests verifying more tokens never beats plain decoding of b requests
            plain = target_ms(self.params.target, batch, batch, c, verify=False) * self.residuals.factor(batch, batch)
            ms = max(ms, plain)
        return ms

    def drafter_ms(self, batch: float, k: int, context: float | None = None) -> float:
        c = self.context_len if context is None else context
        return drafter_ms(self.params.drafter, self.drafter_kind, batch, k, c)

    def overhead_ms(self, tokens: float) -> float:
        return overhead_ms(self.params.overhead, tokens)

    def step_ms(self, batch: int, k: int, tokens: float, context: float | None = None) -> float:
        """One speculative step: drafter(b, K) + target(n) + overhead(n); n includes padding."""
        return self.drafter_ms(batch, k, context) + self.target_ms(tokens, batch, context) + self.overhead_ms(tokens)

    def power_w(self, tokens: float) -> float | None:
        return power_w(self.params.power, tokens)
