"""Exact expectation of emitted tokens per step under class-prior allocation (the policy search's model).

``expected_tokens`` / ``expected_goodput`` evaluate a (batch b, K, verify budget B, tier) operating
point: the expectation of emitted tokens per step when the budget goes to the top-B (request,
position) pairs by the survival of each request's class ("survival") or in even shares
("uniform"), averaged over the multinomial mix of request classes in the batch. The Monte-Carlo
run that ranks by what a runtime knows is ``spectune.autotune.simulator.simulate``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal

import numpy as np

from spectune.autotune.acceptance import AcceptanceModel
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import step_ms

Allocation = Literal["survival", "uniform"]  # class-prior ranking or even shares
MAX_EXACT_COMBOS = 4096  # above this many class-count vectors, average over sampled ones
SAMPLED_COMBOS = 2048
INFLIGHT_ITERATIONS = 8  # fixed-point steps of the in-flight class mix (exact after one at b = 1)


@dataclass(frozen=True)
class Mixture:
    """Request classes as arrays."""

    weights: np.ndarray  # [C]
    accept: np.ndarray  # [C, max_k] conditional rates a_i
    survival: np.ndarray  # [C, max_k] s_i = prod a_1..a_i

    @classmethod
    def of(cls, acceptance: AcceptanceModel, max_k: int | None = None) -> Mixture:
        k = acceptance.max_k if max_k is None else max_k
        w = np.array([c.weight for c in acceptance.components], dtype=float)
        surv = np.array([c.survival(k) for c in acceptance.components], dtype=float).reshape(len(w), k)
        acc = np.ones_like(surv)
        acc[:, 0] = surv[:, 0]
        np.divide(surv[:, 1:], surv[:, :-1], out=acc[:, 1:], where=surv[:, :-1] > 0)
        acc = np.where(surv > 0, acc, 0.0)
        return cls(w / w.sum(), np.clip(acc, 0.0, 1.0), surv)

    @property
    def max_k(self) -> int:
        return int(self.survival.shape[1])


# ---------------------------------------------------------------------------------------------
# analytic expectation


@functools.lru_cache(maxsize=64)
def _counts_cached(weights: tuple[float, ...], batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(count vectors [M, C], their probabilities [M], log multinomial coefficients [M], sampled)."""
    n, p = _class_counts(np.array(weights), batch)
    log_fact = math.lgamma(batch + 1) - np.vectorize(math.lgamma)(n + 1).sum(1)
    c = len(weights)
    return n, p, log_fact, c > 1 and math.comb(batch + c - 1, c - 1) > MAX_EXACT_COMBOS


