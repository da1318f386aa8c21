import dataclasses

import numpy as np
import pytest

from spectune.autotune.acceptance import AcceptanceModel
from spectune.autotune.simulator import (
    FixedK,
    InvalidPolicy,
    Mixture,
    expected_goodput,
    expected_tokens,
    inflight_weights,
    simulate,
)
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Plan
from spectune.runtime.prefill_plan import Piece, Riding, default_buckets
from spectune.runtime.table import (
    CostModelParams,
    DrafterCost,
    OverheadCost,
    PowerModel,
    TargetCost,
)


def constant_cost(ms: float = 10.0, power: bool = True) -> CostModel:
    p = CostModelParams(TargetCost(ms, 0.0, 1e9, 0.0, 0.0), DrafterCost(0.0, 0.0, 0.0),
                        OverheadCost(0.0, 0.0), PowerModel(100.0, 100.0, 1.0) if power else None)
    return CostModel(p, "autoregressive", 128)


def curve(*s: float, max_k: int | None = None) -> AcceptanceModel:
    return AcceptanceModel.from_survival(list(s), max_k=max_k or len(s), source="test")


def test_one_request_hand_case():
    acc = curve(0.5, 0.25)
    assert expected_tokens(Mixture.of(acc), 1, 2, [0, 1, 2]) == pytest.approx([1.0, 1.5, 1.75])
    assert expected_goodput(constant_cost(10.0), acc, 1, 2, 2, 3) == pytest.approx(175.0)


def test_survival_allocation_prefers_easy_requests():
    # two classes: easy s = [0.9, 0.8], hard s = [0.1, 0.01]; b = 2, budget 2
    mix = Mixture(np.array([0.5, 0.5]), np.array([[0.9, 0.8 / 0.9], [0.1, 0.1]]),
                  np.array([[0.9, 0.8], [0.1, 0.01]]))
    surv = expected_tokens(mix, 2, 2, [2], "survival")[0]
    uni = expected_tokens(mix, 2, 2, [2], "uniform")[0]
    # counts: (2 easy) p=.25 -> 1.8; (1,1) p=.5 -> 0.9+0.8; (2 hard) p=.25 -> 0.2
    assert surv == pytest.approx(2 + 0.25 * 1.8 + 0.5 * 1.7 + 0.25 * 0.2)
    assert uni == pytest.approx(2 + 2 * 0.5)  # each request one draft: 2 * mean s_1
    assert surv > uni


def test_full_budget_equals_mean_curve():
    mix = Mixture.of(AcceptanceModel.mixture_with_same_mean([0.8, 0.6, 0.4], max_k=3, spread=0.8))
    mean = mix.weights @ mix.survival
    for b in (1, 3, 7):
        assert expected_tokens(mix, b, 3, [3 * b])[0] == pytest.approx(b * (1 + mean.sum()))


def test_monte_carlo_matches_expectation():
    acc = curve(0.8, 0.6, 0.4)
    cost = constant_cost()
    res = simulate(cost, acc, FixedK(3), concurrency=4, steps=3000, seed=3, mean_output_tokens=1e9)
    assert res.mean_accept_len == pytest.approx(1 + 0.8 + 0.6 + 0.4, rel=0.03)
    assert res.goodput_tok_s == pytest.approx(4 * 2.8 / 10.0 * 1000, rel=0.03)
    assert res.joules_per_token == pytest.approx(100 * 0.010 / (4 * 2.8), rel=0.03)
    assert res.k_hist == {3: 3000}
    assert res.itl_p99_ms == pytest.approx(10.0)  # requests that emit one token wait a whole step
    assert res.itl_p50_ms < res.itl_p99_ms


def test_seeded_and_deterministic():
    acc = AcceptanceModel.mixture_with_same_mean([0.8, 0.6, 0.4], max_k=3)
    kw = dict(concurrency=5, steps=200, mean_output_tokens=20.0)
    a = simulate(constant_cost(), acc, FixedK(2), seed=7, **kw)
    b = simulate(constant_cost(), acc, FixedK(2), seed=7, **kw)
    assert a == b
    assert a.requests_done > 0


