"""Hand-built tables for tests: cost parameters, workload, policy and the table around them.

Each builder fills what a test does not care about with plain defaults, so a test spells out only
the numbers its assertions depend on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from spectune.runtime.table import (
    SCHEMA,
    CostError,
    CostModelParams,
    Costs,
    DrafterCost,
    Hardware,
    Online,
    OverheadCost,
    Policy,
    PowerModel,
    Row,
    Software,
    Table,
    TargetCost,
    Workload,
)


def make_params(
    target: Sequence[float],  # (weight_ms, token_ms, knee_tokens, compute_ms, kv_ms_per_mtok[, kv_verify])
    drafter: Sequence[float],  # (fixed_ms, step_ms, token_ms[, kv_ms_per_mtok])
    overhead: Sequence[float],  # (base_ms, token_ms)
    power: Sequence[float] | None = None,  # (idle_w, busy_w, saturate_tokens)
) -> CostModelParams:
    return CostModelParams(TargetCost(*target), DrafterCost(*drafter), OverheadCost(*overhead),
                           None if power is None else PowerModel(*power))


def make_workload(max_k: int, max_batch: int, **fields: Any) -> Workload:
    """An autoregressive one-layer EAGLE drafter on qwen3-8b at 2048 context unless ``fields`` say otherwise."""
    base: dict[str, Any] = dict(target="qwen3-8b", drafter="eagle-1l", drafter_kind="autoregressive",
                                drafter_layers=1, dtype="bfloat16", context_len=2048)
    return Workload(**(base | fields), max_k=max_k, max_batch=max_batch)


def make_policy(tiers: Iterable[int], rows: Iterable[Row], **online: Any) -> Policy:
    """``online``: Online fields over their defaults."""
    return Policy(tiers=list(tiers), rows=list(rows), online=Online(**online))


def make_profile(
    params: CostModelParams,
    workload: Workload,
    *,
    hardware: Hardware | str = "cpu",
    software: Software | None = None,
    error: CostError | None = None,
    policy: Policy | None = None,
    acceptance: dict[str, Any] | None = None,
    created: str | None = None,
    **costs: Any,  # the other Costs fields: timer, capture, points, measurements
) -> Table:
    """A table as ``spectune profile`` writes it, with ``policy`` when given (a tuned table)."""
    return Table(
        schema=SCHEMA,
        hardware=Hardware(hardware) if isinstance(hardware, str) else hardware,
        software=software if software is not None else Software("0.1.0", "2.13"),
        workload=workload,
        costs=Costs(params, error if error is not None else CostError(1, 0.0, 0.0), **costs),
        acceptance=acceptance,
        policy=policy,
        created=created,
    )


def write_profile_like(policy_path, out, *, weight_factor: float = 1.0, target: str | None = None):
    """A cost-only profile of ``policy_path``'s table with the target's weight read scaled by
    ``weight_factor`` (and, given ``target``, another target name): a GPU whose step times the
    policy's cost model does not know (``--served-cost``)."""
    import dataclasses

    from spectune.runtime.table import read_table, write_table

    table = read_table(policy_path)
    t = table.costs.model.target
    model = dataclasses.replace(table.costs.model, target=dataclasses.replace(t, weight_ms=weight_factor * t.weight_ms))
    other = dataclasses.replace(table, costs=dataclasses.replace(table.costs, model=model), policy=None)
    if target is not None:
        other = dataclasses.replace(other, workload=dataclasses.replace(other.workload, target=target))
    write_table(other, out)
    return out
