"""Serving simulator: play a workload through the cost model and a policy.

Two ways to evaluate a (batch b, K, verify budget B, tier) operating point:
- ``expected_tokens`` / ``expected_goodput``: the exact expectation of emitted tokens per step
  under the budget allocation rule, averaged over the mixture of request classes (analytic,
  used inside the policy search);
- ``simulate``: a seeded Monte-Carlo run of ``concurrency`` live requests (requests finish and are
  replaced), used to confirm a policy and to report p50/p99 inter-token latency and J/token.

Allocation rules (the device rule is "survival"):
  survival: grant the B drafts to the top-B (request, position) pairs by the survival prior of
            the request's class; survival is non-increasing per request, so each grant is a prefix.
  uniform:  every request gets B // b drafts, B % b of them one more.
Emitted tokens of a request = accepted drafts + 1 (bonus/corrected token).
Step time = drafter(b, K) + target(tier) + overhead(tier): the step pays for its padded tier.
Drafter confidence (``AcceptanceModel.calibration``) is not simulated: allocation always ranks by
the class survival prior.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Literal, Protocol

import numpy as np

from spectune.autotune.acceptance import AcceptanceModel
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Plan, smallest_tier, step_ms
from spectune.runtime.schema import SpectuneError

Allocation = Literal["survival", "uniform"]
MAX_EXACT_COMBOS = 4096  # above this many class-count vectors, average over sampled ones
SAMPLED_COMBOS = 2048


class InvalidPolicy(SpectuneError):
    """A policy asked for a step shape that no captured tier holds."""


class PolicyFn(Protocol):
    def plan(self, batch_size: int) -> Plan: ...


@dataclass(frozen=True)
class FixedK:
    """Fixed draft length K (0 = plain decoding), full budget b*K. With ``tiers`` None every
    shape has its own exact graph (no padding), as an engine that captures each size."""

    k: int
    tiers: tuple[int, ...] | None = None

    def plan(self, batch_size: int) -> Plan:
        tokens = batch_size * (self.k + 1)
        tier = tokens if self.tiers is None else smallest_tier(self.tiers, tokens)
        return Plan(self.k, batch_size * self.k, tier)


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


def expected_tokens(mix: Mixture, batch: int, k: int, budgets: Sequence[int] | np.ndarray,
                    allocation: Allocation = "survival") -> np.ndarray:
    """Expected emitted tokens per step for each budget B (<= b*K) at batch b, draft length K."""
    bud = np.minimum(np.asarray(budgets, dtype=np.int64), batch * k)
    if k == 0:
        return np.full(bud.shape, float(batch))
    mean = mix.weights @ mix.survival[:, :k]  # [K] mixture mean survival
    if allocation == "uniform" or len(mix.weights) == 1:
        q, r = np.divmod(bud, batch)
        prefix = np.concatenate([[0.0], np.cumsum(mean)])  # [K+1]
        nxt = np.concatenate([mean, [0.0]])
        return batch + batch * prefix[q] + r * nxt[np.minimum(q, k)]
    # survival rule: E[b + sum of the top-B survival values over the batch's (request, position)]
    n, p = _class_counts(mix.weights, batch)  # [M, C], [M]
    vals = mix.survival[:, :k].reshape(-1)  # [C*K], class-major
    order = np.argsort(-vals, kind="stable")
    v = vals[order]
    cls = np.repeat(np.arange(len(mix.weights)), k)[order]
    mult = n[:, cls]  # [M, C*K] copies of each value
    cum_n = np.concatenate([np.zeros((len(n), 1)), np.cumsum(mult, 1)], 1)  # [M, C*K+1]
    cum_v = np.concatenate([np.zeros((len(n), 1)), np.cumsum(mult * v, 1)], 1)
    j = (cum_n[:, None, 1:] < bud[None, :, None]).sum(2)  # [M, nB] index of the value B ends in
    rows = np.arange(len(n))[:, None]
    vj = np.concatenate([v, [0.0]])[j]
    top = cum_v[rows, j] + (bud[None, :] - cum_n[rows, j]) * vj
    return batch + p @ top


def expected_goodput(cost: CostModel, acceptance: AcceptanceModel | Mixture, batch: int, k: int,
                     budget: int, tier: int, allocation: Allocation = "survival") -> float:
    """Expected emitted tokens per second of one step shape."""
    mix = acceptance if isinstance(acceptance, Mixture) else Mixture.of(acceptance, max(k, 1))
    tokens = float(expected_tokens(mix, batch, k, [budget], allocation)[0])
    return tokens / step_ms(cost, batch, k, tier) * 1000.0


# ---------------------------------------------------------------------------------------------
# Monte-Carlo serving simulation


@dataclass(frozen=True)
class SimResult:
    goodput_tok_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    joules_per_token: float | None
    mean_accept_len: float  # emitted tokens per request per step (bonus included)
    k_hist: dict[int, int]  # steps per K
    steps: int
    tokens: int
    seconds: float
    requests_done: int
    tier_hist: dict[int, int] = field(default_factory=dict)


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    cw = np.cumsum(weights[order])
    i = int(np.searchsorted(cw, q * cw[-1]))
    return float(values[order][min(i, len(values) - 1)])


def _grant(prior: np.ndarray, k: int, budget: int, allocation: Allocation,
           rng: np.random.Generator) -> np.ndarray:
    """Drafts granted per request [b] from the class survival prior [b, K]."""
    b = prior.shape[0]
    if budget >= b * k:
        return np.full(b, k)
    if allocation == "uniform":
        q, r = divmod(budget, b)
        g = np.full(b, q)
        g[rng.permutation(b)[:r]] += 1
        return g
    # top-B pairs; ties between like requests broken at random, within a request by position
    tie = np.repeat(rng.random(b), k)
    pos = np.tile(np.arange(k), b)
    chosen = np.lexsort((pos, tie, -prior.reshape(-1)))[:budget]
    return np.bincount(chosen // k, minlength=b)


def simulate(cost: CostModel, acceptance: AcceptanceModel, policy_fn: PolicyFn, *, concurrency: int,
             context_len: int | None = None, steps: int = 2000, requests: int | None = None,
             seed: int = 0, allocation: Allocation = "survival", accept_scale: float = 1.0,
             mean_output_tokens: float = 256.0) -> SimResult:
    """Run ``concurrency`` live requests for ``steps`` steps (or until ``requests`` finished).

    ``accept_scale`` scales the true conditional rates of the live traffic (drift) while the
    allocation still ranks by the tuned prior. ``policy_fn.observe`` (if any) gets each step's
    acceptance counters one step late.
    """
    if concurrency < 1:
        raise SpectuneError(f"concurrency must be >= 1, got {concurrency}")
    if context_len is not None:
        cost = dataclasses.replace(cost, context_len=context_len)
    rng = np.random.default_rng(seed)
    mix = Mixture.of(acceptance)
    b, kmax = concurrency, mix.max_k
    true_accept = np.clip(mix.accept * accept_scale, 0.0, 1.0)
    observe = getattr(policy_fn, "observe", None)

    def new_requests(n: int) -> tuple[np.ndarray, np.ndarray]:
        cls = rng.choice(len(mix.weights), size=n, p=mix.weights)
        length = np.maximum(1, rng.geometric(1.0 / max(1.0, mean_output_tokens), size=n))
        return cls, length

    cls, remaining = new_requests(b)
    lat, wts = [], []
    k_hist: dict[int, int] = {}
    tier_hist: dict[int, int] = {}
    total_tokens, total_ms, joules, done, n_steps = 0, 0.0, 0.0, 0, 0
    has_power = cost.power_w(1) is not None
    pending = None
    for _ in range(steps):
        if pending is not None and observe is not None:
            observe(*pending)
        plan = policy_fn.plan(b)
        if plan.tier is None or plan.tier < b + plan.verify_budget:
            raise InvalidPolicy(f"batch {b}: no captured tier holds {b + plan.verify_budget} tokens")
        k = min(plan.k, kmax)
        g = _grant(mix.survival[cls, :k], k, min(plan.verify_budget, b * k), allocation, rng) if k else np.zeros(b, int)
        if k:
            ok = rng.random((b, k)) < true_accept[cls, :k]
            ok &= np.arange(k)[None, :] < g[:, None]
            accepted = np.cumprod(ok, 1).sum(1)
            tested = (np.arange(k)[None, :] < g[:, None]) & (np.arange(k)[None, :] <= accepted[:, None])
            pending = (np.bincount(np.nonzero(np.arange(k)[None, :] < accepted[:, None])[1], minlength=k),
                       tested.sum(0))
        else:
            accepted = np.zeros(b, int)
            pending = None
        emitted = np.minimum(accepted + 1, remaining)
        ms = step_ms(cost, b, k, plan.tier)
        lat.append(ms / emitted)
        wts.append(emitted)
        total_tokens += int(emitted.sum())
        total_ms += ms
        if has_power:
            joules += float(cost.power_w(plan.tier) or 0.0) * ms / 1000.0
        k_hist[k] = k_hist.get(k, 0) + 1
        tier_hist[plan.tier] = tier_hist.get(plan.tier, 0) + 1
        n_steps += 1
        remaining = remaining - emitted
        finished = remaining <= 0
        if finished.any():
            done += int(finished.sum())
            cls[finished], remaining[finished] = new_requests(int(finished.sum()))
            if requests is not None and done >= requests:
                break
    all_lat, all_w = np.concatenate(lat), np.concatenate(wts).astype(float)
    return SimResult(
        goodput_tok_s=total_tokens / total_ms * 1000.0,
        itl_p50_ms=_weighted_quantile(all_lat, all_w, 0.50),
        itl_p99_ms=_weighted_quantile(all_lat, all_w, 0.99),
        joules_per_token=joules / total_tokens if has_power else None,
        mean_accept_len=total_tokens / (n_steps * b),
        k_hist=dict(sorted(k_hist.items())),
        steps=n_steps,
        tokens=total_tokens,
        seconds=total_ms / 1000.0,
        requests_done=done,
        tier_hist=dict(sorted(tier_hist.items())),
    )