def test_plain_and_invalid_policy():
    res = simulate(constant_cost(power=False), curve(0.8), FixedK(0), concurrency=3, steps=10)
    assert res.mean_accept_len == 1.0 and res.joules_per_token is None

    class TooBig:
        def plan(self, b):
            return Plan(2, 2 * b, b)  # tier smaller than b + budget

    with pytest.raises(InvalidPolicy, match="no captured tier"):
        simulate(constant_cost(), curve(0.8, 0.5), TooBig(), concurrency=2, steps=5)


def test_drift_scale_lowers_acceptance():
    acc = curve(0.9, 0.8)
    hi = simulate(constant_cost(), acc, FixedK(2), concurrency=4, steps=500, seed=1)
    lo = simulate(constant_cost(), acc, FixedK(2), concurrency=4, steps=500, seed=1, accept_scale=0.3)
    assert lo.mean_accept_len < hi.mean_accept_len


def test_common_random_numbers_share_requests_across_arms():
    acc = AcceptanceModel.mixture_with_same_mean([0.8, 0.6, 0.4], max_k=3, spread=0.9)
    kw = dict(concurrency=1, steps=100_000, requests=30, mean_output_tokens=40.0, seed=5)
    # one request at a time: whatever K, the arms emit exactly the first 30 requests' tokens
    runs = [simulate(constant_cost(), acc, FixedK(k), **kw) for k in range(4)]
    assert len({r.tokens for r in runs}) == 1 and all(r.requests_done == 30 for r in runs)
    assert runs[3].steps < runs[0].steps
    other = simulate(constant_cost(), acc, FixedK(0), **{**kw, "seed": 6})
    assert other.tokens != runs[0].tokens


def test_crn_uniform_is_uniform_and_keyed():
    from scipy.stats import kstest

    from spectune.autotune.simulator import crn_uniform

    u = crn_uniform(3, 1, np.arange(200)[:, None], np.arange(50)[None, :])
    assert u.shape == (200, 50) and kstest(u.reshape(-1), "uniform").pvalue > 1e-3
    assert np.array_equal(u, crn_uniform(3, 1, np.arange(200)[:, None], np.arange(50)[None, :]))
    assert not np.allclose(u, crn_uniform(4, 1, np.arange(200)[:, None], np.arange(50)[None, :]))


def test_crn_seeds_are_not_shifted_copies_of_each_other():
    from spectune.autotune.simulator import crn_uniform

    # a key that were a multiple of the index step made seed s + 1 equal seed s four indices on
    a = crn_uniform(0, 3, np.arange(20)[:, None], np.arange(64)[None, :])
    for seed in (1, 2, 7):
        b = crn_uniform(seed, 3, np.arange(20)[:, None], np.arange(64)[None, :])
        shared = np.intersect1d(a.reshape(-1), b.reshape(-1))
        assert shared.size == 0
    for stream in (0, 1, 2):  # streams of one seed neither
        b = crn_uniform(0, stream, np.arange(20)[:, None], np.arange(64)[None, :])
        assert np.intersect1d(a.reshape(-1), b.reshape(-1)).size == 0


def test_closed_workload_serves_the_queue_then_drains():
    acc = curve(0.8, 0.6, 0.45)
    kw = dict(concurrency=4, steps=100_000, requests=10, mean_output_tokens=12.0, seed=2,
              workload="closed", lengths="fixed")
    batches: list[int] = []

    class Spy(FixedK):
        def plan(self, batch_size):
            batches.append(batch_size)
            return super().plan(batch_size)

    res = simulate(constant_cost(), acc, Spy(2), **kw)
    assert res.requests_done == 10 and res.tokens == 10 * 12  # every request, exactly its length
    assert batches[0] == 4 and batches[-1] < 4 and batches == sorted(batches, reverse=True)
    assert res.mean_accept_len == pytest.approx(res.tokens / sum(batches))
    plain = simulate(constant_cost(), acc, FixedK(0), **kw)
    assert plain.steps == 3 * 12  # 10 requests of 12 tokens, 4 at a time: 3 waves, no overlap
    fewer = simulate(constant_cost(), acc, FixedK(2), **{**kw, "requests": 2})
    assert fewer.requests_done == 2  # concurrency above the queue: the batch is the queue
    with pytest.raises(SpectuneError, match="closed workload needs requests"):
        simulate(constant_cost(), acc, FixedK(2), **{**kw, "requests": None})


