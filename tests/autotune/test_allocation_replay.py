import numpy as np
import pytest

from spectune.autotune.allocation_replay import population_rates, replay, water_fill
from spectune.errors import SpectuneError
from spectune.models.trace_steps import request_steps


def rec(request, step, offered, accepted, conf):
    return {"request": request, "step": step, "offered": offered, "accepted": accepted, "conf": conf}


# request "good": confident and right; request "bad": confident-looking only at position 1, wrong
RECORDS = [
    rec("good", 0, 4, 4, [0.9, 0.9, 0.9, 0.9]),
    rec("good", 1, 4, 3, [0.9, 0.9, 0.9, 0.2]),
    rec("bad", 0, 4, 0, [0.3, 0.1, 0.1, 0.1]),
    rec("bad", 1, 4, 0, [0.3, 0.1, 0.1, 0.1]),
]


def test_fixed_k_hand_computed():
    reqs = request_steps(RECORDS, k=4)
    r = replay(reqs, policy="fixed", concurrency=2, k=4)
    # steps: good 4+1, bad 0+1, good 3+1, bad 0+1 -> 11 tokens over 4 slot-steps
    assert r.slot_steps == 4 and r.emitted == 11
    assert r.mean_accept_len == pytest.approx(2.75)
    r2 = replay(request_steps(RECORDS, k=2), policy="fixed", concurrency=2, k=2)
    assert r2.emitted == 2 + 1 + 1 + 2 + 1 + 1  # good accepts min(a, 2) both steps


def test_confidence_allocation_moves_budget_to_the_confident_request():
    reqs = request_steps(RECORDS, k=4)
    conf = replay(reqs, policy="confidence", concurrency=2, k=4, per_request=2)
    uni = replay(reqs, policy="uniform", concurrency=2, k=4, per_request=2)
    # budget 4 per step: confidence gives all 4 to "good" (0.9^4 = 0.66 > 0.3)
    assert conf.emitted == (4 + 1) + 1 + (3 + 1) + 1
    # uniform: 2 each -> good accepts 2 per step
    assert uni.emitted == (2 + 1) + 1 + (2 + 1) + 1
    assert conf.granted_per_step == uni.granted_per_step == 2.0


def test_calibration_table_changes_the_ranking():
    reqs = request_steps(RECORDS, k=4)
    # a table saying conf >= 0.5 is never right and low conf always is: budget goes to "bad"
    table = ((0.5, 1.0), (1.0, 0.0))
    r = replay(reqs, policy="confidence", concurrency=2, k=4, per_request=2, calibration=table)
    assert r.emitted == 4  # nothing accepted: every draft went to "bad"


def test_history_learns_the_request_drift():
    recs = [rec("good", s, 2, 2, [0.5, 0.5]) for s in range(6)] + [rec("bad", s, 2, 0, [0.5, 0.5]) for s in range(6)]
    reqs = request_steps(recs, k=2)
    rates = [0.5, 0.5]
    hist = replay(reqs, policy="history", concurrency=2, k=2, per_request=1, rates=rates)
    uni = replay(reqs, policy="uniform", concurrency=2, k=2, per_request=1)
    assert hist.mean_accept_len > uni.mean_accept_len  # after the first steps "good" gets both drafts
    assert uni.emitted == 6 * 2 + 6 * 1


def test_water_fill_passes_spare_shares_on():
    assert water_fill(np.array([0, 5, 1]), 6).tolist() == [0, 5, 1]
    assert water_fill(np.array([0, 7, 7]), 5).tolist() == [0, 3, 2]
    assert water_fill(np.array([2, 2]), 10).tolist() == [2, 2]


def test_population_rates_count_unoffered_as_wrong():
    reqs = request_steps([rec("x", 0, 1, 1, [0.5]), rec("x", 1, 2, 0, [0.5, 0.5])], k=2)
    # position 1: 2 reached, 1 right; position 2: reached once (after step 0's right draft), not offered
    assert population_rates(reqs, 2).tolist() == [0.5, 0.0]


def test_budget_and_rates_are_required():
    reqs = request_steps(RECORDS, k=4)
    with pytest.raises(SpectuneError, match="per_request"):
        replay(reqs, policy="uniform", concurrency=2, k=4)
    with pytest.raises(SpectuneError, match="rates"):
        replay(reqs, policy="history", concurrency=2, k=4, per_request=1)


def test_position_calibration_ranks_by_per_position_tables():
    reqs = request_steps(RECORDS, k=4)
    # position 1 of "bad" (conf 0.3) is called certain; every other position impossible
    tables = [((0.5, 1.0), (1.0, 0.0)), ((1.0, 0.0),)]
    r = replay(reqs, policy="confidence", concurrency=2, k=4, per_request=0.5, position_calibration=tables)
    assert r.emitted == 4  # the one granted draft per step goes to "bad" and is rejected