def _class_counts(weights: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Count vectors n [M, C] of ``batch`` requests over classes and their probabilities [M]."""
    c = len(weights)
    if c == 1:
        return np.array([[batch]]), np.array([1.0])
    if math.comb(batch + c - 1, c - 1) <= MAX_EXACT_COMBOS:
        # stars and bars: every composition of batch into c parts
        rows = []
        for bars in combinations(range(batch + c - 1), c - 1):
            edges = (-1, *bars, batch + c - 1)
            rows.append([edges[i + 1] - edges[i] - 1 for i in range(c)])
        n = np.array(rows)
        logw = np.log(np.maximum(weights, 1e-300))
        logp = (math.lgamma(batch + 1) - np.vectorize(math.lgamma)(n + 1).sum(1)) + (n * logw).sum(1)
        p = np.exp(logp - logp.max())
        return n, p / p.sum()
    rng = np.random.default_rng(0)  # deterministic average over sampled class counts
    n = rng.multinomial(batch, weights, size=SAMPLED_COMBOS)
    return n, np.full(len(n), 1.0 / len(n))


def _class_tokens_fn(mix: Mixture, batch: int, k: int, bud: np.ndarray, allocation: Allocation):
    """A function: class weights [nB, C] -> expected tokens per step emitted by each class's
    requests [nB, C], when the batch's classes are multinomial(batch, weights) (one weight row per
    budget). What does not depend on the weights is computed once."""
    c = len(mix.weights)
    surv = mix.survival[:, :k]  # [C, K]
    if allocation == "uniform" or c == 1:
        # every request: 1 + s_1..s_q, and r of the b requests (at random) one more draft
        q, r = np.divmod(bud, batch)  # [nB]
        prefix = np.concatenate([np.zeros((c, 1)), np.cumsum(surv, 1)], 1)  # [C, K+1]
        nxt = np.concatenate([surv, np.zeros((c, 1))], 1)  # [C, K+1]
        per_req = 1.0 + prefix[:, q].T + (r / batch)[:, None] * nxt[:, np.minimum(q, k)].T  # [nB, C]
        return lambda w: batch * w * per_req
    # survival rule: the top-B survival values over the batch's (request, position) pairs
    n, _, log_fact, sampled = _counts_cached(tuple(mix.weights.tolist()), batch)  # [M, C], [M], [M]
    vals = surv.reshape(-1)  # [C*K], class-major
    order = np.argsort(-vals, kind="stable")
    v = vals[order]
    cls = np.repeat(np.arange(c), k)[order]
    onehot = np.eye(c)[np.concatenate([cls, [0]])]  # [C*K+1, C]
    mult = n[:, cls]  # [M, C*K] copies of each value
    cum_n = np.concatenate([np.zeros((len(n), 1)), np.cumsum(mult, 1)], 1)  # [M, C*K+1]
    cum_vc = np.concatenate([np.zeros((len(n), 1, c)), np.cumsum((mult * v)[:, :, None] * onehot[None, :-1], 1)], 1)
    j = (cum_n[:, None, 1:] < bud[None, :, None]).sum(2)  # [M, nB] index of the value B ends in
    rows = np.arange(len(n))[:, None]
    vj = np.concatenate([v, [0.0]])[j]  # [M, nB]
    part = (bud[None, :] - cum_n[rows, j]) * vj  # [M, nB] the value B ends in, partly taken
    tokens = n[:, None, :] + cum_vc[rows, j] + part[:, :, None] * onehot[j]  # [M, nB, C]
    log_w0 = np.log(np.maximum(mix.weights, 1e-300))

    def by_weights(w: np.ndarray) -> np.ndarray:
        logw = np.log(np.maximum(w, 1e-300))  # [nB, C]
        # exact: multinomial probabilities; sampled: importance weights vs the sampling weights
        logp = (n @ (logw - log_w0).T) if sampled else log_fact[:, None] + n @ logw.T  # [M, nB]
        p = np.exp(logp - logp.max(0))
        p = p / p.sum(0)
        return np.einsum("mb,mbc->bc", p, tokens)

    return by_weights


def inflight_weights(mix: Mixture, batch: int, k: int, budgets: Sequence[int] | np.ndarray,
                     allocation: Allocation = "survival", iterations: int = INFLIGHT_ITERATIONS) -> np.ndarray:
    """Class mix of the requests *in flight* [nB, C] under continuous batching.

    Requests of every class have the same output lengths, so a class that emits fewer tokens per
    step stays longer in the batch: in steady state each class's share of the emitted tokens equals
    its arrival weight. Fixed point pi_c <- pi_c * w_c / share_c(pi), from pi = w (exact in one
    step at batch 1 or with the full budget, where share_c = pi_c * tau_c / sum(pi * tau)).
    """
    bud = np.minimum(np.asarray(budgets, dtype=np.int64), batch * k)
    w = np.tile(mix.weights, (len(bud), 1))
    if k == 0 or len(mix.weights) == 1:
        return w
    return _fixed_point(mix, _class_tokens_fn(mix, batch, k, bud, allocation), w, iterations)


def _fixed_point(mix: Mixture, class_tokens, w: np.ndarray, iterations: int) -> np.ndarray:
    for _ in range(iterations):
        t = class_tokens(w)
        share = t / t.sum(1, keepdims=True)
        w = w * mix.weights[None, :] / np.maximum(share, 1e-300)
        w = w / w.sum(1, keepdims=True)
    return w


def expected_tokens(mix: Mixture, batch: int, k: int, budgets: Sequence[int] | np.ndarray,
                    allocation: Allocation = "survival", inflight: bool = False) -> np.ndarray:
    """Expected emitted tokens per step for each budget B (<= b*K) at batch b, draft length K.

    ``inflight`` False: the batch's classes are drawn with the arrival weights (one step of fresh
    requests). True: with the in-flight weights of a serving loop (``inflight_weights``): the
    goodput a continuous-batching server sees, which the policy search optimises.
    """
    bud = np.minimum(np.asarray(budgets, dtype=np.int64), batch * k)
    if k == 0:
        return np.full(bud.shape, float(batch))
    class_tokens = _class_tokens_fn(mix, batch, k, bud, allocation)
    w = np.tile(mix.weights, (len(bud), 1))
    if inflight and len(mix.weights) > 1:
        w = _fixed_point(mix, class_tokens, w, INFLIGHT_ITERATIONS)
    return class_tokens(w).sum(1)


def expected_goodput(cost: CostModel, acceptance: AcceptanceModel | Mixture, batch: int, k: int,
                     budget: int, tier: int, allocation: Allocation = "survival", inflight: bool = False) -> float:
    """Expected emitted tokens per second of one step shape."""
    mix = acceptance if isinstance(acceptance, Mixture) else Mixture.of(acceptance, max(k, 1))
    tokens = float(expected_tokens(mix, batch, k, [budget], allocation, inflight)[0])
    return tokens / step_ms(cost, batch, k, tier) * 1000.0