def test_full_load_counts_only_the_steps_at_full_concurrency():
    """Plain decoding of fixed-length requests runs whole waves (every step at full
    concurrency); a drafting arm's requests finish at spread-out steps, so its closed run ends in
    a drain that the full-load figures leave out. An open run is at full load throughout."""
    acc = curve(0.8, 0.6, 0.45)
    kw = dict(concurrency=4, steps=100_000, requests=16, mean_output_tokens=12.0, seed=2,
              workload="closed", lengths="fixed")
    plain = simulate(constant_cost(), acc, FixedK(0), **kw)
    assert plain.full_tokens == plain.tokens and plain.full_seconds == pytest.approx(plain.seconds)
    drafting = simulate(constant_cost(), acc, FixedK(2), **kw)
    assert 0 < drafting.full_tokens < drafting.tokens and drafting.full_seconds < drafting.seconds
    opened = simulate(constant_cost(), acc, FixedK(2), concurrency=4, steps=50, seed=2)
    assert opened.full_tokens == opened.tokens


def test_open_workload_keeps_the_batch_full():
    batches: list[int] = []

    class Spy(FixedK):
        def plan(self, batch_size):
            batches.append(batch_size)
            return super().plan(batch_size)

    simulate(constant_cost(), curve(0.8, 0.6), Spy(2), concurrency=4, steps=200, mean_output_tokens=5.0)
    assert set(batches) == {4}


def test_inflight_mix_is_harmonic_at_batch_one():
    # easy requests emit 1 + 0.9 + 0.8 tokens per step, hard ones 1 + 0.1 + 0.01: hard requests stay
    # longer, so one request at a time yields the harmonic mean of tokens per step
    acc = AcceptanceModel.from_dict({"source": "t", "max_k": 2, "components": [
        {"weight": 0.5, "accept": [0.9, 0.8 / 0.9]}, {"weight": 0.5, "accept": [0.1, 0.1]}]})
    mix = Mixture.of(acc)
    tau = np.array([2.7, 1.11])
    harmonic = 1.0 / (0.5 / tau).sum()
    assert expected_tokens(mix, 1, 2, [2], inflight=True)[0] == pytest.approx(harmonic)
    assert expected_tokens(mix, 1, 2, [2])[0] == pytest.approx(tau.mean())
    assert inflight_weights(mix, 1, 2, [2])[0] == pytest.approx(0.5 / tau / (0.5 / tau).sum())


@pytest.mark.parametrize("k, budget", [(3, 12), (3, 5)])  # full budget, and a binding one
def test_monte_carlo_matches_inflight_expectation(k, budget):
    acc = AcceptanceModel.mixture_with_same_mean([0.8, 0.6, 0.4], max_k=3, spread=0.9)
    mix = Mixture.of(acc)

    class Fixed:
        def plan(self, b):
            return Plan(k, budget, b + budget)

    # ~2000 requests of ~100 tokens: the class mix in flight is what a server sees
    res = simulate(constant_cost(), acc, Fixed(), concurrency=4, steps=15_000, seed=2, mean_output_tokens=100.0)
    serving = expected_tokens(mix, 4, k, [budget], inflight=True)[0]
    arrival = expected_tokens(mix, 4, k, [budget])[0]
    assert arrival > 1.05 * serving
    assert res.mean_accept_len * 4 == pytest.approx(serving, rel=0.025)


def test_k0_steps_are_observed_so_the_controller_can_leave_k0():
    """The engine hands the controller counters every step (zeros when K = 0); the simulator
    must too, or a controller at K = 0 never sees time pass and never decides again."""

    class Alternating:
        def __init__(self):
            self.plans = 0
            self.observed = []

        def plan(self, b):
            self.plans += 1
            return Plan(2, 2 * b, 64) if self.plans % 2 else Plan(0, 0, 64)

        def observe(self, accepted, tested):
            self.observed.append((list(accepted), list(tested)))

    pol = Alternating()
    simulate(constant_cost(), curve(0.8, 0.6), pol, concurrency=4, steps=40, seed=0)
    assert len(pol.observed) == 39  # every step but the last, K = 0 steps included
    assert sum(sum(t) for _, t in pol.observed[1::2]) == 0  # after a K = 0 step: nothing tested
    assert all(sum(t) > 0 for _, t in pol.observed[0::2])


