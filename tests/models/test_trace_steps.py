import math

import numpy as np
import pytest

from spectune.models.trace_steps import TraceStepsError, calibrated, played, request_steps, split


def rec(request, step, offered, accepted, conf=None):
    r = {"request": request, "step": step, "offered": offered, "accepted": accepted}
    if conf is not None:
        r["conf"] = conf
    return r


RECORDS = [
    rec("a", 1, 3, 0, [0.2, 0.1, 0.1]),  # out of order: sorted by step
    rec("a", 0, 4, 2, [0.9, 0.8, 0.3, 0.2]),
    rec("b", 0, 0, 0, []),
    rec("b", 1, 2, 2, [0.7, 0.6]),
]


def test_groups_by_request_in_first_appearance_order_and_sorts_steps():
    reqs = request_steps(RECORDS, k=4)
    assert [r.request for r in reqs] == ["a", "b"]
    a = reqs[0]
    assert a.offered.tolist() == [4, 3]
    assert a.accepted.tolist() == [2, 0]
    assert a.conf[0].tolist() == [0.9, 0.8, 0.3, 0.2]
    assert a.conf[1, :3].tolist() == [0.2, 0.1, 0.1] and math.isnan(a.conf[1, 3])


def test_right_and_known_positions():
    a = request_steps(RECORDS, k=4)[0]
    # step 0: drafts 1, 2 right, 3 wrong (verified), 4 never reached
    assert a.right[0].tolist() == [True, True, False, False]
    assert a.known[0].tolist() == [True, True, True, False]
    b = request_steps(RECORDS, k=4)[1]
    assert b.known[0].tolist() == [False] * 4  # nothing offered
    assert b.known[1].tolist() == [True, True, False, False]  # all offered accepted, 3 not offered
    assert a.pairs() == [[(True, 0.9), (True, 0.8), (False, 0.3)], [(False, 0.2)]]


def test_runs_count_the_right_drafts_left_at_each_output_index():
    a, b = request_steps(RECORDS, k=4)
    # a: step 0 accepted 2 (indices 0, 1, 2 have 2, 1, 0 left), step 1 accepted 0 (index 3: 0)
    assert a.runs.tolist() == [2, 1, 0, 0]
    assert b.runs.tolist() == [0, 2, 1, 0]
    assert a.runs is a.runs  # made once per request, and shared: read-only
    with pytest.raises(ValueError):
        a.runs[0] = 9
    rng = np.random.default_rng(7)
    for _ in range(5):  # against the step-by-step definition on fresh random steps
        acc = rng.integers(0, 5, size=int(rng.integers(1, 30)))
        recs = [rec("r", s, 4, int(x)) for s, x in enumerate(acc)]
        want = np.concatenate([x - np.arange(x + 1) for x in acc])
        assert request_steps(recs, k=4)[0].runs.tolist() == want.tolist()


def test_played_covers_the_need_in_order_and_wraps():
    lengths = [3, 5, 2]
    assert played(lengths, [2, 0, 1], 0, 1) == [2]
    assert played(lengths, [2, 0, 1], 0, 3) == [2, 0]  # 2 indices, then 3 more
    assert played(lengths, [2, 0, 1], 2, 9) == [1, 2, 0]  # from order[2], wrapping round
    assert played(lengths, [2, 0, 1], 1, 0) == []
    with pytest.raises(TraceStepsError, match="recorded request 1"):
        played([3, 0], [1, 0], 0, 4)


def test_accepted_with_a_smaller_grant_is_the_prefix():
    a = request_steps(RECORDS, k=4)[0]
    assert a.accepted_with(np.array([1, 3])).tolist() == [1, 0]
    assert a.accepted_with(np.array([4, 4])).tolist() == [2, 0]


def test_cut_at_smaller_k():
    a = request_steps(RECORDS, k=2)[0]
    assert a.offered.tolist() == [2, 2]
    assert a.accepted.tolist() == [2, 0]
    assert a.conf.shape == (2, 2)


def test_missing_conf_is_nan():
    reqs = request_steps([rec("x", 0, 2, 1)], k=3)
    assert np.isnan(reqs[0].conf).all()


def test_bad_records_name_the_field():
    with pytest.raises(TraceStepsError, match="step"):
        request_steps([rec("x", 0, 1, 0), rec("x", 0, 1, 1)], k=2)
    with pytest.raises(TraceStepsError, match="conf"):
        request_steps([rec("x", 0, 2, 0, [0.5])], k=2)


def test_split_alternates():
    reqs = request_steps([rec(str(i), 0, 1, 0) for i in range(5)], k=1)
    even, odd = split(reqs)
    assert [r.request for r in even] == ["0", "2", "4"]
    assert [r.request for r in odd] == ["1", "3"]


def test_calibrated_uses_the_bins_of_calibrate():
    table = ((0.5, 0.1), (1.0, 0.6))  # [0, 0.5) -> 0.1, [0.5, 1] -> 0.6
    conf = np.array([0.0, 0.49, 0.5, 1.0, np.nan])
    out = calibrated(conf, table)
    assert out[:4].tolist() == [0.1, 0.1, 0.6, 0.6]
    assert math.isnan(out[4])
    assert calibrated(conf, None) is conf


def test_calibrated_by_position_uses_one_table_per_column():
    from spectune.models.trace_steps import calibrated_by_position

    conf = np.array([[0.9, 0.9, 0.9]])
    out = calibrated_by_position(conf, [((1.0, 0.2),), ((1.0, 0.7),)])
    assert out.tolist() == [[0.2, 0.7, 0.7]]  # column 3 takes the last table
    with pytest.raises(TraceStepsError, match="tables"):
        calibrated_by_position(conf, [])
