"""Drafter confidences against acceptance: reliability, ECE, and request classes by confidence.

Samples are the verified draft positions of a trace (``trace_steps``: offered, and every earlier
draft accepted): confidence c of the draft there, and whether it was accepted.

Reliability over equal-width bins of c: per bin the count, mean confidence and acceptance rate.
Expected calibration error ``ECE = sum_b (n_b / N) |accept_b - mean_conf_b|``.

Confidence classes (what ``tune --acceptance TRACES`` models when the traces carry ``conf``):
each recorded step gets the survival its drafter predicted, ``s_j = prod_{i<=j} q_i`` with q the
calibrated confidences (0 past the offered drafts), and the score ``sum_j s_j``; steps are cut
into equal-count groups by that score, and each group's survival is what its steps really did:
``S_j = P(accepted >= j)`` over the group's steps (a position not offered counts as not
accepted). A budget allocation that ranks drafts by the confidences then ranks exactly these
classes, and their rates are measured outcomes, not the drafter's own numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spectune.models.trace_steps import RequestSteps, calibrated, calibrated_by_position

RELIABILITY_BINS = 10
CONFIDENCE_CLASSES = 6


@dataclass(frozen=True)
class ReliabilityRow:
    lo: float
    hi: float
    count: int
    mean_conf: float
    accept_rate: float


def verified_samples(requests: Sequence[RequestSteps], k: int | None = None,
                     table: Sequence[tuple[float, float]] | None = None,
                     position_tables: Sequence[Sequence[tuple[float, float]] | None] | None = None,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(conf [M], accepted [M] bool, position [M] 1-based) over every verified position with a
    confidence (``table``: calibrate the confidences first; ``position_tables``: one per position)."""
    conf, ok, pos = [], [], []
    for r in requests:
        kk = r.k if k is None else min(k, r.k)
        c = (calibrated_by_position(r.conf[:, :kk], position_tables) if position_tables is not None
             else calibrated(r.conf[:, :kk], table))
        known = r.known[:, :kk] & ~np.isnan(c)
        conf.append(c[known])
        ok.append(r.right[:, :kk][known])
        pos.append(np.nonzero(known)[1] + 1)
    if not conf:
        return np.zeros(0), np.zeros(0, bool), np.zeros(0, np.int64)
    return np.concatenate(conf), np.concatenate(ok), np.concatenate(pos)


def reliability(conf: np.ndarray, accepted: np.ndarray, bins: int = RELIABILITY_BINS) -> list[ReliabilityRow]:
    """Rows of the reliability table (empty bins left out)."""
    idx = np.minimum((conf * bins).astype(int), bins - 1)
    rows = []
    for b in range(bins):
        m = idx == b
        if m.any():
            rows.append(ReliabilityRow(b / bins, (b + 1) / bins, int(m.sum()), float(conf[m].mean()),
                                       float(accepted[m].mean())))
    return rows


def ece(conf: np.ndarray, accepted: np.ndarray, bins: int = RELIABILITY_BINS) -> float:
    """Expected calibration error over equal-width bins (module doc); NaN without samples."""
    rows = reliability(conf, accepted, bins)
    n = sum(r.count for r in rows)
    if n == 0:
        return float("nan")
    return sum(r.count / n * abs(r.accept_rate - r.mean_conf) for r in rows)


def confidence_classes(offered: np.ndarray, accepted: np.ndarray, conf: np.ndarray, k: int,
                       table: Sequence[tuple[float, float]] | None,
                       classes: int = CONFIDENCE_CLASSES) -> tuple[np.ndarray, np.ndarray]:
    """(weights [C], survival [C, K]) of step groups by predicted survival (module doc).

    offered, accepted [S]; conf [S, >= K] raw confidences, NaN where not offered."""
    q = np.nan_to_num(calibrated(conf[:, :k], table), nan=0.0)  # [S, K]
    q = np.where(np.arange(k)[None, :] < np.minimum(offered, k)[:, None], q, 0.0)
    score = np.cumprod(q, axis=1).sum(1)  # [S] predicted accepted drafts
    order = np.argsort(score, kind="stable")
    groups = [g for g in np.array_split(order, min(classes, len(order))) if g.size]
    acc = np.minimum(accepted, k)
    weights = np.array([g.size for g in groups], dtype=float) / len(order)
    survival = np.array([[(acc[g] >= j).mean() for j in range(1, k + 1)] for g in groups])  # [C, K]
    return weights, survival