def test_prefill_is_charged_at_every_admission_apart_from_the_decode_steps():
    acc = curve(0.8, 0.6, 0.45)
    kw = dict(concurrency=4, steps=100_000, requests=10, mean_output_tokens=12.0, seed=2,
              workload="closed", lengths="fixed")
    calls: list[int] = []

    def prefill(n: int) -> float:
        calls.append(n)
        return 3.0 + 2.0 * n

    for k in (0, 2):
        calls.clear()
        base = simulate(constant_cost(), acc, FixedK(k), **kw)
        res = simulate(constant_cost(), acc, FixedK(k), prefill=prefill, **kw)
        assert sum(calls) == res.admitted == 10 and calls[0] == 4  # the first wave, then each refill
        if k == 0:
            assert calls == [4, 4, 2]  # plain decoding: requests of one wave finish together
        assert res.prefill_seconds == pytest.approx(sum(3.0 + 2.0 * n for n in calls) / 1000.0)
        # the decode figures are the same run's
        assert (res.goodput_tok_s, res.tokens, res.seconds, res.steps) == (base.goodput_tok_s, base.tokens,
                                                                           base.seconds, base.steps)
        assert res.output_tok_s == pytest.approx((res.tokens + 10) / (res.seconds + res.prefill_seconds))
        assert base.output_tok_s is None and base.admitted == 10


def linear_cost(weight: float = 10.0, per_token: float = 0.5) -> CostModel:
    """A target step of weight + per_token x tokens ms (no knee, no KV term, no overhead)."""
    p = CostModelParams(TargetCost(weight, per_token, 1e9, 0.0, 0.0), DrafterCost(0.0, 0.0, 0.0),
                        OverheadCost(0.0, 0.0), None)
    return CostModel(p, "autoregressive", 128)


RIDE_KW = dict(concurrency=3, steps=100_000, requests=7, mean_output_tokens=5.0, seed=1, workload="closed",
               lengths="fixed")


@pytest.mark.parametrize("k", [0, 2])
def test_riding_prompts_are_priced_in_the_steps_that_carry_them(k):
    """Every prompt rides (a ride limit no admission passes): each 8-token prompt is one piece of a
    budget-8 step, so every forward costs weight + 0.5 x (its tier + its 8 prompt tokens); the
    steps with no live request count as prefill, the riding ones as decode steps."""
    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    ride = Riding(8, budget=8, limit=1 << 20)
    prefills: list[int] = []
    res = simulate(cost, acc, FixedK(k), prefill=lambda n: prefills.append(n) or 0.0, ride=ride, **RIDE_KW)
    assert prefills == []  # nothing took separate forwards
    assert res.admitted == res.requests_done == 7 and res.tokens == 7 * 5
    alone = 7 - res.ride_steps  # one prompt a forward: with a live request or alone
    assert alone >= 1  # the first wave starts with no live request
    # FixedK(k) without tiers: a step of b requests runs b * (k + 1) tokens
    decode_ms = sum(n * (10.0 + 0.5 * tier) for tier, n in res.tier_hist.items()) + 0.5 * 8 * res.ride_steps
    assert res.seconds == pytest.approx(decode_ms / 1000.0)
    assert res.prefill_seconds == pytest.approx(alone * (10.0 + 0.5 * 8) / 1000.0)
    assert res.output_tok_s == pytest.approx((res.tokens + 7) / (res.seconds + res.prefill_seconds))
    # the batch runs below the concurrency while prompts fill
    assert min(res.tier_hist) < 3 * (k + 1) == max(res.tier_hist)


def test_a_ride_limit_below_every_admission_is_the_separate_path():
    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    for k in (0, 3):
        separate = simulate(cost, acc, FixedK(k), prefill=lambda n: 4.0 * n, **RIDE_KW)
        bursts = simulate(cost, acc, FixedK(k), prefill=lambda n: 4.0 * n, ride=Riding(8, limit=1), **RIDE_KW)
        assert bursts.ride_steps == 0
        for field in ("goodput_tok_s", "tokens", "seconds", "steps", "admitted", "prefill_seconds", "k_hist",
                      "tier_hist", "itl_p99_ms", "mean_accept_len"):
            assert getattr(bursts, field) == pytest.approx(getattr(separate, field)), field


