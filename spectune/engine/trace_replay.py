"""A trace set prepared for token-by-token replay in the bench (``ReplayDrafter.load_tokens``).

``load_trace_replay(path, k)`` reads a per-step trace file (docs/TRACES.md) into per-request steps
(``spectune.models.trace_steps``) and, when every offered draft carries a ``conf``, calibrates the
confidences the allocation will see *cross-fitted*: request i (file order) is in split i % 2 (the
recorder's calibration / held-out rule), and each split's confidences go through per-position
tables (``acceptance_sources.position_tables``) fitted on the other split only -- every request
is replayed with a calibration that never saw it. Confidences are calibrated at their recorded
draft position (the position the drafter issued them for). ``calibration="raw"`` hands the
drafter's own numbers over unchanged.

``TraceReplay.tables(n, length, seed, repeat)``: replayed request i of a run plays the recorded
requests in a seeded order of the repeat, from position i on, end to end
(``trace_steps.token_tables``); ``rates`` are the set's population conditional rates, the prior a
history allocation starts from. What is exact and what is approximated: docs/BENCH_METHOD.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from spectune.autotune.acceptance_sources import position_tables
from spectune.autotune.allocation_replay import population_rates
from spectune.errors import SpectuneError
from spectune.models.specdecode import read_traces
from spectune.models.trace_steps import (
    RequestSteps,
    TokenTables,
    calibrated_by_position,
    request_steps,
    split,
    token_tables,
)

Calibration = Literal["cross-fitted", "raw"]
SPLITS = 2  # the recorder's prompt splits: request i is in split i % 2


class TraceReplayError(SpectuneError):
    """A trace set cannot be replayed token by token; the message names the file or field."""


@dataclass(frozen=True)
class TraceReplay:
    source: str  # file name
    requests: tuple[RequestSteps, ...]
    conf: tuple[np.ndarray, ...] | None  # per request [S, K], what the allocation sees; None: no conf
    rates: tuple[float, ...]  # [K] population conditional rates
    calibration: str  # how ``conf`` was made

    @property
    def has_conf(self) -> bool:
        return self.conf is not None

    def tables(self, n: int, length: int, seed: int, repeat: int) -> TokenTables:
        order = np.random.default_rng([seed, repeat]).permutation(len(self.requests)).tolist()
        return token_tables(self.requests, order, n, length, offset=1, conf=self.conf)

    def describe(self) -> str:
        steps = sum(len(r.offered) for r in self.requests)
        conf = f"confidences {self.calibration}" if self.has_conf else "no confidences"
        return f"token replay of {self.source} ({len(self.requests)} requests, {steps} steps, {conf})"


def is_trace_source(spec: str | None) -> bool:
    """The acceptance spec names a per-step trace file (the forms ``load_acceptance`` reads as traces)."""
    if spec is None:
        return False
    lower = spec.strip().lower()
    return lower.startswith("traces:") or lower.endswith((".jsonl", ".jsonl.gz"))


def _has_conf(requests: list[RequestSteps]) -> bool:
    offered = [np.arange(r.k)[None, :] < r.offered[:, None] for r in requests]
    drafted = sum(int(o.sum()) for o in offered)
    return drafted > 0 and all(not np.isnan(r.conf[o]).any() for r, o in zip(requests, offered, strict=True))


def cross_fitted(requests: list[RequestSteps], k: int, parts: int = SPLITS) -> list[np.ndarray]:
    """Per request [S, K]: its confidences through per-position tables fitted on the other splits."""
    out: list[np.ndarray | None] = [None] * len(requests)
    groups = split(requests, parts)
    for p in range(parts):
        others = [r for q, g in enumerate(groups) if q != p for r in g]
        table, by_pos = position_tables(others, k)
        if table is None:
            raise TraceReplayError(f"conf: split {p} has no calibration data in the other splits")
        for i in range(p, len(requests), parts):
            out[i] = calibrated_by_position(requests[i].conf, by_pos)
    return [c for c in out if c is not None]


def load_trace_replay(spec: str, k: int, calibration: Calibration = "cross-fitted") -> TraceReplay:
    path = Path(spec[len("traces:"):] if spec.lower().startswith("traces:") else spec)
    requests = request_steps(read_traces(path), k)
    if not requests:
        raise TraceReplayError(f"{path}: no trace records")
    if len(requests) < SPLITS and calibration == "cross-fitted":
        calibration = "raw"
    conf: list[np.ndarray] | None = None
    if _has_conf(requests):
        conf = cross_fitted(requests, k) if calibration == "cross-fitted" else [r.conf for r in requests]
    how = ("through per-position tables fitted on the other split (request i in split i % 2)"
           if calibration == "cross-fitted" else "raw")
    rates = tuple(float(x) for x in population_rates(requests, k))
    return TraceReplay(path.name, tuple(requests), tuple(conf) if conf is not None else None, rates, how)
