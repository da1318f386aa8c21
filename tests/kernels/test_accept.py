"""Acceptance kernels vs their torch references, stats counters, and the sampling distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from spectune.kernels.accept import (
    PLACEHOLDER_TOKEN_ID,
    accept_greedy,
    accept_greedy_ref,
    accept_sampling,
    accept_sampling_ref,
    make_sample_noise,
)
from spectune.kernels.stats import StatsCounters, StatsSnapshot

P = PLACEHOLDER_TOKEN_ID
OUT_FIELDS = ("out_tokens", "num_out", "accepted")


def _cu(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


def _ragged(batch: int, max_k: int, seed: int, n_tokens: int = 3):
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1, max_k + 2, (batch,), generator=g).tolist()
    if batch > 2:
        q_lens[1] = 0  # a request not in the step
    cu = _cu(q_lens)
    tier = int(cu[-1]) + 3  # padding rows after the packed total
    drafts = torch.randint(0, n_tokens, (batch, max_k), generator=g)  # small alphabet: many matches
    return g, cu, tier, drafts


# ---------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("drafts, target, accepted, tokens", [
    ([[1, 5, 3, 4]], [1, 2, 3, 4, 9], 1, [1, 2, P, P, P]),  # mismatch at position 1
    ([[1, 5, 3, 4]], [1, 5, 3, 4, 9], 4, [1, 5, 3, 4, 9]),  # all accepted: bonus 9
    ([[1, 5, 3, 4]], [7, 5, 3, 4, 9], 0, [7, P, P, P, P]),  # first draft wrong: corrected 7
])
def test_greedy_hand_made(drafts, target, accepted, tokens):
    d = torch.tensor(drafts)
    cu = _cu([len(target)])
    out = accept_greedy(torch.tensor(target), d, cu)
    assert out.accepted.tolist() == [accepted]
    assert out.num_out.tolist() == [accepted + 1]
    assert out.out_tokens.tolist() == [tokens]


@pytest.mark.parametrize("batch, max_k", [(1, 0), (1, 15), (7, 4), (33, 15)])
def test_greedy_matches_reference(batch, max_k):
    g, cu, tier, drafts = _ragged(batch, max_k, seed=batch + max_k)
    target_ids = torch.randint(0, 3, (tier,), generator=g)
    s_kernel, s_ref = StatsCounters.zeros(max_k, "cpu"), StatsCounters.zeros(max_k, "cpu")
    got = accept_greedy(target_ids, drafts, cu, stats=s_kernel)
    want = accept_greedy_ref(target_ids, drafts, cu, stats=s_ref)
    for f in OUT_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(s_kernel.counters, s_ref.counters)


def test_stats_count_positions():
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]])
    target = torch.tensor([1, 2, 9, 0,  # request 0: 3 granted, 2 accepted
                           1, 0,  # request 1: 1 granted, accepted, bonus
                           0])  # request 2: nothing granted
    stats = StatsCounters.zeros(3, "cpu")
    out = accept_greedy(target, drafts, _cu([4, 2, 1]), stats=stats)
    assert out.num_out.tolist() == [3, 2, 1]
    snap = StatsSnapshot.from_counters(stats.counters.tolist(), 3)
    assert snap.accepted_per_pos == (2, 1, 0)
    assert snap.offered_per_pos == (2, 1, 1)
    assert snap.granted_per_pos == (2, 1, 1)
    assert (snap.steps, snap.requests, snap.emitted) == (1, 3, 6)
    accept_greedy(target, drafts, _cu([4, 2, 1]), stats=stats)
    later = StatsSnapshot.from_counters(stats.counters.tolist(), 3)
    assert later.minus(snap) == snap


# ---------------------------------------------------------------------------------------------
# Rejection sampling


@pytest.mark.parametrize("batch, max_k, vocab", [(1, 0, 5), (1, 15, 7), (7, 4, 40), (33, 3, 11)])
@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "one-hot"])
def test_sampling_matches_reference(batch, max_k, vocab, with_q):
    g, cu, tier, drafts = _ragged(batch, max_k, seed=7 * batch + max_k)
    target_probs = torch.softmax(2 * torch.randn(tier, vocab, generator=g), dim=-1)
    draft_probs = torch.softmax(torch.randn(batch, max_k, vocab, generator=g), dim=-1) if with_q else None
    uniform = torch.rand(batch, max_k, generator=g)
    noise = make_sample_noise((batch, vocab), generator=g)
    s_kernel, s_ref = StatsCounters.zeros(max_k, "cpu"), StatsCounters.zeros(max_k, "cpu")
    args = (target_probs, draft_probs, drafts, cu, uniform, noise)
    got = accept_sampling(*args, stats=s_kernel, block_v=16)  # several vocabulary chunks
    want = accept_sampling_ref(*args, stats=s_ref)
    for f in OUT_FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(s_kernel.counters, s_ref.counters)


def test_sampling_rejects_a_token_the_target_never_emits():
    target_probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    out = accept_sampling(target_probs, None, torch.tensor([[0]]), _cu([2]), torch.tensor([[0.0]]),
                          make_sample_noise((1, 3), generator=torch.Generator().manual_seed(0)))
    assert out.accepted.tolist() == [0] and out.out_tokens[0, 0].item() in (1, 2)


VOCAB = 6
DRAWS = 20000
P_TARGET = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q_CASES = {
    "q-near-p": torch.tensor([0.28, 0.27, 0.18, 0.14, 0.08, 0.05]),
    "q-far-from-p": torch.tensor([0.02, 0.03, 0.05, 0.10, 0.30, 0.50]),
    "q-uniform": torch.full((VOCAB,), 1 / VOCAB),
    "q-misses-tokens": torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0]),
}


def _chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    return float(chisquare(counts.numpy(), (p.double() * tokens.numel()).numpy()).pvalue)


@pytest.mark.parametrize("q_name", list(Q_CASES))
@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "one-hot"])
def test_first_token_follows_the_target_distribution(q_name, with_q):
    # DRAWS independent one-request copies in one launch; each proposes 2 drafts drawn from q
    g = torch.Generator().manual_seed(11)
    q = Q_CASES[q_name]
    p2 = torch.roll(P_TARGET, 2)  # the row after the first draft: where recovered/bonus 2 come from
    drafts = torch.multinomial(q.expand(DRAWS, VOCAB), 2, replacement=True, generator=g)
    cu = torch.arange(0, 3 * DRAWS + 1, 3, dtype=torch.int32)
    target_probs = torch.stack([P_TARGET, p2, P_TARGET]).repeat(DRAWS, 1)  # [3 * DRAWS, V]
    draft_probs = q.expand(DRAWS, 2, VOCAB).contiguous() if with_q else None
    uniform = torch.rand(DRAWS, 2, generator=g)
    noise = make_sample_noise((DRAWS, VOCAB), generator=g)
    out = accept_sampling(target_probs, draft_probs, drafts, cu, uniform, noise, block_b=1024)
    assert _chi2_pvalue(out.out_tokens[:, 0], P_TARGET) > 1e-3
    second = out.out_tokens[:, 1][out.num_out >= 2]  # given the first draft accepted
    assert second.numel() > 1000
    assert _chi2_pvalue(second, p2) > 1e-3
