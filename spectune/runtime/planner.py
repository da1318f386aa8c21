"""Runtime planner: load a policy table at server start and answer ``plan(batch)`` per step.

``plan(b)`` is a host-side list lookup (no GPU work, no device value): it returns K (0 = the
drafter does not run), the verify budget B (draft tokens checked this step over all requests)
and the captured tier to replay (smallest tier >= b + B).

``observe(accepted_per_pos, offered_per_pos)`` takes the device's acceptance counters of the
previous step (host copies, one step late) and keeps count-weighted EMA sums of them (each step
decays the sums by ``1 - online.ema`` and adds its counts, so a step that tested more drafts
weighs more). From them it estimates the live conditional rates: a pooled drift ratio
``rho = sum(accepted) / sum(tested * prior)`` scales the prior, and each position's own counts
pull its rate away from ``prior * rho`` as they grow (shrinkage with ``SHRINK`` pseudo-drafts).
K leaves the table's value only when
  - the EMA holds at least ``online.min_evidence`` tested first-position drafts (about
    batch / ema: one request's class must not pass for a drift of the whole traffic), and
  - the cost model predicts, under the estimated rates, a goodput gain above ``online.hysteresis``
    for the new K over the table's K.
The new K moves by as much as the optimum of the homogeneous estimate moved from the optimum of
the prior (the table's K already folds in the request mixture and the allocation rule), never to
a shape that has no captured tier; when the evidence or the predicted gain is gone, K returns to
the table's value. In a stationary workload the estimate stays at the prior, so K stays put.

Counters, per draft position i = 0..len-1 (position i + 1 in the survival words):
  offered_per_pos[i]:  drafts at position i + 1 that were tested (granted, and position i accepted)
  accepted_per_pos[i]: of those, how many were accepted
so accepted / offered is the conditional acceptance a_{i+1}.

Batch sizes above the table's range reuse the last row, with the budget cut to fit the largest
tier (counted in ``Planner.clamped``); a batch larger than the largest tier gets ``tier=None``
(no captured graph: the caller runs eager, counted in ``Planner.uncaptured``).
"""

from __future__ import annotations

import os
import warnings
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from spectune.errors import SpectuneError, TableError
from spectune.runtime.costs import CostModel
from spectune.runtime.table import Row, Table, read_table

OnMismatch = Literal["warn", "refuse", "ignore"]
SHRINK = 32.0  # pseudo-drafts at prior * drift per position in the online rate estimate


class PolicyMismatch(SpectuneError):
    """The table was measured on another GPU than the one it is loaded on."""


class PolicyMismatchWarning(UserWarning):
    """Warned (not raised) when a table from another GPU is loaded with on_gpu_mismatch='warn'."""


@dataclass(frozen=True)
class Plan:
    k: int  # drafts proposed per request; 0 = plain decoding
    verify_budget: int  # draft tokens verified this step over all requests, <= batch * k
    tier: int | None  # captured token count replayed (>= batch + verify_budget); None = eager


def row_budget(row: Row, batch: int, k: int | None = None) -> int:
    """Verify budget of ``row`` at ``batch`` (with draft length ``k``, default the row's)."""
    k = row.k if k is None else k
    if k <= 0:
        return 0
    if row.budget_mode == "fill-tier":
        assert row.tier is not None
        base = max(0, row.tier - batch)
    else:
        base = row.verify_budget
    if k != row.k and row.k > 0:
        base = round(min(batch * row.k, base) * k / row.k)  # the row's budget scaled with K
    return max(0, min(batch * k, base))


def step_ms(cost: CostModel, batch: int, k: int, tier: int) -> float:
    """One step as the runtime runs it: drafter(b, K) + target(tier) + overhead(tier); the step
    pays for its padded tier, and a K = 0 step is plain decoding (no verification KV term)."""
    return cost.drafter_ms(batch, k) + cost.target_ms(tier, batch, verify=k > 0) + cost.overhead_ms(tier)


def smallest_tier(tiers: Sequence[int], tokens: int) -> int | None:
    i = bisect_left(tiers, tokens)
    return tiers[i] if i < len(tiers) else None