def test_a_step_that_carried_pieces_is_not_timed_for_the_policy():
    class Timed(FixedK):
        def __init__(self):
            super().__init__(1)
            object.__setattr__(self, "times", [])

        def observe_time(self, batch, plan, ms):
            self.times.append((batch, plan, ms))

    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    plain_timed = Timed()
    plain = simulate(cost, acc, plain_timed, prefill=lambda n: 1.0, **RIDE_KW)
    riding_timed = Timed()
    res = simulate(cost, acc, riding_timed, prefill=lambda n: 1.0, ride=Riding(8, budget=8, limit=1 << 20), **RIDE_KW)
    assert len(plain_timed.times) == plain.steps - 1  # every step, one step late
    assert res.ride_steps > 0 and len(riding_timed.times) <= res.steps - res.ride_steps
    for _, plan, ms in riding_timed.times:  # only plain steps' costs: weight + 0.5 x tier
        assert ms == pytest.approx(10.0 + 0.5 * plan.tier)


def test_a_riding_step_takes_the_policys_riding_shape():
    # a policy with ``plan_ride`` (the planner) is asked for the shape of every step that carries
    # pieces, with their bucket, and that step runs and is priced at the shape it returns
    class RidesAtOne(FixedK):
        def __init__(self):
            super().__init__(3)
            object.__setattr__(self, "rides", [])

        def plan_ride(self, batch, ride):
            self.rides.append((batch, ride))
            return FixedK(1).plan(batch)

    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    policy = RidesAtOne()
    res = simulate(cost, acc, policy, prefill=lambda n: 0.0, ride=Riding(8, budget=8, limit=1 << 20), **RIDE_KW)
    assert res.ride_steps > 0 and len(policy.rides) == res.ride_steps
    assert all(ride == 8 for _, ride in policy.rides)  # one 8-token prompt a step, its bucket
    assert res.k_hist[1] == res.ride_steps and res.k_hist[3] == res.steps - res.ride_steps
    # priced at the riding shape: a step of b requests at K 1 runs 2b tokens (+ the 8 riding)
    decode_ms = sum(n * (10.0 + 0.5 * tier) for tier, n in res.tier_hist.items()) + 0.5 * 8 * res.ride_steps
    assert res.seconds == pytest.approx(decode_ms / 1000.0)


def test_a_burst_above_the_ride_limit_takes_separate_forwards_then_admissions_ride():
    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    prefills: list[int] = []
    # plain decoding, 7 requests of one length at concurrency 3: waves of 3, 3 and 1 admitted at
    # once; 3 x 8 = 24 prompt tokens is a burst above 16, the last request's 8 ride
    res = simulate(cost, acc, FixedK(0), prefill=lambda n: prefills.append(n) or 5.0,
                   ride=Riding(8, budget=16, limit=16), **RIDE_KW)
    assert prefills == [3, 3] and res.admitted == 7
    # ... alone (nothing else is live then): a forward of the 16-token bucket
    assert res.ride_steps == 0 and res.prefill_seconds == pytest.approx((5.0 + 5.0 + 10.0 + 0.5 * 16) / 1000.0)


def test_admitting_ahead_keeps_the_batch_full_while_prompts_ride():
    """Plain decoding, every prompt riding one 8-token piece a step: without admission ahead a
    request's successor is admitted after it ends and rides one step in which the batch runs a
    row short; admitted ahead (the request may end by the next step), the successor's prompt rides
    beside its last steps and the successor joins as it leaves."""
    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    kw = dict(RIDE_KW, lengths="geometric", requests=40, mean_output_tokens=6.0)
    after = simulate(cost, acc, FixedK(0), prefill=lambda n: 0.0, ride=Riding(8, budget=8, limit=1 << 20), **kw)
    ahead = simulate(cost, acc, FixedK(0), prefill=lambda n: 0.0,
                     ride=Riding(8, budget=8, limit=1 << 20, ahead=True), **kw)
    for res in (after, ahead):  # the same requests, every one served, every prompt riding
        assert res.requests_done == res.admitted == 40
    assert ahead.tokens == after.tokens
    # plain decoding emits one token a live request a step: fewer steps = fewer rows short
    assert ahead.steps < after.steps
    assert ahead.output_tok_s > after.output_tok_s
    # the batch ran full (3 rows: 3 tokens a step) on more of its steps
    assert ahead.tier_hist.get(3, 0) > after.tier_hist.get(3, 0)


