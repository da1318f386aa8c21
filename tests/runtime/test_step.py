"""The adaptive step end to end on a toy target whose greedy continuation is known."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from spectune.kernels.accept import PLACEHOLDER_TOKEN_ID
from spectune.kernels.attention_metadata import AttnMeta
from spectune.runtime.step import AdaptiveVerifier, GraphPool, StepError

VOCAB = 24
MAX_POS = 512


@dataclass(frozen=True)
class Plan:
    k: int
    verify_budget: int
    tier: int


class ToyTarget:
    """logits[t] = E[token] + P[position]: the next token depends on (token, position) only."""

    def __init__(self, seed: int = 0, sharpness: float = 1.0, device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.emb = (torch.randn(VOCAB, VOCAB, generator=g) * sharpness).to(device)  # [V, V]
        self.pos = (torch.randn(MAX_POS, VOCAB, generator=g) * sharpness).to(device)  # [P, V]
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        self.calls += 1
        assert meta.slot_mapping is not None
        assert input_ids.shape == positions.shape == meta.slot_mapping.shape  # [T]
        return self.emb[input_ids] + self.pos[positions]  # [T, V]

    def next_token(self, token: int, position: int) -> int:
        return int(torch.argmax(self.emb[token] + self.pos[position]))


def plain_greedy(model: ToyTarget, token: int, position: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = model.next_token(token, position)
        position += 1
        out.append(token)
    return out


def propose(model: ToyTarget, token: int, position: int, k: int, p_wrong: float, g: torch.Generator) -> list[int]:
    """A drafter that knows the target but errs with probability p_wrong per draft."""
    drafts = []
    for _ in range(k):
        token = model.next_token(token, position)
        if float(torch.rand(1, generator=g)) < p_wrong:
            token = int(torch.randint(0, VOCAB, (1,), generator=g))
        position += 1
        drafts.append(token)
    return drafts


PLANS = [  # (batch, plan): budgets below, at and above the tier's room; K = 0; padded tiers
    (3, Plan(4, 6, 16)), (5, Plan(2, 3, 8)), (5, Plan(0, 0, 8)), (1, Plan(7, 7, 8)),
    (5, Plan(7, 100, 16)), (2, Plan(3, 0, 4)), (4, Plan(7, 12, 16)), (5, Plan(1, 5, 16)),
    (5, Plan(7, 11, 16)), (3, Plan(0, 0, 4)),
]


def run_engine(verifier: AdaptiveVerifier, model: ToyTarget, steps: int, p_wrong: float, seed: int):
    n_req = 5
    g = torch.Generator().manual_seed(seed)
    start_tok = torch.randint(0, VOCAB, (n_req,), generator=g)
    start_pos = torch.randint(0, 40, (n_req,), generator=g).to(torch.int32)
    last, ctx = start_tok.clone(), start_pos.clone()
    emitted: list[list[int]] = [[] for _ in range(n_req)]
    snapshots = []
    for s in range(steps):
        batch, plan = PLANS[s % len(PLANS)]
        k = plan.k
        drafts = torch.tensor([propose(model, int(last[i]), int(ctx[i]), k, p_wrong, g) for i in range(batch)],
                              dtype=torch.int64).reshape(batch, k)
        conf = torch.rand(batch, k, generator=g)
        k_valid = torch.randint(0, k + 1, (batch,), generator=g).to(torch.int32) if s % 3 == 0 else None
        out = verifier.step(last, drafts, conf, batch, plan, context_lens=ctx, k_valid=k_valid)
        assert out.grant.shape == (batch,)
        assert int(out.grant.sum()) <= min(plan.verify_budget, plan.tier - batch)
        for i in range(batch):
            n = int(out.num_out[i])
            assert 1 <= n <= int(out.grant[i]) + 1
            row = out.out_tokens[i].tolist()
            assert all(t == PLACEHOLDER_TOKEN_ID for t in row[n:])
            emitted[i].extend(row[:n])
            last[i] = row[n - 1]
            ctx[i] += n
        snap = verifier.poll_stats()
        assert snap is not None and snap.steps == 1
        assert snap.emitted == int(out.num_out.sum())
        snapshots.append(snap)
    return start_tok, start_pos, emitted, snapshots


@pytest.mark.parametrize("kernels", [True, False], ids=["triton", "torch"])
def test_speculative_greedy_equals_plain_greedy(kernels):
    model = ToyTarget(seed=1)
    pool = GraphPool(model, [4, 8, 16], max_batch=8, max_k=7, device="cpu", block_size=4,
                     max_blocks=64, kernels=kernels)
    verifier = AdaptiveVerifier(pool)
    steps = 20 if kernels else 40
    start_tok, start_pos, emitted, snaps = run_engine(verifier, model, steps, p_wrong=0.25, seed=2)
    for i, toks in enumerate(emitted):
        assert len(toks) > 0
        assert toks == plain_greedy(model, int(start_tok[i]), int(start_pos[i]), len(toks))
    accepted = sum(sum(s.accepted_per_pos) for s in snaps)
    assert accepted > 0  # the drafter helped
    for s in snaps:
        assert all(a <= o <= g for a, o, g in zip(s.accepted_per_pos, s.offered_per_pos, s.granted_per_pos, strict=True))
        assert s.emitted == s.requests + sum(s.accepted_per_pos)


def test_k0_runs_the_decode_graph_and_counts_no_drafts():
    model = ToyTarget(seed=3)
    pool = GraphPool(model, [8], max_batch=8, max_k=4, device="cpu", kernels=False)
    verifier = AdaptiveVerifier(pool)
    last = torch.tensor([1, 2, 3], dtype=torch.int64)
    ctx = torch.tensor([5, 6, 7], dtype=torch.int32)
    out = verifier.step(last, None, None, 3, Plan(0, 0, 8), context_lens=ctx)
    assert out.num_out.tolist() == [1, 1, 1]
    assert out.out_tokens[:, 0].tolist() == [model.next_token(t, p) for t, p in zip([1, 2, 3], [5, 6, 7], strict=True)]
    snap = verifier.poll_stats()
    assert snap is not None and sum(snap.granted_per_pos) == 0 and snap.emitted == 3


def test_sampling_step_with_a_sharp_target_accepts_its_argmax():
    model = ToyTarget(seed=4, sharpness=60.0)  # softmax is one-hot up to float rounding
    pool = GraphPool(model, [16], max_batch=4, max_k=3, device="cpu", sampling=True, vocab_size=VOCAB,
                     generator=torch.Generator().manual_seed(0))
    verifier = AdaptiveVerifier(pool, prior=[0.9, 0.8, 0.7])
    last = torch.tensor([3, 9], dtype=torch.int64)
    ctx = torch.tensor([10, 20], dtype=torch.int32)
    drafts = torch.tensor([plain_greedy(model, 3, 10, 3), plain_greedy(model, 9, 20, 3)])
    out = verifier.step(last, drafts, None, 2, Plan(3, 6, 16), context_lens=ctx)
    assert out.num_out.tolist() == [4, 4]
    assert out.out_tokens[0].tolist() == plain_greedy(model, 3, 10, 4)
    assert out.out_tokens[1].tolist() == plain_greedy(model, 9, 20, 4)


def test_prior_spreads_the_budget_over_requests():
    model = ToyTarget(seed=5)
    pool = GraphPool(model, [16], max_batch=4, max_k=4, device="cpu", kernels=False)
    verifier = AdaptiveVerifier(pool)  # equal conditional acceptance: first positions first
    drafts = torch.zeros(4, 4, dtype=torch.int64)
    out = verifier.step(torch.zeros(4, dtype=torch.int64), drafts, None, 4, Plan(4, 6, 16),
                        context_lens=torch.zeros(4, dtype=torch.int32))
    assert out.grant.tolist() == [2, 2, 1, 1]


@pytest.mark.parametrize("plan, batch, field", [
    (Plan(2, 2, 32), 2, "plan.tier"),
    (Plan(2, 2, 8), 9, "batch_size"),
    (Plan(9, 2, 8), 2, "plan.k"),
])
def test_bad_plan_names_the_field(plan, batch, field):
    model = ToyTarget()
    pool = GraphPool(model, [8], max_batch=8, max_k=4, device="cpu", kernels=False)
    verifier = AdaptiveVerifier(pool)
    z = torch.zeros(9, dtype=torch.int64)
    with pytest.raises(StepError, match=field):
        verifier.step(z, torch.zeros(9, 9, dtype=torch.int64), None, batch, plan,
                      context_lens=z.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# GPU: captured graphs, no host synchronisation


@pytest.mark.gpu
def test_captured_step_matches_eager_and_never_syncs():
    model = ToyTarget(seed=6, device="cuda")

    def make_pool(capture: bool) -> GraphPool:
        return GraphPool(model, [4, 8, 16], max_batch=8, max_k=7, device="cuda", block_size=4,
                         max_blocks=64, capture=capture)

    captured = AdaptiveVerifier(make_pool(True))
    eager = AdaptiveVerifier(make_pool(False))
    assert len(captured.pool.graphs) == 6
    g = torch.Generator().manual_seed(7)
    for s in range(len(PLANS)):
        batch, plan = PLANS[s]
        last = torch.randint(0, VOCAB, (batch,), generator=g).cuda()
        ctx = torch.randint(0, 100, (batch,), generator=g).to(torch.int32).cuda()
        drafts = torch.randint(0, VOCAB, (batch, plan.k), generator=g).cuda()
        conf = torch.rand(batch, plan.k, generator=g).cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = captured.step(last, drafts, conf, batch, plan, context_lens=ctx)
            captured.poll_stats()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = eager.step(last, drafts, conf, batch, plan, context_lens=ctx)
        assert torch.equal(out.out_tokens, ref.out_tokens)
        assert torch.equal(out.num_out, ref.num_out)
        assert torch.equal(out.grant, ref.grant)
    torch.cuda.synchronize()
    assert torch.equal(captured.pool.buf.stats.counters, eager.pool.buf.stats.counters)
    assert eager.poll_stats() is not None
