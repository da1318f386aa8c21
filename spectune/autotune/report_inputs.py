"""Inputs of ``spectune report``: bench results JSON (``header`` + ``rows``), ``spectune simulate
--json`` output (``rows`` and the simulation's settings, no header), simulation JSON of
``benchmarks/sim_policy_vs_fixed.py`` (scenarios of plain / fixed K / policy goodput) and profile
or policy YAML tables. Optional row fields may be missing; a malformed file raises
:class:`ReportError` naming the file and the field.

Words: an *arm* is one serving configuration of a bench (``plain``, ``fixed:K``, ``auto``); arms
named ``auto*`` run the policy, every other arm is a baseline.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from spectune.errors import SpectuneError, TableError
from spectune.runtime.schema import from_dict
from spectune.runtime.table import Table, read_table

BENIGN_THROTTLE = frozenset({"", "none", "idle", "gpu_idle"})
HEADER_ORDER = ("gpu", "driver", "date", "policy", "target", "drafter")


class ReportError(SpectuneError):
    """A report input is malformed; names the file and the field (``rows[3].output_tok_s``)."""

    def __init__(self, file: str | os.PathLike[str], field: str, reason: str):
        self.file, self.field, self.reason = str(file), field, reason
        super().__init__(f"{self.file}: {field}: {reason}" if field else f"{self.file}: {reason}")



@dataclass(frozen=True)
class BenchRow:
    """One (concurrency, arm) measurement; every field past ``output_tok_s`` is optional, and
    ``output_tok_s`` may be null (not measured) where ``decode_tok_s`` is given."""

    concurrency: int
    arm: str  # "plain" | "fixed:K" | "auto" | ...
    output_tok_s: float | None  # end to end: emitted tokens per second over all requests
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    ttft_ms: float | None = None
    mean_accept_len: float | None = None  # bonus token included
    k_hist: dict[str, int] | None = None  # "K" -> steps run with that K
    power_w: float | None = None
    joules_per_token: float | None = None
    sm_clock_mhz: int | None = None
    throttle_reasons: list[str] | None = None
    completed: int | None = None
    failed: int | None = None
    mismatches: int | None = None  # greedy outputs differing from plain greedy decoding
    predicted_tok_s: float | None = None  # simulator prediction for this point
    itl_ms: list[float] | None = None  # sample of per-token latencies
    decode_tok_s: float | None = None  # decode/verify steps only (prefill and admission left out)
    mean_accept_len_clean: float | None = None  # steps before each request's divergence only
    near_tie_mismatches: int | None = None  # mismatches at a plain near tie (numerical)
    hard_mismatches: int | None = None  # mismatches with a clear plain margin (a defect)
    diverged_requests: int | None = None
    predicted_tok_s_at_measured_accept: float | None = None  # simulator at the measured acceptance
    prediction_error: float | None = None  # decode_tok_s / predicted_tok_s - 1
    timed_out: bool | None = None  # the run stopped at the bench's time limit
    repeat: int | None = None  # which of the interleaved repeats of (concurrency, arm)

    def validate(self, path: str) -> None:
        if self.concurrency < 1:
            raise TableError(f"{path}.concurrency", f"must be >= 1, got {self.concurrency}")
        if not self.arm:
            raise TableError(f"{path}.arm", "must not be empty")
        if self.output_tok_s is None and self.decode_tok_s is None:  # a row needs some throughput
            raise TableError(f"{path}.output_tok_s", "must not be null (unless decode_tok_s is given)")
        for name in ("output_tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_ms", "mean_accept_len", "power_w",
                     "joules_per_token", "predicted_tok_s", "decode_tok_s", "mean_accept_len_clean",
                     "predicted_tok_s_at_measured_accept"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise TableError(f"{path}.{name}", f"must be a finite number >= 0, got {v!r}")
        if self.prediction_error is not None and not math.isfinite(self.prediction_error):
            raise TableError(f"{path}.prediction_error", f"must be a finite number, got {self.prediction_error!r}")
        for name in ("completed", "failed", "mismatches", "near_tie_mismatches", "hard_mismatches",
                     "diverged_requests"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise TableError(f"{path}.{name}", f"must be >= 0, got {v}")
        for key, n in (self.k_hist or {}).items():
            if not key.isdigit():
                raise TableError(f"{path}.k_hist.{key}", "keys must be draft lengths K >= 0")
            if n < 0:
                raise TableError(f"{path}.k_hist.{key}", f"must be >= 0, got {n}")
        if self.itl_ms is not None and not all(math.isfinite(x) and x >= 0 for x in self.itl_ms):
            raise TableError(f"{path}.itl_ms", "must hold finite numbers >= 0")

    @property
    def k_counts(self) -> dict[int, int]:
        return {int(k): n for k, n in (self.k_hist or {}).items() if n > 0}

    @property
    def bad_throttle(self) -> list[str]:
        return [r for r in self.throttle_reasons or [] if r.strip().lower() not in BENIGN_THROTTLE]


@dataclass(frozen=True)
class ResultSet:
    """Rows of one bench file, or of one scenario of a simulation file."""

    name: str  # section title
    slug: str  # prefix of this set's plot files
    file: str
    kind: Literal["bench", "sim"]
    header: dict[str, str]
    rows: tuple[BenchRow, ...]

    @property
    def arms(self) -> list[str]:
        return sorted({r.arm for r in self.rows}, key=arm_order)

    @property
    def concurrencies(self) -> list[int]:
        return sorted({r.concurrency for r in self.rows})

    def get(self, concurrency: int, arm: str) -> BenchRow | None:
        return next((r for r in self.rows if r.concurrency == concurrency and r.arm == arm), None)


@dataclass(frozen=True)
class TableInput:
    name: str
    slug: str
    file: str
    table: Table


@dataclass(frozen=True)
class Inputs:
    results: tuple[ResultSet, ...]
    tables: tuple[TableInput, ...]


@dataclass(frozen=True)
class _SimRow:  # one concurrency of a sim_policy_vs_fixed.py scenario
    concurrency: int
    plain: float
    fixed: dict[str, float]  # "K" -> simulated goodput tok/s
    policy: float
    best_k: int | None = None
    policy_uniform_alloc: float | None = None


def arm_order(arm: str) -> tuple[int, int, str]:
    # plain, fixed:K by K, other baselines, then the policy arms
    if arm == "plain":
        return (0, 0, arm)
    m = re.fullmatch(r"fixed:(\d+)", arm)
    if m:
        return (1, int(m.group(1)), arm)
    return (3, 0, arm) if arm.startswith("auto") else (2, 0, arm)


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    # bench files may grow fields: keep those this report reads, ignore the rest
    names = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return {k: v for k, v in data.items() if k in names}


def _bench_rows(rows: Any, file: str, prefix: str = "rows") -> tuple[BenchRow, ...]:
    if not isinstance(rows, list) or not rows:
        raise ReportError(file, prefix, "must be a non-empty list")
    out: list[BenchRow] = []
    seen: set[tuple[int, str, int | None]] = set()
    for i, row in enumerate(rows):
        path = f"{prefix}[{i}]"
        if not isinstance(row, dict):
            raise ReportError(file, path, f"must be a mapping, got {type(row).__name__}")
        if "goodput_tok_s" in row and "output_tok_s" not in row:  # older simulate output
            row = {**row, "output_tok_s": row["goodput_tok_s"]}
        elif "goodput_tok_s" in row and row.get("decode_tok_s") is None:
            # simulate: goodput is decode tokens over step time (the bench's decode_tok_s);
            # output_tok_s is end to end, null without --prompt-len
            row = {**row, "decode_tok_s": row["goodput_tok_s"]}
        try:
            r = from_dict(BenchRow, _known(BenchRow, row), path)
        except TableError as exc:
            raise ReportError(file, exc.field, exc.reason) from None
        if (r.concurrency, r.arm, r.repeat) in seen:
            what = f", repeat {r.repeat}" if r.repeat is not None else ""
            raise ReportError(file, path, f"duplicate row for concurrency {r.concurrency}, arm {r.arm!r}{what}")
        seen.add((r.concurrency, r.arm, r.repeat))
        out.append(r)
    return _merge_repeats(out)


_SUMMED = ("completed", "failed", "mismatches", "near_tie_mismatches", "hard_mismatches", "diverged_requests")


def _merge_repeats(rows: list[BenchRow]) -> tuple[BenchRow, ...]:
    """One row per (concurrency, arm): the repeats' mean of every measured number (counts
    summed, k_hist and latency samples pooled, timed out if any repeat was)."""
    groups: dict[tuple[int, str], list[BenchRow]] = {}
    for r in rows:
        groups.setdefault((r.concurrency, r.arm), []).append(r)
    merged = []
    for grp in groups.values():
        if len(grp) == 1:
            merged.append(grp[0])
            continue
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(BenchRow):
            vals = [getattr(r, f.name) for r in grp if getattr(r, f.name) is not None]
            if f.name in ("concurrency", "arm", "throttle_reasons") or not vals:
                continue
            if f.name in _SUMMED:
                fields[f.name] = sum(vals)
            elif f.name == "k_hist":
                hist: dict[str, int] = {}
                for h in vals:
                    for k, n in h.items():
                        hist[k] = hist.get(k, 0) + n
                fields[f.name] = hist
            elif f.name == "itl_ms":
                fields[f.name] = [x for v in vals for x in v]
            elif f.name == "timed_out":
                fields[f.name] = any(vals)
            elif isinstance(vals[0], int | float) and not isinstance(vals[0], bool):
                mean = sum(vals) / len(vals)
                fields[f.name] = round(mean) if isinstance(vals[0], int) else mean
        fields["repeat"] = None
        merged.append(dataclasses.replace(grp[0], **fields))
    return tuple(merged)


def _header(data: Any, file: str) -> dict[str, str]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ReportError(file, "header", f"must be a mapping, got {type(data).__name__}")
    head = {str(k): v for k, v in data.items() if v is not None and not isinstance(v, dict | list)}
    order = [k for k in HEADER_ORDER if k in head] + [k for k in head if k not in HEADER_ORDER]
    return {k: str(head[k]) for k in order}


def _sim_sets(data: dict[str, Any], file: str, stem: str) -> list[ResultSet]:
    header = {k: str(data[k]) for k in ("profile", "acceptance") if isinstance(data.get(k), str)}
    sets = []
    for scenario, rows in data.items():
        rows = _scenario_rows(rows)
        if not (isinstance(rows, list) and rows and isinstance(rows[0], dict) and "policy" in rows[0]):
            continue
        parsed: list[_SimRow] = []
        for i, row in enumerate(rows):
            try:
                parsed.append(from_dict(_SimRow, _known(_SimRow, row), f"{scenario}[{i}]"))
            except TableError as exc:
                raise ReportError(file, exc.field, exc.reason) from None
        # show the fixed K that is best at some concurrency: the contenders of each row
        best = {r.best_k if r.best_k is not None else int(max(r.fixed, key=lambda k: r.fixed[k]))
                for r in parsed}
        bench: list[dict[str, Any]] = []
        for r in parsed:
            bench += [{"concurrency": r.concurrency, "arm": "plain", "output_tok_s": r.plain},
                      {"concurrency": r.concurrency, "arm": "auto", "output_tok_s": r.policy}]
            bench += [{"concurrency": r.concurrency, "arm": f"fixed:{k}", "output_tok_s": r.fixed[str(k)]}
                      for k in sorted(best) if k > 0 and str(k) in r.fixed]
            if r.policy_uniform_alloc is not None:
                bench.append({"concurrency": r.concurrency, "arm": "auto:uniform",
                              "output_tok_s": r.policy_uniform_alloc})
        sets.append(ResultSet(f"Simulation: {scenario} ({Path(file).name})", f"{stem}_{scenario}", file, "sim",
                              header, _bench_rows(bench, file, scenario)))
    if not sets:
        raise ReportError(file, "", "not a results file: needs 'rows' (bench) or scenario lists with "
                                    "'concurrency', 'plain', 'fixed', 'policy' (simulation)")
    return sets


def _scenario_rows(value: Any) -> Any:
    """A scenario of sim_policy_vs_fixed.py as rows of ``_SimRow`` fields. The script writes
    ``{"source", "rows": [{"concurrency", "analytic": {...}, "monte_carlo": {plain, fixed, policy,
    best_k, uniform, ...}}]}``; the Monte-Carlo arms are what the report shows (older files: a
    plain list of such rows)."""
    if isinstance(value, dict) and isinstance(value.get("rows"), list):
        value = value["rows"]
    if not isinstance(value, list):
        return value
    out = []
    for row in value:
        if isinstance(row, dict) and isinstance(row.get("monte_carlo"), dict):
            mc = row["monte_carlo"]
            row = {"concurrency": row.get("concurrency"), **{k: mc[k] for k in ("plain", "fixed", "policy", "best_k")
                                                               if k in mc}}
            if "uniform" in mc:
                row["policy_uniform_alloc"] = mc["uniform"]
        out.append(row)
    return out


def read_results(path: str | os.PathLike[str], stem: str | None = None) -> list[ResultSet]:
    """Bench results JSON -> one ResultSet; simulation JSON -> one per scenario."""
    file = str(path)
    stem = stem or _slug(Path(file).stem)
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportError(file, "", f"cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(file, "", f"not valid JSON at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise ReportError(file, "", "not UTF-8 text") from None
    if not isinstance(data, dict):
        raise ReportError(file, "", f"must be a JSON object, got {type(data).__name__}")
    if "rows" not in data:
        return _sim_sets(data, file, stem)
    if _is_simulate(data):  # its settings sit beside the rows: show them as the header
        header = _header({k: v for k, v in data.items() if k != "rows"}, file)
        kind: Literal["bench", "sim"] = "sim"
    else:
        header = _header(data.get("header"), file)
        kind = "sim" if str(header.get("kind", "")).startswith("sim") else "bench"
    title = "Bench" if kind == "bench" else "Simulation"
    return [ResultSet(f"{title}: {Path(file).name}", stem, file, kind, header, _bench_rows(data["rows"], file))]


def _is_simulate(data: dict[str, Any]) -> bool:
    """``spectune simulate --json``: rows of ``goodput_tok_s`` and no header (the bench writes a
    header and ``decode_tok_s``)."""
    rows = data.get("rows")
    return ("header" not in data and isinstance(rows, list)
            and any(isinstance(r, dict) and "goodput_tok_s" in r for r in rows))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_.") or "input"


def load_inputs(paths: Sequence[str | os.PathLike[str]]) -> Inputs:
    """Read every input; JSON is results, .yaml/.yml is a profile or policy table."""
    results: list[ResultSet] = []
    tables: list[TableInput] = []
    used: set[str] = set()
    for p in paths:
        path = Path(p)
        stem = _slug(path.stem)
        while stem in used:
            stem += "_"
        used.add(stem)
        if path.suffix.lower() in (".yaml", ".yml"):
            tables.append(TableInput(f"Table: {path.name}", stem, str(path), read_table(path)))
        elif path.suffix.lower() == ".json":
            results += read_results(path, stem)
        else:
            raise ReportError(path, "", "unknown input (expected results .json or a table .yaml)")
    return Inputs(tuple(results), tuple(tables))