def test_admitting_ahead_never_admits_a_burst_beside_the_batch():
    # a ride limit below one prompt: every admission is a burst of separate forwards, live at
    # once; admission ahead rides only, so it changes nothing here
    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    kw = dict(RIDE_KW, lengths="geometric", requests=40, mean_output_tokens=6.0)
    for k in (0, 2):
        a = simulate(cost, acc, FixedK(k), prefill=lambda n: 1.0, ride=Riding(8, limit=1), **kw)
        b = simulate(cost, acc, FixedK(k), prefill=lambda n: 1.0, ride=Riding(8, limit=1, ahead=True), **kw)
        assert b.ride_steps == a.ride_steps == 0
        assert (b.steps, b.tokens, b.seconds, b.prefill_seconds) == pytest.approx((a.steps, a.tokens, a.seconds,
                                                                                  a.prefill_seconds))


def test_a_prompt_that_fills_over_several_steps_is_not_admitted_ahead():
    # 8-token prompts, 4 prompt tokens a step: no successor's prompt fits the step that ends the
    # request it replaces, so nothing is admitted ahead (it would keep later admissions riding)
    cost, acc = linear_cost(), curve(0.8, 0.6, 0.45)
    kw = dict(RIDE_KW, lengths="geometric", requests=40, mean_output_tokens=6.0)
    for k in (0, 2):
        a = simulate(cost, acc, FixedK(k), prefill=lambda n: 1.0, ride=Riding(8, budget=4, limit=1 << 20), **kw)
        b = simulate(cost, acc, FixedK(k), prefill=lambda n: 1.0, ride=Riding(8, budget=4, limit=1 << 20, ahead=True),
                     **kw)
        assert (b.steps, b.tokens, b.ride_steps, b.seconds) == pytest.approx((a.steps, a.tokens, a.ride_steps, a.seconds))


def test_ends_next_forward_follows_the_pieces_before_it():
    from spectune.runtime.prefill_plan import ends_next_forward

    assert ends_next_forward([8], [0], chunk=8, max_tokens=8)
    assert not ends_next_forward([8], [0], chunk=4, max_tokens=8)  # two chunks
    assert not ends_next_forward([8, 8], [0, 0], chunk=8, max_tokens=12)  # the first takes 8 of 12
    assert ends_next_forward([8, 4], [4, 0], chunk=8, max_tokens=8)  # the first's last 4, then 4
    assert not ends_next_forward([2, 2, 2], [0, 0, 0], chunk=8, max_tokens=64, max_pieces=2)


def test_host_lag_keeps_a_request_that_ended_unseen_for_one_idle_step():
    """``host_lag``: a request whose last step emitted two or more tokens stays one more step as
    an idle row (a slot with no drafts and no output) before its successor is admitted; one whose
    last step emitted one leaves at once (the engine expected it). Plain decoding emits one token
    a step, so it never has an idle row."""
    cost, acc = linear_cost(), curve(0.9, 0.9, 0.9)
    kw = dict(RIDE_KW, requests=30, mean_output_tokens=7.0)
    for k in (0, 3):
        now = simulate(cost, acc, FixedK(k), **kw)
        late = simulate(cost, acc, FixedK(k), host_lag=True, **kw)
        assert now.idle_rows == 0 and now.requests_done == late.requests_done == 30
        assert late.tokens == now.tokens == 30 * 7  # idle rows emit nothing
        if k == 0:
            assert late.idle_rows == 0 and (late.steps, late.seconds) == (now.steps, now.seconds)
        else:
            assert late.idle_rows > 0 and late.steps > now.steps and late.goodput_tok_s < now.goodput_tok_s
            # the steps' slots hold the idle rows; tokens per live slot are the same draws
            assert late.mean_accept_len == pytest.approx(now.mean_accept_len, rel=0.05)


def test_host_lag_idle_rows_are_the_requests_that_ended_on_a_multi_token_step():
    # at concurrency 1 every idle row is a step of its own: steps = the run's steps without the
    # lag + one per request whose last step emitted >= 2 tokens
    cost, acc = linear_cost(), curve(0.9, 0.9, 0.9)
    kw = dict(RIDE_KW, concurrency=1, requests=12, mean_output_tokens=9.0)
    now = simulate(cost, acc, FixedK(3), **kw)
    late = simulate(cost, acc, FixedK(3), host_lag=True, **kw)
    assert 0 < late.idle_rows <= 12
    assert late.steps == now.steps + late.idle_rows
    # each idle step is planned as any step of one row (K 3: a 4-token step), its row drafting nothing
    assert late.seconds == pytest.approx(now.seconds + late.idle_rows * (10.0 + 0.5 * 4) / 1000.0)


