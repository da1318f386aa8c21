"""Tuner: profile table + acceptance -> policy table (search, then Monte-Carlo confirmation)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spectune.autotune.acceptance import AcceptanceModel, default_acceptance, load_acceptance
from spectune.autotune.search import Objective, SearchResult, search_policy
from spectune.autotune.simulator import FixedK, SimResult, simulate
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Planner
from spectune.runtime.schema import SpectuneError
from spectune.runtime.table import Table

DEFAULT_TRIALS = 40


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


def resolve_acceptance(acceptance: str | AcceptanceModel | None, max_k: int) -> AcceptanceModel:
    if acceptance is None:
        return default_acceptance(max_k)
    if isinstance(acceptance, str):
        return load_acceptance(acceptance, max_k=max_k)
    return acceptance


def cost_model(profile: Table) -> CostModel:
    return CostModel(profile.costs.model, profile.workload.drafter_kind, profile.workload.context_len)


def confirm_policy(table: Table, acceptance: AcceptanceModel, concurrencies: list[int], *,
                   steps: int = 300, seed: int = 0) -> list[Confirmation]:
    """Simulate the policy (through the real Planner), plain and every fixed K at each concurrency."""
    cost = cost_model(table)
    out = []
    for b in concurrencies:
        planner = Planner(table)
        pol = simulate(cost, acceptance, planner, concurrency=b, steps=steps, seed=seed)
        fixed = {k: simulate(cost, acceptance, FixedK(k), concurrency=b, steps=steps, seed=seed)
                 for k in range(table.workload.max_k + 1)}
        best = max(range(1, table.workload.max_k + 1), key=lambda k: fixed[k].goodput_tok_s, default=0)
        out.append(Confirmation(b, pol, fixed[0], best, fixed[best]))
    return out


def tune(profile: Table, acceptance: str | AcceptanceModel | None, *, objective: Objective = "goodput",
         capture_budget_mib: float | None = None, capture_seconds: float | None = None,
         latency_bound_ms: float | None = None, trials: int = DEFAULT_TRIALS, seed: int = 0,
         pareto: bool = False, max_batch: int | None = None, confirm: bool = False) -> TuneResult:
    w = profile.workload
    max_batch = w.max_batch if max_batch is None else max_batch
    if max_batch < 1:
        raise SpectuneError(f"max_batch: must be >= 1, got {max_batch}")
    if w.max_k < 1:
        raise SpectuneError("workload.max_k: must be >= 1 to tune speculative decoding")
    model = resolve_acceptance(acceptance, w.max_k)
    result = search_policy(
        cost_model(profile), model, max_batch=max_batch, max_k=w.max_k, capture=profile.costs.capture,
        objective=objective, capture_budget_mib=capture_budget_mib, capture_seconds=capture_seconds,
        latency_bound_ms=latency_bound_ms, trials=trials, seed=seed, pareto=pareto,
    )
    table = dataclasses.replace(
        profile,
        workload=dataclasses.replace(w, max_batch=max_batch),
        acceptance=model.to_dict(),
        policy=result.policy,
    )
    checks = []
    if confirm:
        picks = sorted({1, max(1, max_batch // 4), max_batch})
        checks = confirm_policy(table, model, picks, seed=seed)
    return TuneResult(table, result, model, checks)


def tune_table(profile: Table, acceptance: str | AcceptanceModel | None, *, objective: Objective = "goodput",
               capture_budget_mib: float | None = None, capture_seconds: float | None = None,
               latency_bound_ms: float | None = None, trials: int = DEFAULT_TRIALS, seed: int = 0,
               pareto: bool = False) -> Table:
    """A new Table: the profile plus ``acceptance`` (what it was tuned on) and ``policy``."""
    return tune(profile, acceptance, objective=objective, capture_budget_mib=capture_budget_mib,
                capture_seconds=capture_seconds, latency_bound_ms=latency_bound_ms, trials=trials,
                seed=seed, pareto=pareto).table
