"""A trace set as per-request, per-position outcomes a replay drafter can consume.

For one recorded verification step (``offered`` o, ``accepted`` a, ``conf`` c_1..c_o) and draft
position j = 1..K:

    right[j]  = j <= a                      the recorded draft j equals the target's token
    known[j]  = j <= min(a + 1, o)          verification saw position j (every earlier one right)
    offered   = o                           positions past o were not proposed (never right)
    conf[j]   = c_j for j <= o, NaN past o  the drafter's own probability (NaN without conf)

A replay that grants g drafts to this step accepts ``min(a, g)`` of them and emits that + 1
tokens: exact for this step whatever g is, because acceptance stops at the first wrong draft and
every position up to it is known. What a replay cannot know is the *next* step under another g:
the recorded next step starts ``a + 1`` tokens later, a run that accepted fewer would have drafted
from an earlier context. Replaying step by step therefore treats each recorded step as one sample
of the drafter at some position of that request (see docs/TRACES.md).

Calibration: ``calibrated(conf, table)`` maps raw confidences through a table of (bin upper
edge, P(accept | bin)) rows, the form ``spectune.autotune.acceptance_sources.calibrate`` fits.

numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectune.errors import SpectuneError


class TraceStepsError(SpectuneError):
    """Trace records cannot be turned into per-request steps; the message names the field."""


@dataclass(frozen=True)
class RequestSteps:
    """One request's recorded steps in order, positions 1..K as columns 0..K-1."""

    request: str
    offered: np.ndarray  # [S] int
    accepted: np.ndarray  # [S] int, 0..offered
    conf: np.ndarray  # [S, K] float, NaN where not offered or not recorded

    @property
    def k(self) -> int:
        return int(self.conf.shape[1])

    @property
    def right(self) -> np.ndarray:
        # [S, K] bool: draft j (column j - 1) was right
        return np.arange(self.k)[None, :] < self.accepted[:, None]

    @property
    def known(self) -> np.ndarray:
        # [S, K] bool: position verified (offered, and every earlier draft right)
        reached = np.minimum(self.accepted + 1, self.offered)
        return np.arange(self.k)[None, :] < reached[:, None]

    def pairs(self) -> list[list[tuple[bool, float]]]:
        """Per step, the (right, conf) of each verified position: what a replay drafter hands out."""
        right, known = self.right, self.known
        return [[(bool(right[s, j]), float(self.conf[s, j])) for j in range(self.k) if known[s, j]]
                for s in range(len(self.offered))]

    def accepted_with(self, granted: np.ndarray) -> np.ndarray:
        """[S] accepted drafts if step s had been granted ``granted[s]`` drafts."""
        return np.minimum(self.accepted, granted)


def request_steps(records: Iterable[dict[str, Any]], k: int) -> list[RequestSteps]:
    """Group trace records by request (first-appearance order), steps sorted by ``step``.

    Records need ``request``, ``step``, ``offered``, ``accepted`` and optionally ``conf`` (as
    ``specdecode.read_traces`` returns them); offered drafts past ``k`` are cut (a step recorded
    at a larger K replays at K)."""
    if k < 1:
        raise TraceStepsError(f"k: must be >= 1, got {k}")
    by_request: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_request.setdefault(str(rec["request"]), []).append(rec)
    out = []
    for request, recs in by_request.items():
        recs = sorted(recs, key=lambda r: int(r["step"]))
        steps = [int(r["step"]) for r in recs]
        if len(set(steps)) != len(steps):
            raise TraceStepsError(f"{request}: step: repeated step index")
        offered = np.array([min(int(r["offered"]), k) for r in recs], dtype=np.int64)
        accepted = np.minimum(np.array([int(r["accepted"]) for r in recs], dtype=np.int64), offered)
        conf = np.full((len(recs), k), np.nan)
        for s, r in enumerate(recs):
            c = r.get("conf")
            if c is not None:
                if len(c) != int(r["offered"]):
                    raise TraceStepsError(f"{request} step {r['step']}: conf: {len(c)} values for {r['offered']} drafts")
                conf[s, : offered[s]] = np.asarray(c[: offered[s]], dtype=float)
        out.append(RequestSteps(request, offered, accepted, conf))
    return out


def split(requests: Sequence[RequestSteps], parts: int = 2) -> list[list[RequestSteps]]:
    """Request i (first-appearance order) goes to part i % parts (the recorder's prompt splits)."""
    if parts < 1:
        raise TraceStepsError(f"parts: must be >= 1, got {parts}")
    return [list(requests[p::parts]) for p in range(parts)]


def calibrated(conf: np.ndarray, table: Sequence[tuple[float, float]] | None) -> np.ndarray:
    """Map confidences through (bin upper edge, probability) rows; NaN stays NaN; None: unchanged.
    Row i covers [previous edge, edge i), as ``calibrate`` bins; past the last edge: the last row."""
    if table is None:
        return conf
    edges = np.array([e for e, _ in table], dtype=float)  # [T]
    probs = np.array([p for _, p in table], dtype=float)  # [T]
    idx = np.minimum(np.searchsorted(edges, np.nan_to_num(conf, nan=0.0), side="right"), len(edges) - 1)
    return np.where(np.isnan(conf), np.nan, probs[idx])


def calibrated_by_position(conf: np.ndarray, tables: Sequence[Sequence[tuple[float, float]] | None]) -> np.ndarray:
    """``calibrated`` with one table per draft position: column j of conf [S, K] through
    tables[j] (the last table for columns past the list)."""
    if not tables:
        raise TraceStepsError("tables: need at least one calibration table")
    cols = [calibrated(conf[:, j], tables[min(j, len(tables) - 1)]) for j in range(conf.shape[1])]
    return np.stack(cols, axis=1) if cols else conf
