"""Serving simulator: play a workload through the cost model and a policy.

Two ways to evaluate a (batch b, K, verify budget B, tier) operating point:
- ``expected_tokens`` / ``expected_goodput`` (``spectune.autotune.expectation``, re-exported here):
  the exact expectation of emitted tokens per step under class-prior allocation, averaged over
  the mixture of request classes (analytic, used inside the policy search);
- ``simulate``: a seeded Monte-Carlo run of ``concurrency`` live requests (requests finish and are
  replaced), used to confirm a policy and to report p50/p99 inter-token latency and J/token; its
  phases: start the batch, per step observe -> plan -> allocate -> verify -> account -> retire and
  refill, then the result.

Allocation when the verify budget binds (the analytic expectation and the policy search rank by
the class prior, ``Allocation``; the Monte-Carlo run ranks by what a runtime knows, ``SimAllocation``):
  survival (analytic) / oracle (Monte-Carlo): the top-B (request, position) pairs by the survival
            of the request's class: the truth, which no runtime knows; kept for comparison.
  history (Monte-Carlo default): the top-B pairs by each request's own acceptance history shrunk
            toward the population (``spectune.runtime.request_history``: accepted and
            expected-accepted counts, updated every step, rates from the policy's ``rates`` or the
            prior). Never the request's true rates.
  uniform:  every request gets B // b drafts, B % b of them one more.
Survival estimates are non-increasing per request, so each grant is a prefix.
Emitted tokens of a request = accepted drafts + 1 (bonus/corrected token).
Step time = drafter(b, K) + target(tier) + overhead(tier): the step pays for its padded tier.
End to end (``simulate(prefill=..., ride=...)``): an admission's prompts take separate prefill
forwards (``prefill``), or ride in the decode steps (``ride``: mixed prefill; a step carrying P
prompt tokens runs its target at tier + P tokens, and a request joins the batch after its last
piece), as the engine runs them.
Drafter confidence (``AcceptanceModel.calibration``) is not simulated.

Token replay: a trace set's model (``AcceptanceModel.replay``: the recorded steps of each request)
is replayed as the bench's engine replays it (``spectune.models.trace_steps.token_tables``), not
drawn from its fitted classes: request j plays the recorded requests of a seeded order end to end,
and a step that starts at output token n accepts ``min(granted, run[n])`` drafts, ``run[n]`` the
right drafts the recorded step covering n had left from there. So acceptance depends on K as the
recording's does (an n-gram match is a span: a small K starts more steps inside one), and a
declined draft is a rejection. Without drift and with ``accept_scale`` 1; otherwise the classes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from spectune.autotune.acceptance import AcceptanceModel, extend_conditional
from spectune.autotune.expectation import (
    Allocation,
    Mixture,
    expected_goodput,
    expected_tokens,
    inflight_weights,
)
from spectune.errors import SpectuneError
from spectune.models.trace_steps import played
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Plan, smallest_tier, step_ms
from spectune.runtime.prefill_plan import Piece, Riding
from spectune.runtime.request_history import expected_accepts, request_confidences

SimAllocation = Literal["history", "oracle", "uniform"]  # Monte-Carlo (module doc)
Workload = Literal["open", "closed"]
PrefillFn = Callable[[int], float]  # ms of admitting n requests at once by separate prefill forwards
Lengths = Literal["geometric", "fixed"]


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
    full_tokens: int = 0  # tokens and seconds of the steps that ran at the full concurrency
    full_seconds: float = 0.0  # (serving under load: a closed run without its ramp and drain)
    admitted: int = 0  # requests admitted (each one's first token comes from its prefill)
    prefill_seconds: float = 0.0  # separate prefill forwards (``simulate(prefill=...)``) and, with
    # ``ride``, the steps that carried prompt pieces with no live request; else 0
    end_to_end: bool = False  # a prefill model was given: ``output_tok_s`` is defined
    ride_steps: int = 0  # decode steps that carried prompt pieces (``simulate(ride=...)``)
    idle_rows: int = 0  # rows that rode a step after their request ended (``simulate(host_lag=True)``)

    @property
    def output_tok_s(self) -> float | None:
        """End to end: every output token (the prefills' first ones too) over decode and prefill
        time (the riding steps are decode steps: their pieces' cost is in ``seconds``); None
        without a prefill model."""
        if not self.end_to_end:
            return None
        return (self.tokens + self.admitted) / (self.seconds + self.prefill_seconds)


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    cw = np.cumsum(weights[order])
    i = int(np.searchsorted(cw, q * cw[-1]))
    return float(values[order][min(i, len(values) - 1)])


# counter-based uniforms: request j's class, length and the difficulty of each of its output
# tokens are pure functions of (seed, j, token), so arms run with one seed see the same requests
# and the same acceptance draws whatever K they verify (common random numbers)
_STREAM_CLASS, _STREAM_LENGTH, _STREAM_TIE, _STREAM_TOKEN, _STREAM_REPLAY = 0, 1, 2, 3, 4
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


def _grant(survival: np.ndarray, k: int, budget: int, allocation: SimAllocation, tie: np.ndarray) -> np.ndarray:
    """Drafts granted per request [b] from a per-request survival estimate [b, K] (non-increasing
    per request, so each grant is a prefix); ``tie`` [b] breaks ties between like requests."""
    b = survival.shape[0]
    if budget >= b * k:
        return np.full(b, k)
    if allocation == "uniform":
        q, r = divmod(budget, b)
        g = np.full(b, q)
        g[np.argsort(tie, kind="stable")[:r]] += 1
        return g
    # top-B (request, position) pairs by survival; within a request positions go in order
    pos = np.tile(np.arange(k), b)
    chosen = np.lexsort((pos, np.repeat(tie, k), -survival.reshape(-1)))[:budget]
    return np.bincount(chosen // k, minlength=b)


@dataclass(frozen=True)
class _Traffic:
    """Where each request's true rates come from: the classes of ``acceptance`` and, with drift,
    those of the second model, appended (class ids ``>= n_first`` are the second model's)."""

    accept: np.ndarray  # [C_A + C_B, max_k] true conditional rates per class
    cum_first: np.ndarray  # [C_A] cumulative class weights of the first model
    cum_second: np.ndarray | None  # [C_B] ... of the drift model
    prior: np.ndarray  # [max_k] population rates a runtime knows without a policy estimate

    @classmethod
    def of(cls, acceptance: AcceptanceModel, drift: AcceptanceModel | None, accept_scale: float) -> _Traffic:
        k = max(acceptance.max_k, drift.max_k if drift is not None else 1)
        first = Mixture.of(acceptance, k)
        second = Mixture.of(drift, k) if drift is not None else None
        accept = first.accept if second is None else np.concatenate([first.accept, second.accept])
        mean = first.weights @ first.survival  # [K] population mean survival of what was tuned on
        prior = np.ones(k)
        prior[0] = mean[0]
        np.divide(mean[1:], mean[:-1], out=prior[1:], where=mean[:-1] > 0)
        return cls(np.clip(accept * accept_scale, 0.0, 1.0), np.cumsum(first.weights),
                   None if second is None else np.cumsum(second.weights), np.clip(prior, 0.0, 1.0))

    @property
    def max_k(self) -> int:
        return int(self.accept.shape[1])

    def classes(self, seed: int, ids: np.ndarray, second: np.ndarray | bool) -> np.ndarray:
        """Class of each request ``ids`` [n]; ``second`` [n] (or one bool): drawn from the drift model."""
        u = crn_uniform(seed, _STREAM_CLASS, ids)
        cls = np.minimum(np.searchsorted(self.cum_first, u, side="right"), len(self.cum_first) - 1)
        if self.cum_second is None:
            return cls
        late = np.minimum(np.searchsorted(self.cum_second, u, side="right"), len(self.cum_second) - 1)
        return np.where(second, len(self.cum_first) + late, cls)


@dataclass
class _Replay:
    """Token replay of recorded requests (module doc): request j plays ``order[j % N], order[(j + 1)
    % N], ...`` end to end (``trace_steps.played``), its runs built as its output grows."""

    runs: list[np.ndarray]  # per recorded request [T]: right drafts left at each output index
    order: np.ndarray  # [N] seeded permutation of the recorded requests
    lengths: list[int]  # per recorded request: T (``played``'s input)
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # request id -> runs over its output

    @classmethod
    def of(cls, steps: Sequence[Any], seed: int) -> _Replay:
        runs = [r.runs for r in steps]  # (made once per recorded request, kept by the model)
        return cls(runs, np.random.default_rng([seed, _STREAM_REPLAY]).permutation(len(runs)), [len(r) for r in runs])

    def run_at(self, req: np.ndarray, made: np.ndarray) -> np.ndarray:
        """[b] right drafts from output index ``made`` on, for requests ``req``."""
        out = np.empty(len(req), np.int64)
        for j, (i, n) in enumerate(zip(req.tolist(), made.tolist(), strict=True)):
            row = self.rows.get(i)
            if row is None or len(row) <= n:  # (rebuilt at least twice as long: a few times a request)
                need = max(n + 1, 2 * len(row)) if row is not None else n + 1
                row = self.rows[i] = np.concatenate([self.runs[r] for r in played(self.lengths, self.order, i, need)])
            out[j] = row[n]
        return out

    def forget(self, req: np.ndarray) -> None:
        for i in req.tolist():
            self.rows.pop(i, None)


@dataclass
class _Batch:
    """The live requests, one entry per slot."""

    req: np.ndarray  # [b] request id (arrival order)
    cls: np.ndarray  # [b] class (row of _Traffic.accept)
    remaining: np.ndarray  # [b] output tokens still to emit
    made: np.ndarray  # [b] output tokens emitted so far
    acc: np.ndarray  # [b] drafts accepted so far (request history)
    exp: np.ndarray  # [b] drafts expected to be accepted on the positions it was tested on
    last: np.ndarray  # [b] tokens emitted at the last step (0: none yet)

    def keep(self, mask: np.ndarray) -> None:
        for name in ("req", "cls", "remaining", "made", "acc", "exp", "last"):
            setattr(self, name, getattr(self, name)[mask])

    def join(self, req: np.ndarray, cls: np.ndarray, remaining: np.ndarray) -> None:
        """New live requests after the others, with no output and no history yet."""
        zeros = np.zeros(len(req))
        for name, x in (("req", req), ("cls", cls), ("remaining", remaining), ("made", zeros.astype(np.int64)),
                        ("acc", zeros), ("exp", zeros), ("last", zeros.astype(np.int64))):
            setattr(self, name, np.concatenate([getattr(self, name), x]))


@dataclass
class _Filling:
    """Admitted requests whose prompts ride in the steps (``simulate(ride=...)``), in admission
    order: id, class and output length drawn at admission, prompt tokens cached so far."""

    req: list[int] = field(default_factory=list)
    cls: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    # admitted ahead (``Riding.ahead``): prompt cached, waiting for a free slot (id, class, length)
    ready: list[tuple[int, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req)

    def add(self, req: np.ndarray, cls: np.ndarray, remaining: np.ndarray) -> None:
        self.req += req.tolist()
        self.cls += cls.tolist()
        self.remaining += remaining.tolist()
        self.done += [0] * len(req)

    def advance(self, pieces: Sequence[Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Count the step's pieces; the requests whose prompt ended leave (id, class, output
        length, in order)."""
        for p in pieces:
            self.done[p.index] += p.length
        ended = sorted({p.index for p in pieces if p.last})

        def pick(x: list[int]) -> np.ndarray:
            return np.array([x[j] for j in ended], np.int64)

        out = pick(self.req), pick(self.cls), pick(self.remaining)
        for name in ("req", "cls", "remaining", "done"):
            setattr(self, name, [x for j, x in enumerate(getattr(self, name)) if j not in ended])
        return out


@dataclass
class _Tally:
    lat: list[np.ndarray] = field(default_factory=list)  # per step: ms per emitted token [b]
    wts: list[np.ndarray] = field(default_factory=list)  # per step: tokens emitted [b]
    k_hist: dict[int, int] = field(default_factory=dict)
    tier_hist: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    ms: float = 0.0
    joules: float = 0.0
    done: int = 0
    steps: int = 0
    slot_steps: int = 0
    full_tokens: int = 0  # steps at the full concurrency
    full_ms: float = 0.0
    admitted: int = 0
    prefill_ms: float = 0.0
    ride_steps: int = 0
    idle_rows: int = 0


@dataclass(frozen=True)
class _Run:
    """What does not change during one simulation."""

    cost: CostModel
    traffic: _Traffic
    policy: PolicyFn
    seed: int
    allocation: SimAllocation
    closed: bool
    requests: int | None
    steps: int
    mean_output_tokens: float
    lengths: Lengths
    prior: np.ndarray  # [max_k] rates used when the policy has no live estimate
    prefill: PrefillFn | None = None  # ms of admitting n requests at once (separate forwards)
    ride: Riding | None = None  # mixed prefill: prompts ride in the steps
    host_lag: bool = False  # a request whose last step emitted >= 2 tokens rides one more step idle
    replay: _Replay | None = None  # a trace set replayed token by token (module doc)


def _new_requests(run: _Run, ids: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Classes and output lengths of requests ``ids`` arriving at ``step``. With drift, requests
    of the second half draw from the second model: closed, id >= requests // 2; open, arriving at
    step >= steps // 2."""
    second = ids >= (run.requests or 0) // 2 if run.closed else step >= run.steps // 2
    cls = run.traffic.classes(run.seed, ids, second)
    if run.lengths == "fixed":
        return cls, np.full(len(ids), max(1, round(run.mean_output_tokens)), np.int64)
    p_end = 1.0 / max(1.0, run.mean_output_tokens)
    if p_end >= 1.0:
        return cls, np.ones(len(ids), np.int64)
    u = crn_uniform(run.seed, _STREAM_LENGTH, ids)
    length = np.ceil(np.log1p(-u) / math.log1p(-p_end))  # geometric on 1, 2, ...
    return cls, np.maximum(1, length).astype(np.int64)


def _start_batch(run: _Run, concurrency: int) -> _Batch:
    b = min(concurrency, run.requests) if run.closed and run.requests is not None else concurrency
    req = np.arange(b, dtype=np.int64)
    cls, remaining = _new_requests(run, req, 0)
    return _Batch(req, cls, remaining, np.zeros(b, np.int64), np.zeros(b), np.zeros(b), np.zeros(b, np.int64))


def _live_rates(run: _Run) -> np.ndarray:
    """[max_k] the population rates the runtime ranks with: the policy's live estimate
    (``Planner.rates``) when it has one, else the prior."""
    rates = getattr(run.policy, "rates", None)
    if rates is None:
        return run.prior
    r = np.asarray(list(rates), dtype=float)[: len(run.prior)]
    return np.concatenate([r, run.prior[len(r):]]) if len(r) < len(run.prior) else r


def _allocate(run: _Run, batch: _Batch, k: int, budget: int, rates: np.ndarray) -> np.ndarray:
    """Drafts granted per request [b]. history: ranked by each request's own accepted / expected
    counts shrunk toward ``rates`` (``request_history``); oracle: by its class's true survival
    (what no runtime knows, for comparison); uniform: evenly."""
    tie = crn_uniform(run.seed, _STREAM_TIE, batch.req, batch.made)
    if run.allocation == "oracle":
        conf = run.traffic.accept[batch.cls, :k]  # [b, K] the truth
    else:
        conf = request_confidences(rates[:k], batch.acc, batch.exp)  # [b, K]
    return _grant(np.cumprod(conf, 1), k, budget, run.allocation, tie)


def _verify(run: _Run, batch: _Batch, k: int, granted: np.ndarray, rates: np.ndarray):
    """Accept the granted drafts against the true rates; update each request's history.
    Returns accepted [b] and the step's counters (accepted, tested per position) [K] each."""
    cols = np.arange(k)[None, :]
    if run.replay is not None:
        accepted = np.minimum(run.replay.run_at(batch.req, batch.made), granted)
    else:
        u = crn_uniform(run.seed, _STREAM_TOKEN, batch.req[:, None], batch.made[:, None] + cols)
        ok = (u < run.traffic.accept[batch.cls, :k]) & (cols < granted[:, None])
        accepted = np.cumprod(ok, 1).sum(1)
    tested = (cols < granted[:, None]) & (cols <= accepted[:, None])
    batch.acc = batch.acc + accepted
    batch.exp = batch.exp + expected_accepts(np.concatenate([[0.0], np.cumsum(rates[:k])]), granted, accepted)
    return accepted, ((cols < accepted[:, None]).sum(0), tested.sum(0))


def _account(run: _Run, tally: _Tally, batch: _Batch, plan: Plan, k: int, accepted: np.ndarray,
             full: bool, pieces: Sequence[Piece] = ()) -> float:
    assert plan.tier is not None
    b = len(batch.req)
    emitted = np.maximum(np.minimum(accepted + 1, batch.remaining), 0)  # an idle row (host lag): none
    if pieces:  # prompt pieces ride in this step's forward
        assert run.ride is not None
        ms = step_ms(run.cost, b, k, plan.tier, *run.ride.carried(pieces))
        tally.ride_steps += 1
    else:
        ms = step_ms(run.cost, b, k, plan.tier)
    live = emitted > 0
    tally.lat.append(ms / emitted[live])
    tally.wts.append(emitted[live])
    tally.tokens += int(emitted.sum())
    tally.ms += ms
    if full:
        tally.full_tokens += int(emitted.sum())
        tally.full_ms += ms
    power = run.cost.power_w(plan.tier)
    if power is not None:
        tally.joules += float(power) * ms / 1000.0
    tally.k_hist[k] = tally.k_hist.get(k, 0) + 1
    tally.tier_hist[plan.tier] = tally.tier_hist.get(plan.tier, 0) + 1
    tally.steps += 1
    tally.slot_steps += int(live.sum())
    tally.idle_rows += b - int(live.sum())
    batch.remaining = batch.remaining - emitted
    batch.made = batch.made + emitted
    batch.last = emitted
    return ms


def _retire_and_refill(run: _Run, tally: _Tally, batch: _Batch, next_req: int, step: int) -> int:
    """Finished requests leave (with ``host_lag``, a step later where the engine learns the end a
    step late: ``_finished``); queued (closed) or new (open) ones take their slots, with a fresh
    history. Returns the next request id."""
    finished = _finished(run, batch)
    if not finished.any():
        return next_req
    tally.done += int(finished.sum())
    keep = np.ones(len(batch.req), bool)
    if run.closed:  # refill from the queue; slots without a request leave the batch
        assert run.requests is not None
        idx = np.flatnonzero(finished)
        left = max(0, run.requests - next_req)
        finished = np.zeros(len(batch.req), bool)
        finished[idx[:left]] = True
        keep[idx[left:]] = False
    n_new = int(finished.sum())
    if run.replay is not None:
        run.replay.forget(batch.req[finished])
    batch.req[finished] = np.arange(next_req, next_req + n_new)
    batch.cls[finished], batch.remaining[finished] = _new_requests(run, batch.req[finished], step)
    batch.made[finished], batch.acc[finished], batch.exp[finished], batch.last[finished] = 0, 0.0, 0.0, 0
    if not keep.all():
        batch.keep(keep)
    return next_req + n_new


def _arrive(run: _Run, tally: _Tally, batch: _Batch, filling: _Filling, next_req: int, concurrency: int,
            step: int, width: int = 1) -> int:
    """Mixed prefill (``run.ride``): finished requests leave, ready ones (admitted ahead) take the
    free slots first, and new ones the rest (closed: while the queue lasts): riding (they wait in
    ``filling``) or, a burst with nothing filling, by separate prefill forwards (live at once).
    ``width``: K + 1 of the step just run. Returns the next request id."""
    finished = _finished(run, batch)
    if finished.any():
        tally.done += int(finished.sum())
        batch.keep(~finished)
    assert run.ride is not None
    if filling.ready:  # requests admitted ahead whose prompts are cached take the free slots first
        room = max(0, concurrency - len(batch.req))
        joining, filling.ready = filling.ready[:room], filling.ready[room:]
        if joining:
            r, c, m = (np.array(x, np.int64) for x in zip(*joining, strict=True))
            batch.join(r, c, m)
    free = concurrency - len(batch.req) - len(filling) - len(filling.ready)
    left = (run.requests or 0) - next_req if run.closed else concurrency  # (open: no end to the queue)
    n = min(free, left)
    if n > 0:
        ids = np.arange(next_req, next_req + n)
        cls, remaining = _new_requests(run, ids, step)
        if run.ride.rides(n, len(filling)):
            filling.add(ids, cls, remaining)
        else:  # a burst: live at once (no admission ahead beside it)
            batch.join(ids, cls, remaining)
            _admit(run, tally, n)
            return next_req + n
        next_req += n
    # admission ahead: a row that may be done after the coming step, as the engine can tell (its
    # host has the tokens of the step before the one in flight: remaining + last; the step in
    # flight and the coming one emit at most K + 1 each) lends its slot to a successor whose
    # whole prompt rides in that step (``Riding.ends_next``: riding admissions only). The
    # successor waits ready where the row has not ended yet, and joins as a slot frees. Live +
    # ready + filling stay within the concurrency plus those rows.
    ending = int(((batch.remaining + batch.last) <= 2 * width).sum()) if run.ride.ahead else 0
    extra = min(ending, free - max(n, 0) + ending, left - max(n, 0))
    done, take = list(filling.done), 0
    while take < extra and run.ride.rides(take + 1, len(filling)) and run.ride.ends_next([*done, 0]):
        done.append(0)
        take += 1
    if take > 0:
        ids = np.arange(next_req, next_req + take)
        cls, remaining = _new_requests(run, ids, step)
        filling.add(ids, cls, remaining)
        next_req += take
    return next_req


def _finished(run: _Run, batch: _Batch) -> np.ndarray:
    """[b] the rows that leave after this step: those done, except, with ``host_lag``, one whose
    last step emitted two or more tokens. The engine's host plans a step while the device runs
    the one before, so it has the tokens of two steps back: it knows a request is done when that
    step left it one token to emit (the step in flight emits one), and not when the step in
    flight emitted more. Such a request rides the next step as an idle row (one slot, no drafts,
    no output: ``RunResult.idle_rows``) and its successor is admitted after it."""
    done = batch.remaining <= 0
    return done & (batch.last < 2) if run.host_lag else done


def _join(run: _Run, tally: _Tally, batch: _Batch, filling: _Filling, pieces: Sequence[Piece],
          concurrency: int) -> None:
    """After a step that carried ``pieces``: the requests whose prompt ended join the batch; the
    last piece's logits gave each its first token. Admitted ahead (``Riding.ahead``), those
    without a free slot wait ready."""
    req, cls, remaining = filling.advance(pieces)
    if len(req):
        tally.admitted += len(req)
        if run.ride is not None and run.ride.ahead:
            room = max(0, concurrency - len(batch.req))
            filling.ready += list(zip(req[room:].tolist(), cls[room:].tolist(), remaining[room:].tolist(), strict=True))
            req, cls, remaining = req[:room], cls[:room], remaining[:room]
        if len(req):
            batch.join(req, cls, remaining)


def _alone_ms(run: _Run, pieces: Sequence[Piece]) -> float:
    """No live request: the pieces alone in the smallest tier's step (plain, no request)."""
    assert run.ride is not None
    tiers = getattr(run.policy, "tiers", None)
    return step_ms(run.cost, 0, 0, min(tiers) if tiers else 0, *run.ride.carried(pieces))


def _admit(run: _Run, tally: _Tally, n: int) -> None:
    """n requests admitted at once: their first tokens, and their prefill's time if modelled."""
    if n > 0:
        tally.admitted += n
        if run.prefill is not None:
            tally.prefill_ms += run.prefill(n)


def _result(run: _Run, tally: _Tally) -> SimResult:
    all_lat, all_w = np.concatenate(tally.lat), np.concatenate(tally.wts).astype(float)
    has_power = run.cost.power_w(1) is not None
    return SimResult(
        goodput_tok_s=tally.tokens / tally.ms * 1000.0,
        itl_p50_ms=_weighted_quantile(all_lat, all_w, 0.50),
        itl_p99_ms=_weighted_quantile(all_lat, all_w, 0.99),
        joules_per_token=tally.joules / tally.tokens if has_power else None,
        mean_accept_len=tally.tokens / max(1, tally.slot_steps),
        k_hist=dict(sorted(tally.k_hist.items())),
        steps=tally.steps,
        tokens=tally.tokens,
        seconds=tally.ms / 1000.0,
        requests_done=tally.done,
        tier_hist=dict(sorted(tally.tier_hist.items())),
        full_tokens=tally.full_tokens,
        full_seconds=tally.full_ms / 1000.0,
        admitted=tally.admitted,
        prefill_seconds=tally.prefill_ms / 1000.0,
        end_to_end=run.prefill is not None,
        ride_steps=tally.ride_steps,
        idle_rows=tally.idle_rows,
    )


def simulate(cost: CostModel, acceptance: AcceptanceModel, policy_fn: PolicyFn, *, concurrency: int,
             context_len: int | None = None, steps: int = 2000, requests: int | None = None,
             seed: int = 0, allocation: SimAllocation = "history", accept_scale: float = 1.0,
             mean_output_tokens: float = 256.0, workload: Workload = "open",
             lengths: Lengths = "geometric", drift: AcceptanceModel | None = None,
             prior: Sequence[float] | None = None, prefill: PrefillFn | None = None,
             ride: Riding | None = None, host_lag: bool = False) -> SimResult:
    """Run ``concurrency`` live requests for ``steps`` steps (or until ``requests`` finished).

    ``workload``: "open" keeps the batch full (a finished request is replaced at once, a server
    under steady load); "closed" serves exactly ``requests`` requests queued at the start, so the
    batch drains once the queue is empty (a benchmark run; ``requests`` required).

    Request j (in arrival order) has a class, an output length (``lengths``: geometric with mean
    ``mean_output_tokens``, or exactly that many) and a uniform per output token; draft i of a step
    that starts at output token n is accepted when the uniform of token n + i is below the class's
    conditional rate a_i. Two runs with one seed therefore share requests and draws (common random
    numbers): the ratio of two policies' goodputs is not blurred by different samples.

    ``drift``: a second acceptance model; requests of the second half (closed: id >= requests // 2;
    open: arriving at step >= steps // 2) draw their class from it. ``accept_scale`` scales every
    true conditional rate. A trace set's model (``acceptance.replay``) is replayed token by token
    (module doc) without drift and at ``accept_scale`` 1. ``allocation`` (module doc) ranks by what a runtime knows unless it is
    "oracle"; ``prior`` [max_k]: the population rates used while the policy has no ``rates``
    (default: the mean curve of ``acceptance``). ``policy_fn.observe`` (if any) gets each step's
    acceptance counters one step late: accepted and tested drafts per position (a draft is tested
    when it was granted and every draft before it was accepted), and ``policy_fn.observe_time``
    (if any) each step's (batch, plan, ms) one step late. ``cost`` is the served GPU's: a planner
    built on another table's cost model (``spectune simulate --served-cost``) sees what its model
    does not know through those times.

    ``prefill(n)``: the ms of admitting n requests at once by separate prefill forwards (the
    engine's schedule; ``spectune.runtime.prefill_plan.prefill_ms``), charged at the start and at every
    refill, apart from the decode steps: ``SimResult.prefill_seconds`` and ``output_tok_s``. The
    decode figures do not include it.

    ``ride`` (mixed prefill, with ``prefill`` for the bursts): an admission that rides
    (``Riding.rides``) waits while its prompt's pieces ride in the steps (``Riding.pieces``); a
    step carrying pieces costs ``step_ms`` with what they carry (``Riding.carried``) and is not reported to
    ``observe_time`` (the engine does not report it either); a request joins the batch after its
    last piece, so the batch runs below the concurrency while prompts fill. A step of pieces with
    no live request counts in ``prefill_seconds``; the riding steps count in the decode figures,
    as the engine's decode time holds them.

    ``host_lag``: the reference engine's host runs a step ahead of the device, so a request that
    ended on a step that emitted two or more of its tokens rides one more step as an idle row
    before it leaves (``_finished``; the engine's ``RunResult.idle_rows``). Off: a request leaves
    the step it ends (an engine that reads each step's tokens before planning the next).
    """
    if concurrency < 1:
        raise SpectuneError(f"concurrency must be >= 1, got {concurrency}")
    closed = workload == "closed"
    if closed and (requests is None or requests < 1):
        raise SpectuneError("a closed workload needs requests >= 1")
    if allocation not in ("history", "oracle", "uniform"):
        raise SpectuneError(f"allocation must be history, oracle or uniform, got {allocation!r}")
    if context_len is not None:
        cost = dataclasses.replace(cost, context_len=context_len)
    if ride is not None and prefill is None:
        raise SpectuneError("ride needs prefill: a burst above the ride limit takes separate forwards")
    traffic = _Traffic.of(acceptance, drift, accept_scale)
    base = traffic.prior if prior is None else np.asarray(extend_conditional(tuple(prior), traffic.max_k), float)
    replay = (_Replay.of(acceptance.replay, seed)
              if acceptance.replay is not None and drift is None and accept_scale == 1.0 else None)
    run = _Run(cost, traffic, policy_fn, seed, allocation, closed, requests, steps, mean_output_tokens, lengths,
               np.clip(base[: traffic.max_k], 0.0, 1.0), prefill, ride, host_lag, replay)
    return _serve(run, concurrency)


_NO_COUNTS = np.zeros(1, np.int64)


def _serve(run: _Run, concurrency: int) -> SimResult:
    """The step loop: observe -> plan -> allocate -> verify -> account -> retire and refill (with
    mixed prefill: the step carries the filling prompts' next pieces, the requests whose prompt
    ended join, then retire and admit)."""
    tally, filling = _Tally(), _Filling()
    if run.ride is None:
        batch = _start_batch(run, concurrency)
        next_req = len(batch.req)
        _admit(run, tally, next_req)
    else:  # the first wave rides, or is a burst of separate forwards
        none = np.zeros(0, np.int64)
        batch = _Batch(none, none, none, none, np.zeros(0), np.zeros(0), none)
        next_req = _arrive(run, tally, batch, filling, 0, concurrency, 0)
    pending = None
    observe = getattr(run.policy, "observe", None)
    observe_time = getattr(run.policy, "observe_time", None)
    plan_ride = getattr(run.policy, "plan_ride", None)
    timed: tuple[int, Plan, float] | None = None
    for step in range(run.steps):
        pieces = run.ride.pieces(filling.done) if run.ride is not None and filling else []
        b = len(batch.req)
        if b == 0:  # no live request, prompts filling (mixed prefill): their pieces alone
            if not pieces:
                break
            tally.prefill_ms += _alone_ms(run, pieces)
            _join(run, tally, batch, filling, pieces, concurrency)
            continue
        if pending is not None and observe is not None:
            observe(*pending)
        if timed is not None and observe_time is not None:
            observe_time(*timed)  # the step's time under the served cost model, one step late
        # a riding step's shape may differ from the choice (``Planner.plan_ride``: prompt tokens
        # past the compute knee make verify tokens dearer)
        plan = (plan_ride(b, run.ride.carried(pieces)[0]) if pieces and plan_ride is not None and run.ride is not None
                else run.policy.plan(b))
        if plan.tier is None or plan.tier < b + plan.verify_budget:
            raise InvalidPolicy(f"batch {b}: no captured tier holds {b + plan.verify_budget} tokens")
        k = min(plan.k, run.traffic.max_k)
        # a K = 0 step observes zero counters, as the engine's does: time passes for the estimate
        accepted, pending = np.zeros(b, np.int64), (_NO_COUNTS, _NO_COUNTS)
        if k:
            rates = _live_rates(run)
            granted = _allocate(run, batch, k, min(plan.verify_budget, b * k), rates)
            granted[batch.remaining <= 0] = 0  # an idle row (host lag) drafts nothing
            accepted, pending = _verify(run, batch, k, granted, rates)
        ms = _account(run, tally, batch, plan, k, accepted, b == concurrency, pieces)
        timed = None if pieces else (b, plan, ms)  # a step that carried pieces is not the plan's cost
        if run.ride is None:
            refilled = _retire_and_refill(run, tally, batch, next_req, step + 1)
            _admit(run, tally, refilled - next_req)
            next_req = refilled
        else:
            _join(run, tally, batch, filling, pieces, concurrency)
            next_req = _arrive(run, tally, batch, filling, next_req, concurrency, step + 1, k + 1)
        if (len(batch.req) == 0 and not filling) or (run.requests is not None and tally.done >= run.requests):
            break
    return _result(run, tally)


__all__ = ["Allocation", "FixedK", "InvalidPolicy", "Mixture", "PolicyFn", "SimAllocation", "SimResult",
           "crn_uniform", "expected_goodput", "expected_tokens", "inflight_weights", "simulate"]
