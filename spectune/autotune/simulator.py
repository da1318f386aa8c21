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
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Literal, Protocol

import numpy as np

from spectune.autotune.acceptance import AcceptanceModel
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Plan, smallest_tier, step_ms

Allocation = Literal["survival", "uniform"]
Workload = Literal["open", "closed"]
Lengths = Literal["geometric", "fixed"]
MAX_EXACT_COMBOS = 4096  # above this many class-count vectors, average over sampled ones
SAMPLED_COMBOS = 2048
INFLIGHT_ITERATIONS = 8  # fixed-point steps of the in-flight class mix (exact after one at b = 1)


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


# counter-based uniforms: request j's class, length and the difficulty of each of its output
# tokens are pure functions of (seed, j, token), so arms run with one seed see the same requests
# and the same acceptance draws whatever K they verify (common random numbers)
_STREAM_CLASS, _STREAM_LENGTH, _STREAM_TIE, _STREAM_TOKEN = 0, 1, 2, 3
_M1, _M2, _G = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def crn_uniform(seed: int, stream: int, request: np.ndarray, index: np.ndarray | int = 0) -> np.ndarray:
    """Uniforms in [0, 1) keyed by (seed, stream, request id, index); broadcasts like numpy."""
    r = np.asarray(request, dtype=np.int64).astype(np.uint64)
    i = np.asarray(index, dtype=np.int64).astype(np.uint64)
    # the (seed, stream) key goes through the finaliser first: a key that were a multiple of the
    # index step would make seed s + 1 replay seed s's uniforms shifted by a few indices
    key = _mix64(np.uint64(((seed * 4 + stream + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF))
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        x = _mix64(key + r * np.uint64(0xD1B54A32D192ED03) + i * _G)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def _mix64(x: Any) -> Any:
    """splitmix64 finaliser (uint64 scalar or array)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def _grant(prior: np.ndarray, k: int, budget: int, allocation: Allocation, tie: np.ndarray) -> np.ndarray:
    """Drafts granted per request [b] from the class survival prior [b, K]; ``tie`` [b] breaks ties
    between like requests (within a request positions go in order)."""
    b = prior.shape[0]
    if budget >= b * k:
        return np.full(b, k)
    if allocation == "uniform":
        q, r = divmod(budget, b)
        g = np.full(b, q)
        g[np.argsort(tie, kind="stable")[:r]] += 1
        return g
    # top-B pairs by survival
    pos = np.tile(np.arange(k), b)
    chosen = np.lexsort((pos, np.repeat(tie, k), -prior.reshape(-1)))[:budget]
    return np.bincount(chosen // k, minlength=b)


def simulate(cost: CostModel, acceptance: AcceptanceModel, policy_fn: PolicyFn, *, concurrency: int,
             context_len: int | None = None, steps: int = 2000, requests: int | None = None,
             seed: int = 0, allocation: Allocation = "survival", accept_scale: float = 1.0,
             mean_output_tokens: float = 256.0, workload: Workload = "open",
             lengths: Lengths = "geometric") -> SimResult:
    """Run ``concurrency`` live requests for ``steps`` steps (or until ``requests`` finished).

    ``workload``: "open" keeps the batch full (a finished request is replaced at once, a server
    under steady load); "closed" serves exactly ``requests`` requests queued at the start, so the
    batch drains once the queue is empty (a benchmark run; ``requests`` required).

    Request j (in arrival order) has a class, an output length (``lengths``: geometric with mean
    ``mean_output_tokens``, or exactly that many) and a uniform per output token; draft i of a step
    that starts at output token n is accepted when the uniform of token n + i is below the class's
    conditional rate a_i.
    Two runs with one seed therefore share requests and draws (common random numbers): the ratio
    of two policies' goodputs is not blurred by different samples.

    ``accept_scale`` scales the true conditional rates of the live traffic (drift) while the
    allocation still ranks by the tuned prior. ``policy_fn.observe`` (if any) gets each step's
    acceptance counters one step late: accepted and tested drafts per position (a draft is tested
    when it was granted and every draft before it was accepted).
    """
    if concurrency < 1:
        raise SpectuneError(f"concurrency must be >= 1, got {concurrency}")
    closed = workload == "closed"
    if closed and (requests is None or requests < 1):
        raise SpectuneError("a closed workload needs requests >= 1")
    if context_len is not None:
        cost = dataclasses.replace(cost, context_len=context_len)
    mix = Mixture.of(acceptance)
    b, kmax = concurrency, mix.max_k
    true_accept = np.clip(mix.accept * accept_scale, 0.0, 1.0)
    observe = getattr(policy_fn, "observe", None)
    cum_w = np.cumsum(mix.weights)
    p_end = 1.0 / max(1.0, mean_output_tokens)

    def new_requests(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cls = np.minimum(np.searchsorted(cum_w, crn_uniform(seed, _STREAM_CLASS, ids), side="right"),
                         len(cum_w) - 1)
        if lengths == "fixed":
            return cls, np.full(len(ids), max(1, round(mean_output_tokens)), np.int64)
        if p_end >= 1.0:
            return cls, np.ones(len(ids), np.int64)
        u = crn_uniform(seed, _STREAM_LENGTH, ids)
        length = np.ceil(np.log1p(-u) / math.log1p(-p_end))  # geometric on 1, 2, ...
        return cls, np.maximum(1, length).astype(np.int64)

    if closed:
        assert requests is not None
        b = min(b, requests)
    req = np.arange(b, dtype=np.int64)  # [b] request id per slot
    next_req = b
    cls, remaining = new_requests(req)
    made = np.zeros(b, np.int64)  # [b] output tokens emitted so far per slot
    lat, wts = [], []
    k_hist: dict[int, int] = {}
    tier_hist: dict[int, int] = {}
    total_tokens, total_ms, joules, done, n_steps, slot_steps = 0, 0.0, 0.0, 0, 0, 0
    has_power = cost.power_w(1) is not None
    pending = None
    for _ in range(steps):
        if pending is not None and observe is not None:
            observe(*pending)
        plan = policy_fn.plan(b)
        if plan.tier is None or plan.tier < b + plan.verify_budget:
            raise InvalidPolicy(f"batch {b}: no captured tier holds {b + plan.verify_budget} tokens")
        k = min(plan.k, kmax)
        if k:
            tie = crn_uniform(seed, _STREAM_TIE, req, made)
            g = _grant(mix.survival[cls, :k], k, min(plan.verify_budget, b * k), allocation, tie)
            cols = np.arange(k)[None, :]
            u = crn_uniform(seed, _STREAM_TOKEN, req[:, None], made[:, None] + cols)
            ok = (u < true_accept[cls, :k]) & (cols < g[:, None])
            accepted = np.cumprod(ok, 1).sum(1)
            tested = (cols < g[:, None]) & (cols <= accepted[:, None])
            pending = ((cols < accepted[:, None]).sum(0), tested.sum(0))
        else:
            accepted = np.zeros(b, np.int64)
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
        slot_steps += b
        remaining = remaining - emitted
        made = made + emitted
        finished = remaining <= 0
        if finished.any():
            done += int(finished.sum())
            if closed:  # refill from the queue; slots without a request leave the batch
                assert requests is not None
                idx = np.flatnonzero(finished)
                refill, drop = idx[: max(0, requests - next_req)], idx[max(0, requests - next_req):]
                finished = np.zeros(b, bool)
                finished[refill] = True
                keep = np.ones(b, bool)
                keep[drop] = False
            n_new = int(finished.sum())
            req[finished] = np.arange(next_req, next_req + n_new)
            next_req += n_new
            cls[finished], remaining[finished] = new_requests(req[finished])
            made[finished] = 0
            if closed and not keep.all():
                req, cls, remaining, made = req[keep], cls[keep], remaining[keep], made[keep]
                b = len(req)
            if b == 0 or (requests is not None and done >= requests):
                break
    all_lat, all_w = np.concatenate(lat), np.concatenate(wts).astype(float)
    return SimResult(
        goodput_tok_s=total_tokens / total_ms * 1000.0,
        itl_p50_ms=_weighted_quantile(all_lat, all_w, 0.50),
        itl_p99_ms=_weighted_quantile(all_lat, all_w, 0.99),
        joules_per_token=joules / total_tokens if has_power else None,
        mean_accept_len=total_tokens / max(1, slot_steps),
        k_hist=dict(sorted(k_hist.items())),
        steps=n_steps,
        tokens=total_tokens,
        seconds=total_ms / 1000.0,
        requests_done=done,
        tier_hist=dict(sorted(tier_hist.items())),
    )
