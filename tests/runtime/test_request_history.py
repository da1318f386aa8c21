import numpy as np
import pytest
import torch

from spectune.runtime.request_history import REQUEST_SHRINK, expected_accepts, request_confidences


def test_new_request_gets_the_population_rates() -> None:
    rates = np.array([0.8, 0.6, 0.5])
    conf = request_confidences(rates, np.zeros(2), np.zeros(2))
    assert np.allclose(conf, [rates, rates])


def test_history_moves_a_request_away_from_the_population_hand_computed() -> None:
    rates = np.array([0.8, 0.5])
    # request 0 accepted 9 of an expected 4.5; request 1 accepted 0 of an expected 4.5
    conf = request_confidences(rates, np.array([9.0, 0.0]), np.array([4.5, 4.5]), m=4.0)
    rho0, rho1 = (9 + 4) / (4.5 + 4), (0 + 4) / (4.5 + 4)
    assert np.allclose(conf[0], np.clip(rates * rho0, 0, 1))
    assert np.allclose(conf[1], rates * rho1)
    assert conf[0, 0] == 1.0  # clipped
    assert (conf[1] < rates).all() and (conf[0] > rates).all()


@pytest.mark.parametrize("granted,accepted,expect", [
    (3, 0, 0.8),               # first draft rejected: one tested
    (3, 1, 0.8 + 0.6),         # second rejected
    (3, 3, 0.8 + 0.6 + 0.5),   # all accepted: no rejected one
    (0, 0, 0.0),               # nothing granted, nothing tested
    (2, 2, 0.8 + 0.6),
])
def test_expected_accepts_hand_computed(granted: int, accepted: int, expect: float) -> None:
    rates = np.array([0.8, 0.6, 0.5])
    cum = np.concatenate([[0.0], np.cumsum(rates)])
    got = expected_accepts(cum, np.array([granted]), np.array([accepted]))
    assert got[0] == pytest.approx(expect)


def test_numpy_and_torch_agree_on_fresh_random_inputs() -> None:
    rng = np.random.default_rng(7)
    for b, k in [(1, 1), (5, 7), (33, 15)]:
        rates = np.sort(rng.uniform(0.2, 0.95, k))[::-1].copy()
        acc, exp = rng.uniform(0, 50, b), rng.uniform(0, 50, b)
        granted = rng.integers(0, k + 1, b)
        accepted = np.minimum(rng.integers(0, k + 1, b), granted)
        cum = np.concatenate([[0.0], np.cumsum(rates)])
        c_np = request_confidences(rates, acc, exp)
        c_t = request_confidences(torch.tensor(rates), torch.tensor(acc), torch.tensor(exp))
        assert np.allclose(c_np, c_t.numpy())
        e_np = expected_accepts(cum, granted, accepted)
        e_t = expected_accepts(torch.tensor(cum), torch.tensor(granted), torch.tensor(accepted))
        assert np.allclose(e_np, e_t.numpy())


def test_ranking_from_history_beats_population_on_a_two_class_mixture() -> None:
    """Independent truth: requests of two classes (a = 0.9 and a = 0.3); after a few steps of
    history the estimate ranks every easy request above every hard one."""
    rng = np.random.default_rng(0)
    true = np.array([0.9] * 8 + [0.3] * 8)
    rates = np.full(4, 0.6)
    cum = np.concatenate([[0.0], np.cumsum(rates)])
    acc, exp = np.zeros(16), np.zeros(16)
    for _ in range(12):
        ok = rng.uniform(size=(16, 4)) < true[:, None]
        accepted = np.cumprod(ok, 1).sum(1)
        acc += accepted
        exp += expected_accepts(cum, np.full(16, 4), accepted)
    conf = request_confidences(rates, acc, exp, m=REQUEST_SHRINK)
    assert conf[:8, 0].min() > conf[8:, 0].max()