def expected_tokens_uniform(accept: Sequence[float], batch: int, budget: int) -> float:
    """Emitted tokens of ``batch`` like requests sharing ``budget`` drafts evenly:
    b + b * sum(s_1..s_q) + r * s_{q+1},  q, r = divmod(budget, b),  s_i = prod(a_1..a_i)."""
    q, r = divmod(budget, batch)
    total, s = float(batch), 1.0
    for i in range(min(q + 1, len(accept))):
        s *= accept[i]
        total += s * (batch if i < q else r)
    return total


class Planner:
    """Flat lookup ``batch -> Plan`` per row and K, plus the online K correction."""

    def __init__(self, table: Table, *, file: str | os.PathLike[str] | None = None):
        if table.policy is None:
            raise TableError("policy", "missing: this is a cost-only profile (run `spectune tune`)", file)
        self.table = table
        self.policy = table.policy
        self.tiers: list[int] = list(self.policy.tiers)
        self.max_batch = self.policy.rows[-1].batch[1]
        self.cost = CostModel.of(table)
        online = self.policy.online
        self.k_lo = online.min_k
        self.k_hi = online.max_k if online.max_k is not None else table.workload.max_k
        self.k_hi = max(self.k_hi, max(r.k for r in self.policy.rows))
        self.clamped = 0
        self.uncaptured = 0
        self._build_lookup()
        prior = list(online.prior) if online.prior else [0.7] * max(1, self.k_hi)
        self.prior = (prior + [prior[-1]] * self.k_hi)[: max(1, self.k_hi)]
        self._last_batch: int | None = None
        self.reset_online()

    # -- load-time precomputation -------------------------------------------------------------

    def _plan_for(self, row: Row, batch: int, k: int) -> Plan | None:
        budget = row_budget(row, batch, k)
        tier = smallest_tier(self.tiers, batch + budget)
        if tier is None:
            return None
        return Plan(k if budget > 0 else 0, budget, tier)

    def _build_lookup(self) -> None:
        # _plans[b][k]: Plan for batch b when its row runs draft length k (None: does not fit)
        self._row_of: list[int] = [0] * (self.max_batch + 1)
        self._plans: list[list[Plan | None]] = [[]]
        for r, row in enumerate(self.policy.rows):
            lo, hi = row.batch
            for b in range(lo, hi + 1):
                self._row_of[b] = r
                ks = range(self.k_hi + 1) if row.k > 0 else range(1)
                self._plans.append([self._plan_for(row, b, k) for k in ks])
        self.cur_k: list[int] = [row.k for row in self.policy.rows]

    # -- per step -------------------------------------------------------------------------------

    def plan(self, batch_size: int) -> Plan:
        self._last_batch = batch_size
        if 0 < batch_size <= self.max_batch:
            p = self._plans[batch_size][self.cur_k[self._row_of[batch_size]]]
            if p is not None:
                return p
        return self._plan_outside(batch_size)

    def _plan_outside(self, batch_size: int) -> Plan:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.clamped += 1
        row = self.policy.rows[-1]
        k = self.cur_k[-1]
        budget = max(0, min(row_budget(row, batch_size, k), self.tiers[-1] - batch_size))
        tier = smallest_tier(self.tiers, batch_size + budget)
        if tier is None:
            self.uncaptured += 1
            return Plan(0, 0, None)
        return Plan(k if budget > 0 else 0, budget, tier)

    def observe(self, accepted_per_pos: Any, offered_per_pos: Any) -> None:
        acc = _host_list(accepted_per_pos)
        off = _host_list(offered_per_pos)
        keep = 1.0 - self.policy.online.ema
        n = len(self.prior)
        for i in range(n):
            tested = off[i] if i < len(off) else 0.0
            self._acc[i] = keep * self._acc[i] + (min(acc[i], tested) if i < len(acc) else 0.0)
            self._off[i] = keep * self._off[i] + tested
        # pooled drift of the whole curve, then per position: (A_i + m * prior_i * rho) / (O_i + m)
        expect = sum(o * p for o, p in zip(self._off, self.prior, strict=True))
        self.drift = sum(self._acc) / expect if expect > 0 else 1.0
        for i in range(n):
            base = min(1.0, self.prior[i] * self.drift)
            self.ema[i] = (self._acc[i] + SHRINK * base) / (self._off[i] + SHRINK)
        self._correct_k()

    @property
    def evidence(self) -> float:
        """Tested first-position drafts in the EMA (count-weighted)."""
        return self._off[0] if self._off else 0.0

    def _best_k(self, batch: int, rates: Sequence[float]) -> tuple[int, dict[int, float]]:
        options = self._plans[batch]
        g = {k: self._goodput(batch, p, rates) for k, p in enumerate(options)
             if p is not None and self.k_lo <= k <= self.k_hi and p.k == k}
        return (max(g, key=lambda k: g[k]) if g else -1), g

    def _correct_k(self) -> None:
        b = self._last_batch
        if b is None or not 0 < b <= self.max_batch:
            return
        r = self._row_of[b]
        row_k = self.policy.rows[r].k
        if row_k == 0:
            return  # the table says drafting does not pay here; no statistics to correct from
        online = self.policy.online
        if self.evidence < online.min_evidence:
            self.cur_k[r] = row_k
            return
        if b not in self._prior_best:
            self._prior_best[b] = self._best_k(b, self.prior)[0]
        best_now, g = self._best_k(b, self.ema)
        if best_now < 0:
            return
        want = min(self.k_hi, max(self.k_lo, row_k + best_now - self._prior_best[b]))
        while want not in g and want > self.k_lo:
            want -= 1
        if want not in g:
            return
        # leave the table's K only for a predicted gain above the hysteresis
        base = g.get(row_k)
        moves = want != row_k and (base is None or g[want] > base * (1.0 + online.hysteresis))
        self.cur_k[r] = want if moves else row_k

    def _goodput(self, batch: int, p: Plan, rates: Sequence[float]) -> float:
        assert p.tier is not None
        tokens = expected_tokens_uniform(rates, batch, p.verify_budget)
        return tokens / step_ms(self.cost, batch, p.k, p.tier)

    def reset_online(self) -> None:
        self.cur_k = [row.k for row in self.policy.rows]
        self.ema = list(self.prior)  # estimated conditional rates per position
        self.drift = 1.0
        self._acc: list[float] = [0.0] * len(self.prior)  # count-weighted EMA sums of accepted drafts
        self._off: list[float] = [0.0] * len(self.prior)  # ... and of tested drafts
        self._prior_best: dict[int, int] = {}


