"""Tuner: profile table + acceptance -> policy table (search, then Monte-Carlo confirmation)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from spectune.autotune.acceptance import AcceptanceModel, resolve_acceptance
from spectune.autotune.feasibility import Feasibility
from spectune.autotune.policy_search import (
    DEFAULT_SMOOTH,
    Objective,
    Progress,
    SearchResult,
    search_policy,
    tier_universe,
)
from spectune.autotune.simulator import FixedK, SimResult, simulate
from spectune.errors import SpectuneError, TableError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Plan, Planner, smallest_tier, step_ms
from spectune.runtime.table import MAX_BATCH, MAX_CONTEXT, Table

DEFAULT_TRIALS = 40
# online correction grid and drift scenarios (live acceptance = tuned-on rates x scale)
ONLINE_GRID = {"window": (64.0, 256.0, 1024.0), "margin": (0.0, 0.01, 0.03), "min_evidence": (8.0, 32.0, 128.0)}
DRIFT_SCALES = (1.0, 0.6, 1.2)
STATIONARY_FLOOR = 0.99  # stationary goodput with online correction >= this x the table alone


@dataclass(frozen=True)
class Confirmation:
    """Monte-Carlo check of the tuned policy at one concurrency."""

    concurrency: int
    policy: SimResult
    plain: SimResult
    best_fixed_k: int
    best_fixed: SimResult


@dataclass(frozen=True)
class TuneResult:
    table: Table
    search: SearchResult
    acceptance: AcceptanceModel
    confirm: list[Confirmation]
    online: OnlineSearch | None = None
    batch_cap: int | None = None  # max_batch lowered to this: the profile ran out of memory past it
    dropped_tiers: tuple[int, ...] = ()  # candidate tiers left out: a step the profile could not fit


@dataclass(frozen=True)
class OnlineSearch:
    """Online-correction settings picked by simulated goodput under drift."""

    window: float
    margin: float
    min_evidence: float
    ratios: dict[tuple[float, int], float]  # (scale, concurrency) -> goodput / table alone
    stationary: float  # worst stationary ratio over concurrencies
    evaluated: int  # grid points simulated


class _TableAlone:
    """The planner without online correction (no ``observe``)."""

    def __init__(self, table: Table):
        self.planner = Planner(table)

    def plan(self, batch_size: int) -> Plan:
        return self.planner.plan(batch_size)


def search_online(table: Table, acceptance: AcceptanceModel, concurrencies: Sequence[int], *,
                  scales: Sequence[float] = DRIFT_SCALES, steps: int = 400, seed: int = 0,
                  mean_output_tokens: float = 256.0) -> OnlineSearch:
    """Grid search of (window, margin, min_evidence) by Monte-Carlo goodput relative to the table
    alone, over drift ``scales`` x ``concurrencies`` (common random numbers: one seed for every
    arm). Score: geometric mean of the ratios; a grid point whose stationary ratio (scale 1) falls
    below STATIONARY_FLOOR at some concurrency is out. Ties keep the table's current settings."""
    if table.policy is None:
        raise SpectuneError("policy: missing, search_online needs a tuned table")
    if 1.0 not in scales:
        raise SpectuneError("scales: must include 1.0 (the stationary case)")
    cost, policy = cost_model(table), table.policy

    def goodput(fn: Planner | _TableAlone, scale: float, b: int) -> float:
        return simulate(cost, acceptance, fn, concurrency=b, steps=steps, seed=seed, accept_scale=scale,
                        mean_output_tokens=mean_output_tokens).goodput_tok_s

    cases = [(s, b) for s in scales for b in concurrencies]
    alone = {c: goodput(_TableAlone(table), *c) for c in cases}
    current = (policy.online.window, policy.online.margin, policy.online.min_evidence)
    points = [current, *(p for p in itertools.product(*ONLINE_GRID.values()) if p != current)]
    best: OnlineSearch | None = None
    fallback: OnlineSearch | None = None
    best_score = -math.inf
    for window, margin, evidence in points:
        online = dataclasses.replace(policy.online, window=window, margin=margin, min_evidence=evidence)
        trial = dataclasses.replace(table, policy=dataclasses.replace(policy, online=online))
        ratios = {c: goodput(Planner(trial), *c) / alone[c] for c in cases}
        stationary = min(r for (s, _), r in ratios.items() if s == 1.0)
        score = sum(math.log(r) for r in ratios.values()) / len(ratios)
        if stationary >= STATIONARY_FLOOR and score > best_score + 1e-9:
            best_score = score
            best = OnlineSearch(window, margin, evidence, ratios, stationary, len(points))
        if fallback is None or stationary > fallback.stationary:
            fallback = OnlineSearch(window, margin, evidence, ratios, stationary, len(points))
    # no point keeps the floor: the one that loses least on stationary traffic (reported as such)
    assert fallback is not None
    return best if best is not None else fallback


