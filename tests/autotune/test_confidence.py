import gzip
import json

import numpy as np
import pytest

from spectune.autotune.acceptance import load_acceptance
from spectune.autotune.confidence import confidence_classes, ece, reliability, verified_samples
from spectune.models.trace_steps import request_steps


def test_ece_hand_computed():
    conf = np.array([0.15, 0.15, 0.85, 0.85])
    ok = np.array([False, True, True, True])
    rows = reliability(conf, ok, bins=10)
    assert [(r.count, r.accept_rate) for r in rows] == [(2, 0.5), (2, 1.0)]
    # |0.5 - 0.15| / 2 + |1.0 - 0.85| / 2
    assert ece(conf, ok, bins=10) == pytest.approx((0.35 + 0.15) / 2)
    assert np.isnan(ece(np.zeros(0), np.zeros(0, bool)))


def test_perfectly_calibrated_draws_have_small_ece():
    rng = np.random.default_rng(0)
    conf = rng.uniform(size=20000)
    ok = rng.uniform(size=conf.size) < conf
    assert ece(conf, ok) < 0.02
    assert ece(np.clip(conf + 0.3, 0, 1), ok) > 0.2  # overconfident by 0.3


def test_verified_samples_take_reached_positions_only():
    reqs = request_steps([{"request": "a", "step": 0, "offered": 3, "accepted": 1, "conf": [0.9, 0.4, 0.8]}], k=3)
    conf, ok, pos = verified_samples(reqs)
    assert conf.tolist() == [0.9, 0.4] and ok.tolist() == [True, False] and pos.tolist() == [1, 2]
    conf, _, _ = verified_samples(reqs, table=((0.5, 0.2), (1.0, 0.7)))
    assert conf.tolist() == [0.7, 0.2]


def test_confidence_classes_use_outcomes_not_confidences():
    # half the steps: conf 0.9 and 3 of 3 accepted; half: conf 0.2, none accepted
    offered = np.array([3, 3, 3, 3])
    accepted = np.array([3, 3, 0, 0])
    conf = np.array([[0.9] * 3, [0.9] * 3, [0.2] * 3, [0.2] * 3])
    w, surv = confidence_classes(offered, accepted, conf, 3, None, classes=2)
    assert w.tolist() == [0.5, 0.5]
    assert surv.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]  # low-score group first


def test_unoffered_positions_count_as_not_accepted():
    w, surv = confidence_classes(np.array([1]), np.array([1]), np.array([[0.9, np.nan]]), 2, None, classes=1)
    assert surv.tolist() == [[1.0, 0.0]]


def write(path, records):
    with gzip.open(path, "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def test_tune_source_with_confidences_models_step_classes(tmp_path):
    rng = np.random.default_rng(1)
    records = []
    for r in range(20):
        for step in range(30):
            p = rng.uniform(0.05, 0.95)  # a calibrated drafter: each draft right with prob conf
            ok = rng.uniform(size=4) < p
            acc = int(np.cumprod(ok).sum())
            records.append({"request": f"r{r}", "step": step, "offered": 4, "accepted": acc, "conf": [round(p, 3)] * 4})
    f = tmp_path / "t.jsonl.gz"
    write(f, records)
    m = load_acceptance(str(f), max_k=4)
    assert "by drafter confidence" in m.source and m.calibration is not None
    s1 = [c.survival(1)[0] for c in m.components]
    assert max(s1) - min(s1) > 0.5  # confident steps accept far more than unconfident ones
    # the same outcomes without conf: per-request classes, which cannot tell the steps apart
    plain = tmp_path / "p.jsonl.gz"
    write(plain, [{k: v for k, v in rec.items() if k != "conf"} for rec in records])
    m2 = load_acceptance(str(plain), max_k=4)
    assert "by drafter confidence" not in m2.source
    assert m.expected_tokens(4) == pytest.approx(m2.expected_tokens(4), abs=0.1)  # same mean