def test_ride_needs_a_prefill_model_and_checks_its_fields():
    with pytest.raises(SpectuneError, match="prefill"):
        simulate(linear_cost(), curve(0.8), FixedK(1), concurrency=2, steps=10, ride=Riding(8))
    for bad in (dict(prompt_len=0), dict(prompt_len=8, budget=0), dict(prompt_len=8, chunk=0),
                dict(prompt_len=8, limit=0)):
        with pytest.raises(ValueError, match="Riding"):
            Riding(**bad)
    r = Riding(100, budget=256, chunk=64)
    assert r.buckets == tuple(default_buckets(64, 256)) and r.ride_limit == 256
    assert r.rides(2, 0) and not r.rides(3, 0) and r.rides(3, 1)  # anything joins a queue that fills
    assert r.pieces([0, 0, 0, 90]) == [Piece(0, 0, 64, False), Piece(1, 0, 64, False), Piece(2, 0, 64, False),
                                       Piece(3, 90, 10, True)]


def _span_traces(tmp_path, n_requests: int = 4, steps: int = 60):
    # each request repeats a step that offered 7 with 3 right, then one that offered none: its
    # output runs 3, 2, 1, 0 (right drafts left from each index of the first step) then 0
    import json

    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps({"request": f"r{r}", "step": i, "offered": 0 if i % 2 else 7,
                                        "accepted": 0 if i % 2 else 3}) + "\n"
                            for r in range(n_requests) for i in range(steps)))
    return path


def test_a_trace_set_is_replayed_token_by_token_so_its_acceptance_depends_on_k(tmp_path):
    from spectune.autotune.acceptance import load_acceptance

    model = load_acceptance(str(_span_traces(tmp_path)), max_k=7)
    assert model.replay is not None and len(model.replay) == 4
    kw = dict(concurrency=1, steps=100_000, requests=2, mean_output_tokens=100.0, workload="closed",
              lengths="fixed")
    # K = 1 starts its steps at runs 3, 1, 0 of each 5 tokens (3 steps), K = 7 at 3 and 0 (2 steps)
    k1 = simulate(constant_cost(), model, FixedK(1), **kw)
    k7 = simulate(constant_cost(), model, FixedK(7), **kw)
    assert k1.mean_accept_len == pytest.approx(5 / 3, abs=0.03)
    assert k7.mean_accept_len == pytest.approx(5 / 2, abs=0.05)
    # the fitted classes (per planned draft) see position 1 right in half the steps at any K
    classes = dataclasses.replace(model, replay=None)
    assert simulate(constant_cost(), classes, FixedK(1), **kw).mean_accept_len == pytest.approx(1.5, abs=0.08)
    # with drift, or rates scaled, the classes play
    scaled = simulate(constant_cost(), model, FixedK(1), accept_scale=0.999, **kw)
    assert scaled.mean_accept_len == pytest.approx(1.5, abs=0.08)
    # per offered draft: no replay (its steps would replay per planned draft)
    assert load_acceptance(f"{_span_traces(tmp_path)}#declined=offered", max_k=7).replay is None


def test_token_replay_counts_what_the_engine_counts(tmp_path):
    # observe() gets the step's counters: position j tested where granted and the j - 1 before
    # it were right, a declined draft tested and rejected
    from spectune.autotune.acceptance import load_acceptance

    model = load_acceptance(str(_span_traces(tmp_path)), max_k=7)
    seen: list[tuple[list[int], list[int]]] = []

    class Spy(FixedK):
        def observe(self, accepted, tested):
            seen.append((list(accepted), list(tested)))

    simulate(constant_cost(), model, Spy(4), concurrency=1, steps=100_000, requests=1, mean_output_tokens=20.0,
             workload="closed", lengths="fixed")
    # steps start at run 3 (3 right, the 4th tested and wrong), then run 0 (1 tested, wrong)
    assert seen[0] == ([1, 1, 1, 0], [1, 1, 1, 1]) and seen[1] == ([0, 0, 0, 0], [1, 0, 0, 0])
