"""Budget allocation kernel vs its torch reference (exact grants, ties included)."""

from __future__ import annotations

import pytest
import torch

from spectune.kernels.allocate import allocate, allocate_ref, survival_scores_ref
from spectune.kernels.kv_cache import KernelInputError


def _inputs(batch: int, max_k: int, seed: int, levels: int | None):
    g = torch.Generator().manual_seed(seed)
    if levels is None:
        conf = torch.rand(batch, max_k, generator=g)
    else:  # quantised confidences force many equal scores
        conf = torch.randint(0, levels + 1, (batch, max_k), generator=g).float() / levels
    k_valid = torch.randint(0, max_k + 1, (batch,), generator=g).to(torch.int32)
    return conf, k_valid


@pytest.mark.parametrize("batch, max_k", [(1, 1), (1, 15), (7, 4), (33, 15), (5, 0)])
@pytest.mark.parametrize("levels", [None, 3])
def test_kernel_matches_reference(batch, max_k, levels):
    conf, k_valid = _inputs(batch, max_k, seed=batch * 100 + max_k, levels=levels)
    n_drafts = int(k_valid.sum())
    for budget in sorted({0, 1, 3, n_drafts // 2, n_drafts, n_drafts + 7, -4}):
        want = allocate_ref(conf, k_valid, budget)
        got = allocate(conf, k_valid, budget)
        on_device = allocate(conf, k_valid, torch.tensor([budget], dtype=torch.int32))
        assert torch.equal(got, want), (budget, got, want)
        assert torch.equal(on_device, want)
        assert int(got.sum()) == max(0, min(budget, n_drafts))
        assert bool((got <= k_valid).all())


def test_ties_go_to_lower_request_then_position():
    conf = torch.full((3, 4), 0.5)
    k_valid = torch.tensor([4, 4, 4], dtype=torch.int32)
    # scores 0.5, 0.25, ... for every request: position 0 of all, then position 1 in request order
    assert allocate(conf, k_valid, 5).tolist() == [2, 2, 1]
    assert allocate_ref(conf, k_valid, 5).tolist() == [2, 2, 1]


def test_hand_made_case():
    conf = torch.tensor([[0.9, 0.9, 0.9],   # survival .9 .81 .729
                         [0.5, 1.0, 1.0],   # .5 .5 .5
                         [0.95, 0.1, 1.0]])  # .95 .095 .095
    k_valid = torch.tensor([3, 3, 2], dtype=torch.int32)
    assert allocate(conf, k_valid, 4).tolist() == [3, 0, 1]
    assert allocate(conf, k_valid, 6).tolist() == [3, 2, 1]


def test_grants_are_prefixes_of_the_best_scores():
    conf, k_valid = _inputs(9, 6, seed=3, levels=None)
    grant = allocate(conf, k_valid, 17)
    scores = survival_scores_ref(conf, k_valid)
    taken = [float(scores[i, j]) for i in range(9) for j in range(int(grant[i]))]
    left = [float(scores[i, j]) for i in range(9) for j in range(int(grant[i]), int(k_valid[i]))]
    assert len(taken) == 17 and min(taken) >= max(left)


def test_device_budget_changes_without_new_launch_arguments():
    conf, k_valid = _inputs(6, 5, seed=4, levels=None)
    budget = torch.zeros(1, dtype=torch.int32)
    out = torch.empty(6, dtype=torch.int32)
    for b in (0, 4, 9):
        budget.fill_(b)
        allocate(conf, k_valid, budget, out=out)
        assert torch.equal(out, allocate_ref(conf, k_valid, b))


def test_bad_input_names_the_argument():
    conf = torch.rand(4, 3)
    with pytest.raises(KernelInputError, match="k_valid"):
        allocate(conf, torch.zeros(4, dtype=torch.int64), 2)
    with pytest.raises(KernelInputError, match="conf"):
        allocate(conf[:, :2].t(), torch.zeros(2, dtype=torch.int32), 2)