def cost_model(profile: Table) -> CostModel:
    return CostModel.of(profile)


def confirm_policy(table: Table, acceptance: AcceptanceModel, concurrencies: list[int], *,
                   steps: int = 300, seed: int = 0) -> list[Confirmation]:
    """Simulate the policy (through the real Planner), plain and every fixed K at each concurrency."""
    cost = cost_model(table)
    out = []
    built = Planner(table)
    for b in concurrencies:
        planner = built.fresh()
        pol = simulate(cost, acceptance, planner, concurrency=b, steps=steps, seed=seed)
        fixed = {k: simulate(cost, acceptance, FixedK(k), concurrency=b, steps=steps, seed=seed)
                 for k in range(table.workload.max_k + 1)}
        best = max(range(1, table.workload.max_k + 1), key=lambda k: fixed[k].goodput_tok_s, default=0)
        out.append(Confirmation(b, pol, fixed[0], best, fixed[best]))
    return out


def tune(profile: Table, acceptance: str | AcceptanceModel | None, *, objective: Objective = "goodput",
         capture_budget_mib: float | None = None, capture_seconds: float | None = None,
         latency_bound_ms: float | None = None, trials: int = DEFAULT_TRIALS, seed: int = 0,
         pareto: bool = False, max_batch: int | None = None, confirm: bool = False,
         smooth: float = DEFAULT_SMOOTH, online: bool = False, context_len: int | None = None,
         progress: Progress | None = None) -> TuneResult:
    """Search the policy; ``online`` also picks the online-correction settings by simulated drift
    (``search_online`` at concurrencies 1, max_batch / 4 and max_batch) and stores them.
    ``context_len``: mean context of the traffic to serve (default: the profile's); the KV read
    grows with it, so the best K at a batch size does too. ``progress(done, total)`` is called as
    the operating grid is built (its longest phase). Every argument is checked before any work."""
    w = profile.workload
    max_batch = w.max_batch if max_batch is None else max_batch
    check_tune_args(max_batch=max_batch, context_len=context_len, trials=trials, smooth=smooth,
                    latency_bound_ms=latency_bound_ms, capture_budget_mib=capture_budget_mib,
                    capture_seconds=capture_seconds)
    if w.max_k < 1:
        raise TableError("workload.max_k", f"must be >= 1 to tune speculative decoding, got {w.max_k}")
    model = resolve_acceptance(acceptance, w.max_k)
    requested = max_batch
    feas = Feasibility.of(profile.costs.points).at_context(w.context_len, context_len)
    max_batch, universe, dropped = feasible_shapes(profile, max_batch, feas)
    cost = cost_model(profile)
    if context_len is not None:
        cost = dataclasses.replace(cost, context_len=context_len)
    if latency_bound_ms is not None and objective == "latency":
        fastest = step_ms(cost, 1, 0, 1)
        if latency_bound_ms < fastest:
            raise SpectuneError(f"latency_bound_ms: {latency_bound_ms:g} ms is below the fastest step of this "
                                f"profile (plain decoding at batch 1: {fastest:.3g} ms); no policy can meet it")
    result = search_policy(
        cost, model, max_batch=max_batch, max_k=w.max_k, capture=profile.costs.capture,
        objective=objective, capture_budget_mib=capture_budget_mib, capture_seconds=capture_seconds,
        latency_bound_ms=latency_bound_ms, trials=trials, seed=seed, pareto=pareto, smooth=smooth,
        progress=progress, universe=universe, fits=feas.fits,
    )
    table = dataclasses.replace(
        profile,
        workload=dataclasses.replace(w, max_batch=max_batch),
        acceptance=model.to_dict(),
        policy=dataclasses.replace(result.policy, context_len=context_len),
    )
    picked = None
    if online and table.policy is not None:
        picked = search_online(table, model, sorted({1, max(1, max_batch // 4), max_batch}), seed=seed)
        tuned = dataclasses.replace(table.policy.online, window=picked.window, margin=picked.margin,
                                    min_evidence=picked.min_evidence)
        table = dataclasses.replace(table, policy=dataclasses.replace(table.policy, online=tuned))
    checks = []
    if confirm:
        picks = sorted({1, max(1, max_batch // 4), max_batch})
        checks = confirm_policy(table, model, picks, seed=seed)
    return TuneResult(table, result, model, checks, picked, max_batch if max_batch < requested else None, dropped)


def feasible_shapes(profile: Table, max_batch: int,
                    feas: Feasibility | None = None) -> tuple[int, list[int], tuple[int, ...]]:
    """(max_batch, candidate tiers, tiers left out) after the profile's out-of-memory points
    (:mod:`spectune.autotune.feasibility`; ``feas``: those limits at the tuned context, default
    the profile's): the cap lowered until plain decoding has a tier."""
    feas = Feasibility.of(profile.costs.points) if feas is None else feas
    cap = feas.batch_cap(max_batch)
    full = tier_universe(cap, profile.workload.max_k)
    universe = feas.tiers(full, cap)
    while smallest_tier(universe, cap) is None and cap > 1:
        cap -= 1
        full = tier_universe(cap, profile.workload.max_k)
        universe = feas.tiers(full, cap)
    if smallest_tier(universe, cap) is None:
        raise SpectuneError("costs.points: no tier fits plain decoding at batch 1 (out of memory); nothing to tune")
    return cap, universe, tuple(t for t in full if t not in universe)


def check_tune_args(*, max_batch: int, context_len: int | None, trials: int, smooth: float,
                    latency_bound_ms: float | None, capture_budget_mib: float | None,
                    capture_seconds: float | None) -> None:
    """Ranges of tune's arguments (the CLI's types check the same; this guards library callers)."""
    if not 1 <= max_batch <= MAX_BATCH:
        raise SpectuneError(f"max_batch: must be in 1..{MAX_BATCH} (MAX_BATCH), got {max_batch}")
    if context_len is not None and not 1 <= context_len <= MAX_CONTEXT:
        raise SpectuneError(f"context_len: must be in 1..{MAX_CONTEXT}, got {context_len}")
    if trials < 1:
        raise SpectuneError(f"trials: must be >= 1, got {trials}")
    if not 0.0 <= smooth < 1.0:
        raise SpectuneError(f"smooth: must be in [0, 1), got {smooth}")
    for name, v in (("latency_bound_ms", latency_bound_ms), ("capture_budget_mib", capture_budget_mib),
                    ("capture_seconds", capture_seconds)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise SpectuneError(f"{name}: must be a finite number > 0, got {v}")


def tune_table(profile: Table, acceptance: str | AcceptanceModel | None, *, objective: Objective = "goodput",
               capture_budget_mib: float | None = None, capture_seconds: float | None = None,
               latency_bound_ms: float | None = None, trials: int = DEFAULT_TRIALS, seed: int = 0,
               pareto: bool = False) -> Table:
    """A new Table: the profile plus ``acceptance`` (what it was tuned on) and ``policy``."""
    return tune(profile, acceptance, objective=objective, capture_budget_mib=capture_budget_mib,
                capture_seconds=capture_seconds, latency_bound_ms=latency_bound_ms, trials=trials,
                seed=seed, pareto=pareto).table
