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
from functools import cached_property
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

    @cached_property
    def runs(self) -> np.ndarray:
        """[T] right drafts left at each output index of this request (T = sum of a_s + 1): the
        step at index n accepts min(granted, runs[n]); made once per request."""
        a = self.accepted.astype(np.int64)
        lengths = a + 1
        start = np.repeat(np.cumsum(lengths) - lengths, lengths)
        out = np.repeat(a, lengths) - (np.arange(int(lengths.sum())) - start)
        out.flags.writeable = False  # (shared by every replay of the request)
        return out

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


# ---------------------------------------------------------------------------------------------
# Token-by-token tables: what a drafter hands out for a step that starts at a given output index


@dataclass(frozen=True)
class TokenTables:
    """Per replayed request i and output index p, the drafter's answer for a step starting at p.

    A recorded request's output indices are covered by its steps in order: step s starts at
    ``start_s = sum_{t<s} (a_t + 1)`` and covers ``start_s .. start_s + a_s`` (the last one is
    its bonus index). For p = start_s + i (0 <= i <= a_s) the step starting at p is step s
    resumed at its draft i:

        run[p]     = a_s - i                     consecutive right drafts from p
        offered[p] = max(0, o_s - i)             drafts left of step s's proposal
        conf[p, j] = c_s[i + j]  (i + j < o_s)   else 0

    For i = 0 (a step that starts where the recording's did) this is the recorded step itself.
    """

    run: np.ndarray  # [R, L] int64
    offered: np.ndarray  # [R, L] int64
    conf: np.ndarray  # [R, L, K] float, 0 where not offered (and NaN confidences as 0)
    requests: tuple[str, ...]  # [R] the recorded request each replayed request starts with


def request_tokens(req: RequestSteps, conf: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(run [T], offered [T], conf [T, K]) over one recorded request's output indices
    (T = sum of a_s + 1; ``conf`` [S, K] replaces the recorded confidences, e.g. calibrated)."""
    c = np.nan_to_num(req.conf if conf is None else conf, nan=0.0)  # [S, K]
    k = req.k
    offers, confs = [], []
    for s in range(len(req.offered)):
        a, o = int(req.accepted[s]), int(req.offered[s])
        i = np.arange(a + 1)
        offers.append(np.maximum(0, o - i))
        idx = i[:, None] + np.arange(k)[None, :]  # [a + 1, K] recorded position of draft j
        padded = np.concatenate([c[s], np.zeros(k)])  # positions past K: not offered
        confs.append(np.where(idx < o, padded[np.minimum(idx, 2 * k - 1)], 0.0))
    return req.runs, np.concatenate(offers), np.concatenate(confs, axis=0)


def played(lengths: Sequence[int], order: Sequence[int] | np.ndarray, i: int, need: int) -> list[int]:
    """The recorded requests replayed request i plays to cover ``need`` output indices:
    ``order[i % N], order[(i + 1) % N], ...`` end to end (``lengths``: each recorded request's
    output indices, ``RequestSteps.runs``); the one replay order of the bench's engine
    (``token_tables``) and of the simulator."""
    out: list[int] = []
    got, n = 0, len(order)
    while got < need:
        r = int(order[(i + len(out)) % n])
        if lengths[r] < 1:
            raise TraceStepsError(f"requests: recorded request {r} has no output to replay")
        out.append(r)
        got += lengths[r]
    return out


def token_tables(requests: Sequence[RequestSteps], order: Sequence[int], n: int, length: int, *,
                 offset: int = 1, conf: Sequence[np.ndarray] | None = None) -> TokenTables:
    """Tables for ``n`` replayed requests over output indices 0..length-1. Replayed request i
    plays the recorded requests ``order[i % N], order[(i + 1) % N], ...`` end to end (as many as
    its length needs); recorded index 0 is output index ``offset`` (the bench's first output
    token comes from the prefill, not from a step), indices before it offer nothing.
    ``conf``: per recorded request [S, K], replacing its recorded confidences."""
    if not requests or not len(order):
        raise TraceStepsError("requests: nothing to replay")
    if n < 1 or length < 1 or offset < 0:
        raise TraceStepsError(f"n, length, offset: need n, length >= 1 and offset >= 0, got {n}, {length}, {offset}")
    if conf is not None and len(conf) != len(requests):
        raise TraceStepsError(f"conf: {len(conf)} arrays for {len(requests)} requests")
    k = requests[0].k
    per = {}
    run = np.zeros((n, length), np.int64)
    offered = np.zeros((n, length), np.int64)
    cf = np.zeros((n, length, k))
    need = max(0, length - offset)
    lengths = [len(r.runs) for r in requests]
    for i in range(n):
        parts = []
        for r in played(lengths, order, i, need):
            if r not in per:
                per[r] = request_tokens(requests[r], None if conf is None else conf[r])
            parts.append(per[r])
        if parts:
            run[i, offset:] = np.concatenate([p[0] for p in parts])[:need]
            offered[i, offset:] = np.concatenate([p[1] for p in parts])[:need]
            cf[i, offset:] = np.concatenate([p[2] for p in parts], axis=0)[:need]
    names = tuple(requests[int(order[i % len(order)])].request for i in range(n))
    return TokenTables(run, offered, cf, names)
