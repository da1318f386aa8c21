"""What every engine export shares: a policy's rows as a *schedule* of inclusive ``(lo, hi, k)``
batch-size ranges covering 1..max_batch (adjacent ranges with the same K merged), our rules for it,
and the error every engine format raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spectune.errors import SpectuneError
from spectune.runtime.table import Table

Range = tuple[int, int, int]  # (lo, hi, k), inclusive batch sizes


class ExportError(SpectuneError):
    """A policy cannot be expressed in, or a config breaks the rules of, an engine's format."""


# ---------------------------------------------------------------------------------------------
# schedule


def schedule_from_rows(rows: Sequence[Any]) -> list[Range]:
    """Policy rows (``batch=[lo, hi]``, ``k``) -> merged contiguous schedule."""
    out: list[Range] = []
    for row in rows:
        lo, hi = row.batch
        if out and out[-1][2] == row.k and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi, row.k)
        else:
            out.append((lo, hi, row.k))
    check_schedule(out, "policy.rows")
    return out


def schedule_from_table(table: Table, file: str = "policy", top: int | None = None) -> list[Range]:
    """The rows' schedule; with ``top`` past the rows' last batch size, also the K the runtime
    planner runs there with no row (``Planner.uniform_k``: the last row's K while the cost model
    says it beats plain decoding, cut to the largest tier), so an engine that serves larger
    batches runs what ``spectune simulate`` and the runtime predict, not a K the table never chose."""
    if table.policy is None:
        raise ExportError(f"{file}: has no policy section (a cost-only profile); run `spectune tune` first")
    out = schedule_from_rows(table.policy.rows)
    last = out[-1][1]
    if top is not None and top > last:
        from spectune.runtime.planner import Planner

        planner = Planner(table)
        for b in range(last + 1, top + 1):
            k = planner.uniform_k(b)
            if out[-1][2] == k:
                out[-1] = (out[-1][0], b, k)
            else:
                out.append((b, b, k))
    return out


def check_schedule(schedule: Sequence[Range], where: str) -> None:
    """Our rules, common to every format: ranges from 1, ascending, no gap or overlap, K >= 0."""
    if not schedule:
        raise ExportError(f"{where}: empty schedule")
    expect = 1
    for i, (lo, hi, k) in enumerate(schedule):
        for name, v in (("lo", lo), ("hi", hi), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ExportError(f"{where}[{i}]: {name} must be an integer, got {v!r}")
        if not 1 <= lo <= hi:
            raise ExportError(f"{where}[{i}]: range [{lo}, {hi}] must have 1 <= lo <= hi")
        if lo != expect:
            what = "gap" if lo > expect else "overlap"
            raise ExportError(f"{where}[{i}]: {what}: range starts at {lo}, expected {expect}")
        if k < 0:
            raise ExportError(f"{where}[{i}]: K must be >= 0, got {k}")
        expect = hi + 1
    if max(k for _, _, k in schedule) == 0:
        raise ExportError(f"{where}: K is 0 everywhere; run the engine without speculative decoding")


def int_field(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExportError(f"{where}: must be an integer, got {value!r}")
    return value


def positive_field(cfg: dict[str, Any], key: str, where: str) -> int:
    # the engine's required largest draft length, a positive integer
    if key not in cfg:
        raise ExportError(f"{where}: missing")
    max_k = int_field(cfg[key], where)
    if max_k <= 0:
        raise ExportError(f"{where}: must be > 0, got {max_k}")
    return max_k
