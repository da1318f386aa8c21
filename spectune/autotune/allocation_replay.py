"""Replay recorded traces through a verify-budget allocation: acceptance length only, no costs.

``concurrency`` slots serve a queue of requests (the given requests, repeated ``rounds`` times in
a seeded order); a slot that finishes a request takes the next one, and the batch drains once the
queue is empty. Each replay step, every live slot plays its request's next recorded step
(``trace_steps``): offered o, accepted a, conf c. The policy grants g drafts (g <= min(o, K)); the
step accepts ``min(a, g)`` and emits that + 1 tokens.

Every policy advances each slot by one recorded step per replay step, so all policies see the same
(request, step) pairs in the same batches and their acceptance lengths are paired. A recorded step
stands for one draft of that request (the next step's context under another grant would differ:
``trace_steps`` module doc).

Policies (budget B = per_request x live slots, max K):
  fixed       g = min(o, K); no budget.
  confidence  top-B (slot, position) pairs by the drafter's survival prod_{i<=j} conf_i
              (confidences mapped through a calibration table first, if given).
  history     top-B pairs by runtime.request_history: population rates times the request's own
              accepted / expected-accepted drift, on the positions it offered.
  uniform     B split equally over the live slots; a slot's share past its offered drafts goes to
              the others in equal parts (water filling), so no offered draft is left for lack of
              budget while another slot has spare.
Positions past ``o`` were not proposed and are never granted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from spectune.errors import SpectuneError
from spectune.models.trace_steps import RequestSteps, calibrated, calibrated_by_position
from spectune.runtime.request_history import REQUEST_SHRINK, expected_accepts, request_confidences

Policy = Literal["fixed", "confidence", "history", "uniform"]


@dataclass(frozen=True)
class ReplayResult:
    mean_accept_len: float  # emitted tokens / slot-steps (bonus token included)
    granted_per_step: float  # drafts verified per slot-step
    slot_steps: int
    emitted: int


def _top_pairs(score: np.ndarray, budget: int) -> np.ndarray:
    """Grants [b] from the top-``budget`` entries of score [b, K] (non-increasing along K,
    -inf where not allowed); ties: lower slot, then lower position."""
    b, k = score.shape
    flat = score.reshape(-1)
    allowed = int(np.isfinite(flat).sum())
    take = min(budget, allowed)
    if take <= 0:
        return np.zeros(b, np.int64)
    order = np.lexsort((np.tile(np.arange(k), b), np.repeat(np.arange(b), k), -flat))[:take]
    return np.bincount(order // k, minlength=b)


def water_fill(offered: np.ndarray, budget: int) -> np.ndarray:
    """Equal shares of ``budget`` over slots, capped at offered [b]; spare shares flow to the rest
    (ties of the last partial round: lower slot first)."""
    g = np.zeros_like(offered)
    left = int(budget)
    while left > 0:
        open_ = np.flatnonzero(g < offered)
        if open_.size == 0:
            break
        share = left // open_.size
        if share == 0:
            g[open_[:left]] += 1
            break
        add = np.minimum(offered[open_] - g[open_], share)
        g[open_] += add
        left -= int(add.sum())
    return g


def replay(requests: Sequence[RequestSteps], *, policy: Policy, concurrency: int, k: int,
           per_request: float | None = None, calibration: Sequence[tuple[float, float]] | None = None,
           position_calibration: Sequence[Sequence[tuple[float, float]] | None] | None = None,
           rates: Sequence[float] | None = None, rounds: int = 1, seed: int = 0,
           shrink: float = REQUEST_SHRINK) -> ReplayResult:
    """Replay ``requests`` under one policy (module doc). ``rates`` [K]: the population conditional
    rates the history policy starts from (e.g. fitted on a calibration split)."""
    if concurrency < 1 or k < 1 or rounds < 1:
        raise SpectuneError(f"concurrency, k, rounds: must be >= 1, got {concurrency}, {k}, {rounds}")
    if policy != "fixed" and (per_request is None or per_request < 0):
        raise SpectuneError(f"per_request: a {policy} policy needs a budget per request >= 0")
    if policy == "history" and (rates is None or len(rates) < k):
        raise SpectuneError(f"rates: the history policy needs {k} population rates")
    if not requests:
        raise SpectuneError("requests: nothing to replay")
    rng = np.random.default_rng(seed)
    queue = [int(i) for _ in range(rounds) for i in rng.permutation(len(requests))]
    if position_calibration is not None:
        conf = [calibrated_by_position(r.conf[:, :k], position_calibration) for r in requests]
    else:
        conf = [calibrated(r.conf[:, :k], calibration) for r in requests]
    pop = np.asarray(rates[:k], dtype=float) if rates is not None else np.zeros(k)
    pop_cum = np.concatenate([[0.0], np.cumsum(pop)])  # [K + 1]
    slots = queue[:concurrency]
    queue = queue[concurrency:]
    step = [0] * len(slots)
    acc_hist = np.zeros(len(slots))  # history policy: accepted drafts so far, per slot
    exp_hist = np.zeros(len(slots))  # expected accepts on the drafts it tested
    emitted = granted_total = slot_steps = 0
    cols = np.arange(k)[None, :]
    while slots:
        b = len(slots)
        offered = np.array([min(int(requests[r].offered[s]), k) for r, s in zip(slots, step, strict=True)])
        accepted = np.array([int(requests[r].accepted[s]) for r, s in zip(slots, step, strict=True)])
        allowed = cols < offered[:, None]  # [b, K]
        budget = int(round((per_request or 0.0) * b))
        if policy == "fixed":
            g = offered
        elif policy == "uniform":
            g = water_fill(offered, budget)
        else:
            if policy == "confidence":
                c = np.stack([conf[r][s] for r, s in zip(slots, step, strict=True)])  # [b, K]
                surv = np.cumprod(np.nan_to_num(c, nan=0.0), axis=1)
            else:
                a = request_confidences(pop, acc_hist, exp_hist, shrink)  # [b, K]
                surv = np.cumprod(a, axis=1)
            g = _top_pairs(np.where(allowed, surv, -np.inf), budget)
        got = np.minimum(accepted, g)
        if policy == "history":
            acc_hist += got
            exp_hist += expected_accepts(pop_cum, g, got)
        emitted += int(got.sum()) + b
        granted_total += int(g.sum())
        slot_steps += b
        # advance; a finished slot takes the next queued request (fresh history) or leaves
        moves: list[tuple[int, bool, int, int]] = []  # (old slot, fresh request?, request, step)
        for i, (r, s) in enumerate(zip(slots, step, strict=True)):
            if s + 1 < len(requests[r].offered):
                moves.append((i, False, r, s + 1))
            elif queue:
                moves.append((i, True, queue.pop(0), 0))
        src = [m[0] for m in moves]
        fresh = np.array([m[1] for m in moves], dtype=bool)
        acc_hist = np.where(fresh, 0.0, acc_hist[src])
        exp_hist = np.where(fresh, 0.0, exp_hist[src])
        nxt_slots, nxt_step = [m[2] for m in moves], [m[3] for m in moves]
        slots, step = nxt_slots, nxt_step
    return ReplayResult(emitted / slot_steps, granted_total / slot_steps, slot_steps, emitted)


def population_rates(requests: Sequence[RequestSteps], k: int) -> np.ndarray:
    """Conditional rate per position [K]: P(draft j right | drafts < j right), counting a position
    that was not offered as not right (the acceptance of a K-draft request)."""
    reached = np.zeros(k)
    right = np.zeros(k)
    for r in requests:
        acc = np.minimum(r.accepted, k)
        for j in range(k):
            reached[j] += int((acc >= j).sum())
            right[j] += int((acc > j).sum())
    return np.divide(right, reached, out=np.zeros(k), where=reached > 0)