def _host_list(x: Any) -> list[float]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [float(v) for v in x]


def current_gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def check_gpu(table: Table, *, on_gpu_mismatch: OnMismatch = "warn", gpu_name: str | None = None,
              file: str | os.PathLike[str] | None = None) -> None:
    if on_gpu_mismatch == "ignore":
        return
    current = gpu_name if gpu_name is not None else current_gpu_name()
    if current is None:
        return  # no GPU to compare with (CPU simulation)
    if current.strip().lower() == table.hardware.gpu.strip().lower():
        return
    where = f"{file}: " if file is not None else ""
    msg = f"{where}hardware.gpu: table measured on {table.hardware.gpu!r}, this GPU is {current!r}"
    if on_gpu_mismatch == "refuse":
        raise PolicyMismatch(msg)
    warnings.warn(msg, PolicyMismatchWarning, stacklevel=3)


def load(path: str | os.PathLike[str], *, on_gpu_mismatch: OnMismatch = "warn",
         gpu_name: str | None = None) -> Planner:
    """Read and validate a policy table, check its GPU, and build the planner."""
    if on_gpu_mismatch not in ("warn", "refuse", "ignore"):
        raise ValueError(f"on_gpu_mismatch must be warn, refuse or ignore, got {on_gpu_mismatch!r}")
    table = read_table(path)
    if table.policy is None:
        raise TableError("policy", "missing: this is a cost-only profile (run `spectune tune`)", path)
    check_gpu(table, on_gpu_mismatch=on_gpu_mismatch, gpu_name=gpu_name, file=path)
    return Planner(table, file=path)
