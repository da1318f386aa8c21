"""The simulator's allocation from what a runtime knows (request history), oracle and uniform, and drift."""

import numpy as np
import pytest

from spectune.autotune import simulator
from spectune.autotune.acceptance import AcceptanceModel
from spectune.autotune.simulator import FixedK, simulate
from spectune.errors import SpectuneError
from spectune.runtime.planner import Plan
from spectune.runtime.request_history import request_confidences
from tests.autotune.test_simulator import constant_cost, curve


def two_classes(easy: float, hard: float, k: int, weight: float = 0.5) -> AcceptanceModel:
    return AcceptanceModel.from_dict({"source": "two", "max_k": k, "components": [
        {"weight": weight, "accept": [easy] * k}, {"weight": 1 - weight, "accept": [hard] * k}]})


class Budget:
    """K drafts per request but a budget of ``per`` drafts per request: the budget binds."""

    def __init__(self, k: int, per: int):
        self.k, self.per = k, per

    def plan(self, b: int) -> Plan:
        return Plan(self.k, b * self.per, b * (1 + self.per))


def test_history_ranking_by_hand():
    # rates [0.8, 0.6]; request 0 accepted 0 of 4 expected (rho = 4 / 8 = 0.5), request 1 4 of 4
    conf = request_confidences(np.array([0.8, 0.6]), np.array([0.0, 4.0]), np.array([4.0, 4.0]))
    surv = np.cumprod(conf, 1)
    assert surv == pytest.approx(np.array([[0.4, 0.12], [0.8, 0.48]]))
    tie = np.array([0.3, 0.7])
    assert simulator._grant(surv, 2, 2, "history", tie).tolist() == [0, 2]  # 0.8, 0.48 > 0.4
    assert simulator._grant(surv, 2, 3, "history", tie).tolist() == [1, 2]
    assert simulator._grant(surv, 2, 3, "uniform", tie).tolist() == [2, 1]  # the lower tie gets the extra
    assert simulator._grant(surv, 2, 9, "history", tie).tolist() == [2, 2]  # full budget


def record_grants(monkeypatch):
    seen = []
    real = simulator._grant

    def spy(survival, k, budget, allocation, tie):
        seen.append(survival.copy())
        return real(survival, k, budget, allocation, tie)

    monkeypatch.setattr(simulator, "_grant", spy)
    return seen


def test_history_never_ranks_by_the_true_rates(monkeypatch):
    # request classes with very different true rates; with no history yet, the history rule sees
    # every request alike (the prior), the oracle sees the truth
    acc = two_classes(0.95, 0.05, 2)
    seen = record_grants(monkeypatch)
    kw = dict(concurrency=8, steps=1, seed=1, mean_output_tokens=50.0)
    simulate(constant_cost(), acc, Budget(2, 1), allocation="history", **kw)
    (first,) = seen
    prior = np.array(acc.mean_conditional())
    assert first == pytest.approx(np.tile(np.cumprod(prior), (8, 1)))
    seen.clear()
    simulate(constant_cost(), acc, Budget(2, 1), allocation="oracle", **kw)
    rows = {tuple(np.round(r, 6)) for r in seen[0]}
    assert rows == {(0.95, 0.9025), (0.05, 0.0025)}  # both classes in the batch, by their truth


def test_history_uses_the_policys_live_rates(monkeypatch):
    seen = record_grants(monkeypatch)

    class WithRates(Budget):
        rates = [0.9, 0.1]

    simulate(constant_cost(), curve(0.5, 0.25), WithRates(2, 1), concurrency=3, steps=1)
    assert seen[0] == pytest.approx(np.tile([0.9, 0.09], (3, 1)))
    seen.clear()
    simulate(constant_cost(), curve(0.5, 0.25), Budget(2, 1), concurrency=3, steps=1, prior=[0.7, 0.2])
    assert seen[0] == pytest.approx(np.tile([0.7, 0.14], (3, 1)))


def test_history_beats_uniform_and_oracle_bounds_it_on_two_classes():
    acc = two_classes(0.9, 0.1, 4)
    kw = dict(concurrency=16, steps=4000, seed=3, mean_output_tokens=200.0)
    goodput = {a: simulate(constant_cost(), acc, Budget(4, 1), allocation=a, **kw).goodput_tok_s
               for a in ("uniform", "history", "oracle")}
    assert goodput["history"] > 1.05 * goodput["uniform"]
    assert goodput["oracle"] >= goodput["history"]


def test_history_rule_differs_from_oracle():
    acc = two_classes(0.9, 0.1, 4)
    kw = dict(concurrency=16, steps=300, seed=3, mean_output_tokens=30.0)
    hist = simulate(constant_cost(), acc, Budget(4, 1), allocation="history", **kw)
    oracle = simulate(constant_cost(), acc, Budget(4, 1), allocation="oracle", **kw)
    assert hist.tokens != oracle.tokens
    assert hist == simulate(constant_cost(), acc, Budget(4, 1), allocation="history", **kw)  # seeded


class Counters(FixedK):
    def __init__(self, k: int):
        super().__init__(k)
        object.__setattr__(self, "accepted", [])

    def observe(self, accepted, tested):
        self.accepted.append(int(accepted[0]))


def test_drift_switches_at_half_the_requests_in_a_closed_run():
    # one request at a time, 4 tokens each, K = 1: model A accepts every draft (2 steps per
    # request), model B none (4 steps); requests 5..9 are B's
    a, b = curve(1.0), curve(0.0)
    spy = Counters(1)
    res = simulate(constant_cost(), a, spy, concurrency=1, steps=10_000, requests=10, workload="closed",
                   lengths="fixed", mean_output_tokens=4.0, drift=b)
    assert res.steps == 5 * 2 + 5 * 4 and res.requests_done == 10
    assert spy.accepted == [1] * 10 + [0] * 19  # observe sees each step one step late


def test_drift_switches_at_half_the_steps_in_an_open_run():
    spy = Counters(1)
    simulate(constant_cost(), curve(1.0), spy, concurrency=1, steps=100, lengths="fixed",
             mean_output_tokens=4.0, drift=curve(0.0))
    # requests start at steps 0, 2, ..., 48 (A: 2 steps each); the one arriving at step 50 is B's
    assert spy.accepted[:50] == [1] * 50 and set(spy.accepted[50:]) == {0}


def test_drift_with_a_longer_second_model_and_bad_allocation():
    res = simulate(constant_cost(), curve(0.9), FixedK(3), concurrency=2, steps=50, drift=curve(0.8, 0.6, 0.4))
    assert res.k_hist == {3: 50}
    with pytest.raises(SpectuneError, match="allocation"):
        simulate(constant_cost(), curve(0.9), FixedK(1), concurrency=1, steps=5, allocation="survival")
