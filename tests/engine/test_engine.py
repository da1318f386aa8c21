"""The continuous-batching engine on the tiny preset: exact greedy outputs for every arm."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from spectune.engine.bench import (
    ArmError,
    FixedPolicy,
    TorchPagedAttention,
    arm_policy,
    parse_arm,
)
from spectune.engine.engine import Engine, EngineError, Request
from spectune.engine.replay_drafter import ReplayDrafter
from spectune.engine.run_log import MarginTap, top2_margin
from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.build import build_models, fit_cache
from spectune.models.config import ModelArgs, parse_drafter
from spectune.runtime.planner import load

MAX_K, MAX_BATCH, MAX_NEW, BLOCK = 3, 4, 10, 8
TIERS = [1, 2, 3, 4, 8, 12, 16]
PROMPT_LENS = [5, 19, 1, 8, 12, 3]  # 19 > the prefill chunk: chunked prefill
MAX_NEWS = [10, 7, 1, 10, 4, 9]  # 1: done at its prefill

POLICY_YAML = """\
schema: spectune/1
hardware: {gpu: cpu}
software: {spectune: 0.1.0, torch: 2.11.0}
workload: {target: tiny, drafter: eagle-1l, drafter_kind: autoregressive, drafter_layers: 1,
           dtype: float32, context_len: 64, max_k: 3, max_batch: 4, device: cpu}
costs:
  model:
    target: {weight_ms: 1.0, token_ms: 0.01, knee_tokens: 16, compute_ms: 0.05, kv_ms_per_mtok: 0.5}
    drafter: {fixed_ms: 0.05, step_ms: 0.1, token_ms: 0.001}
    overhead: {base_ms: 0.02, token_ms: 0.0001}
  error: {held_out: 4, median_rel: 0.05, max_rel: 0.1}
  timer: wall-clock
acceptance:
  source: curve:0.8,0.6,0.45
  max_k: 3
  components:
  - {weight: 1.0, accept: [0.8, 0.75, 0.75]}
policy:
  tiers: [4, 8, 16]
  online: {window: 1000.0, margin: 0.02, min_evidence: 1.0}
  rows:
  - {batch: [1, 2], k: 3, verify_budget: 6}
  - {batch: [3, 4], k: 2, verify_budget: 4}
"""


def write_policy(path: Path) -> Path:
    path.write_text(POLICY_YAML)
    return path


class CountingProposer:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def propose(self, inp, k):
        self.calls += 1
        return self.inner.propose(inp, k)


class SpyPlanner:
    """The real planner; records what observe() receives."""

    def __init__(self, planner):
        self.planner, self.seen, self.times = planner, [], []

    def plan(self, batch_size):
        return self.planner.plan(batch_size)

    def observe(self, accepted, offered):
        self.seen.append((list(accepted), list(offered)))
        self.planner.observe(accepted, offered)

    def observe_time(self, batch_size, plan, ms):
        self.times.append((batch_size, plan, ms))
        self.planner.observe_time(batch_size, plan, ms)


@dataclasses.dataclass
class Rig:
    engine: Engine
    replay: ReplayDrafter
    proposer: CountingProposer
    target: torch.nn.Module
    requests: list[Request]


def make_rig(fp8: bool = False, fused: bool = False) -> Rig:
    args = ModelArgs.from_name("tiny")
    max_len = max(PROMPT_LENS) + MAX_NEW + MAX_K + 8
    blocks = 1 + MAX_BATCH * -(-max_len // BLOCK)
    models = build_models(args, parse_drafter("eagle-1l"), device="cpu", dtype=torch.float32,
                          max_batch=MAX_BATCH, max_q=MAX_K + 1, context_len=max_len, seed=3, fp8=fp8,
                          fused=fused)
    models.target.backend = TorchPagedAttention(args.n_layers, blocks, BLOCK, args.n_kv_heads, args.head_dim,
                                                torch.float32, "cpu")
    fit_cache(models.drafter, 1, batch=MAX_BATCH, ctx_max=max_len + MAX_K, max_q=1)
    replay = ReplayDrafter(max_requests=len(PROMPT_LENS), max_len=MAX_NEW, max_k=MAX_K,
                           vocab_size=args.vocab_size, device="cpu", cost_drafter=models.drafter,
                           hidden=torch.randn(MAX_BATCH, args.dim))
    proposer = CountingProposer(replay)
    engine = Engine(models.target, tiers=TIERS, max_batch=MAX_BATCH, max_k=MAX_K, max_len=max_len,
                    num_blocks=blocks, device="cpu", block_size=BLOCK, proposer=proposer, kernels=False,
                    prefill_chunk=8, prefill_tokens=16)
    g = torch.Generator().manual_seed(0)
    requests = [Request(tuple(torch.randint(1, args.vocab_size, (n,), generator=g).tolist()), m)
                for n, m in zip(PROMPT_LENS, MAX_NEWS, strict=True)]
    return Rig(engine, replay, proposer, models.target, requests)


@pytest.fixture(scope="module")
def rig():
    return make_rig()


def greedy_without_cache(target, prompt, n):
    """Plain greedy decoding that recomputes the whole sequence every token (no KV reuse)."""
    seq = list(prompt)
    backend = target.backend
    args = target.args
    for _ in range(n):
        fresh = TorchPagedAttention(args.n_layers, 1 + -(-len(seq) // BLOCK), BLOCK, args.n_kv_heads,
                                    args.head_dim, torch.float32, "cpu")
        target.backend = fresh
        meta = AttnMeta(cu_seqlens_q=torch.tensor([0, len(seq)], dtype=torch.int32),
                        context_lens=torch.zeros(1, dtype=torch.int32), max_q=len(seq),
                        block_tables=torch.arange(1, 1 + -(-len(seq) // BLOCK), dtype=torch.int32)[None])
        logits = target(torch.tensor(seq), torch.arange(len(seq)), meta)
        seq.append(int(logits[-1].argmax()))
    target.backend = backend
    return seq[len(prompt):]


def load_replay(rig, outputs, accept=0.8, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = len(rig.requests)
    rig.replay.load(outputs, torch.full((n, MAX_K), accept), torch.rand(n, MAX_NEW, generator=g))


@pytest.fixture(scope="module")
def plain(rig):
    calls = rig.proposer.calls
    res = rig.engine.run(rig.requests, FixedPolicy(0, rig.engine.tiers), concurrency=3)
    assert rig.proposer.calls == calls  # K = 0: the drafter never runs
    return res


def test_plain_completes_every_request_and_matches_uncached_greedy(rig, plain):
    assert all(plain.done) and not plain.timed_out
    assert [len(o) for o in plain.outputs] == MAX_NEWS
    assert plain.drafter_calls == 0 and set(plain.k_hist) == {0}
    assert plain.tokens == sum(MAX_NEWS) and plain.idle_rows == 0
    for i in (0, 1, 4):
        assert plain.outputs[i] == greedy_without_cache(rig.target, rig.requests[i].prompt, MAX_NEWS[i])
    assert all(t is not None and t >= 0 for t in plain.ttft_ms)
    assert sum(plain.itl_tokens) == sum(MAX_NEWS) - len(MAX_NEWS)  # first tokens come from prefill


@pytest.mark.parametrize("concurrency", [1, 3, 4])
def test_fixed_k_output_is_plain_greedy_output(rig, plain, concurrency):
    load_replay(rig, plain.outputs)
    res = rig.engine.run(rig.requests, arm_policy("fixed:3", rig.engine.tiers), concurrency=concurrency)
    assert all(res.done)
    assert res.outputs == plain.outputs
    assert set(res.k_hist) == {3} and res.drafter_calls == res.steps
    assert res.mean_accept_len is not None and res.mean_accept_len > 1.0
    assert res.steps < plain.steps


def test_auto_arm_follows_the_table_and_observes_counters(rig, plain, tmp_path):
    load_replay(rig, plain.outputs)
    planner = load(write_policy(tmp_path / "policy.yaml"))
    spy = SpyPlanner(planner)
    res = rig.engine.run(rig.requests, arm_policy("auto", rig.engine.tiers, spy), concurrency=4)
    assert all(res.done) and res.outputs == plain.outputs
    assert set(res.k_hist) <= {2, 3} and res.k_hist
    assert res.observed == len(spy.seen) > 0
    accepted = [sum(a) for a, _ in spy.seen]
    assert sum(accepted) > 0
    for acc, off in spy.seen:
        assert len(acc) == len(off) == MAX_K
        assert all(0 <= a <= o for a, o in zip(acc, off, strict=True))
    # every step's time but the last few (their end marks had not landed when the run ended), in
    # step order, with the batch and the plan that step ran
    assert res.timed_steps == len(spy.times) and res.steps - 2 <= len(spy.times) < res.steps
    shapes = [(n, k, tier) for n, k, tier in res.step_shapes]
    assert [(n, p.k, p.tier) for n, p, _ in spy.times] == shapes[: len(spy.times)]
    assert all(ms > 0 for _, _, ms in spy.times) and planner.snapshot_online().timed == len(spy.times)


def test_replayed_acceptance_sets_the_acceptance_length(rig, plain):
    load_replay(rig, plain.outputs, accept=1.0)  # every draft is the true next token
    res = rig.engine.run(rig.requests, FixedPolicy(3, rig.engine.tiers), concurrency=4)
    assert res.outputs == plain.outputs
    # each request emits 4 tokens a step until its last step, which is capped at what is left
    need = [m - 1 for m in MAX_NEWS]
    assert sum(res.itl_tokens) == sum(need)
    assert len(res.itl_tokens) == sum(-(-n // (MAX_K + 1)) for n in need)
    load_replay(rig, plain.outputs, accept=0.0)  # every draft is wrong: one token a step
    res = rig.engine.run(rig.requests, FixedPolicy(3, rig.engine.tiers), concurrency=4)
    assert res.outputs == plain.outputs and res.mean_accept_len == 1.0


def test_engine_keeps_each_requests_acceptance_history_on_the_device(rig, plain):
    load_replay(rig, plain.outputs, accept=1.0)
    rig.engine.drafts.proposer = rig.replay  # the replay itself (its record_step), not the counter
    try:
        res = rig.engine.run(rig.requests, FixedPolicy(3, rig.engine.tiers), concurrency=4)
    finally:
        rig.engine.drafts.proposer = rig.proposer
    need = [m - 1 for m in MAX_NEWS]
    # every granted draft accepted: accepted drafts = decode tokens - one bonus token per (request, step)
    assert rig.replay.hist_acc.sum().item() == sum(need) - len(res.itl_tokens)
    # expected at the prior's 0.7 per position: less than what the requests accepted
    assert 0 < rig.replay.hist_exp.sum().item() < rig.replay.hist_acc.sum().item()
    assert rig.replay.hist_acc[2].item() == 0  # max_new_tokens 1: done at its prefill, never drafted


def test_time_limit_leaves_requests_unfinished(rig):
    res = rig.engine.run(rig.requests, FixedPolicy(0, rig.engine.tiers), concurrency=2, time_limit_s=0.0)
    assert res.timed_out and not any(res.done)


@pytest.mark.parametrize("arm, k", [("plain", 0), ("fixed:7", 7), ("AUTO", None)])
def test_parse_arm(arm, k):
    assert parse_arm(arm) == k


@pytest.mark.parametrize("arm", ["fixed", "fixed:-1", "greedy", "fixed:x"])
def test_bad_arm_names_the_field(arm):
    with pytest.raises(ArmError, match="arm"):
        parse_arm(arm)


def test_bad_requests_and_concurrency_name_the_field(rig):
    with pytest.raises(EngineError, match="concurrency"):
        rig.engine.run(rig.requests, FixedPolicy(0, rig.engine.tiers), concurrency=MAX_BATCH + 1)
    too_long = [Request(tuple(range(1, 200)), 5)]
    with pytest.raises(EngineError, match=r"requests\[0\]"):
        rig.engine.run(too_long, FixedPolicy(0, rig.engine.tiers), concurrency=1)


def test_fixed_policy_cuts_the_budget_to_the_largest_tier():
    p = FixedPolicy(3, (4, 8))
    assert (p.plan(2).k, p.plan(2).verify_budget, p.plan(2).tier) == (3, 6, 8)
    cut = p.plan(5)
    assert cut.verify_budget == 3 and cut.tier == 8
    assert FixedPolicy(0, (4, 8)).plan(3).tier == 4


def test_fp8_target_speculative_output_is_its_plain_greedy_output():
    # FP8 projections (e4m3 weights, per-token activation scales) on the CPU reference path:
    # every fixed K gives the same tokens as plain decoding with the same FP8 target
    fp8 = make_rig(fp8=True)
    assert type(fp8.target.layers[0].mlp.w13).__name__ == "Fp8Linear"
    base = fp8.engine.run(fp8.requests, FixedPolicy(0, fp8.engine.tiers), concurrency=3)
    assert all(base.done)
    for i in (0, 1, 4):
        assert base.outputs[i] == greedy_without_cache(fp8.target, fp8.requests[i].prompt, MAX_NEWS[i])
    load_replay(fp8, base.outputs)
    for arm, concurrency in (("fixed:3", 4), ("fixed:1", 3), ("fixed:2", 1)):
        res = fp8.engine.run(fp8.requests, arm_policy(arm, fp8.engine.tiers), concurrency=concurrency)
        assert res.outputs == base.outputs, arm
        assert res.mean_accept_len is not None and res.mean_accept_len > 1.0


def test_fused_layers_speculative_output_is_their_plain_greedy_output():
    # the fused layer kernels (Triton's interpreter on CPU): every fixed K gives the tokens of
    # plain decoding with the same fused target, and those of the unfused target (float32)
    fused = make_rig(fused=True)
    assert fused.target.fused and fused.engine.target is fused.target
    base = fused.engine.run(fused.requests, FixedPolicy(0, fused.engine.tiers), concurrency=3)
    assert all(base.done)
    unfused = make_rig()
    assert base.outputs == unfused.engine.run(unfused.requests, FixedPolicy(0, unfused.engine.tiers),
                                              concurrency=3).outputs
    load_replay(fused, base.outputs)
    for arm, concurrency in (("fixed:3", 4), ("fixed:1", 3)):
        res = fused.engine.run(fused.requests, arm_policy(arm, fused.engine.tiers), concurrency=concurrency)
        assert res.outputs == base.outputs, arm
        assert res.mean_accept_len is not None and res.mean_accept_len > 1.0


def cuda_parts():
    """The tiny target on CUDA with the paged Triton backend, a replay drafter and the requests:
    (target, replay, requests, max_len, num_blocks)."""
    from spectune.models.paged import PagedTritonAttention

    args = ModelArgs.from_name("tiny")
    max_len = max(PROMPT_LENS) + MAX_NEW + MAX_K + 8
    blocks = 1 + MAX_BATCH * -(-max_len // BLOCK)
    models = build_models(args, parse_drafter("eagle-1l"), device="cuda", dtype=torch.float32,
                          max_batch=MAX_BATCH, max_q=MAX_K + 1, context_len=max_len, seed=3)
    models.target.backend = PagedTritonAttention(args.n_layers, blocks, BLOCK, args.n_kv_heads, args.head_dim,
                                                 torch.float32, "cuda")
    fit_cache(models.drafter, 1, batch=MAX_BATCH, ctx_max=max_len + MAX_K, max_q=1)
    replay = ReplayDrafter(max_requests=len(PROMPT_LENS), max_len=MAX_NEW, max_k=MAX_K,
                           vocab_size=args.vocab_size, device="cuda", cost_drafter=models.drafter,
                           hidden=torch.randn(MAX_BATCH, args.dim, device="cuda"))
    g = torch.Generator().manual_seed(0)
    requests = [Request(tuple(torch.randint(1, args.vocab_size, (n,), generator=g).tolist()), m)
                for n, m in zip(PROMPT_LENS, MAX_NEWS, strict=True)]
    return models.target, replay, requests, max_len, blocks


@pytest.mark.gpu
def test_captured_engine_on_cuda_matches_plain_greedy():
    target, replay, requests, max_len, blocks = cuda_parts()
    engine = Engine(target, tiers=TIERS, max_batch=MAX_BATCH, max_k=MAX_K, max_len=max_len,
                    num_blocks=blocks, device="cuda", block_size=BLOCK, proposer=replay, prefill_chunk=8)
    assert engine.pool.capture
    engine.warm_prefill(PROMPT_LENS, MAX_BATCH)
    assert engine.prefill.captures > 0
    plain = engine.run(requests, FixedPolicy(0, engine.tiers), concurrency=3)
    assert all(plain.done)
    eager = Engine(target, tiers=TIERS, max_batch=MAX_BATCH, max_k=MAX_K, max_len=max_len,
                   num_blocks=blocks, device="cuda", block_size=BLOCK, proposer=replay, prefill_chunk=8,
                   capture=False)
    assert not eager.prefill.graphs
    assert eager.run(requests, FixedPolicy(0, eager.tiers), concurrency=3).outputs == plain.outputs
    assert plain.captures == 0
    n, g = len(requests), torch.Generator().manual_seed(1)
    replay.load(plain.outputs, torch.full((n, MAX_K), 0.8), torch.rand(n, MAX_NEW, generator=g))
    engine.prepare([3], 4)
    spec = engine.run(requests, FixedPolicy(3, engine.tiers), concurrency=4)
    assert spec.outputs == plain.outputs and spec.captures == 0
    assert engine.drafts.captures > 0 and spec.mean_accept_len > 1.0
    engine.prepare([], 4, {2: 4})  # a K no table row runs (``Planner.draft_shapes``), captured ahead
    deeper = engine.run(requests, FixedPolicy(2, engine.tiers), concurrency=4)
    assert deeper.outputs == plain.outputs and deeper.captures == 0


# ---------------------------------------------------------------------------------------------
# what a run records besides tokens: margins, divergence from a reference, decode time


def uncached_margins(target, prompt, outputs):
    """top-1 minus top-2 logit of each output token, recomputing the whole sequence each time."""
    seq, gaps = list(prompt), []
    backend, args = target.backend, target.args
    for tok in outputs:
        blocks = 1 + -(-len(seq) // BLOCK)
        target.backend = TorchPagedAttention(args.n_layers, blocks, BLOCK, args.n_kv_heads, args.head_dim,
                                             torch.float32, "cpu")
        meta = AttnMeta(cu_seqlens_q=torch.tensor([0, len(seq)], dtype=torch.int32),
                        context_lens=torch.zeros(1, dtype=torch.int32), max_q=len(seq),
                        block_tables=torch.arange(1, blocks, dtype=torch.int32)[None])
        top = target(torch.tensor(seq), torch.arange(len(seq)), meta)[-1].topk(2).values
        gaps.append(float(top[0] - top[1]))
        seq.append(tok)
    target.backend = backend
    return gaps


def test_plain_run_records_the_margin_of_every_token(rig, plain):
    for out, gaps, top1 in zip(plain.outputs, plain.margins, plain.top1, strict=True):
        assert len(gaps) == len(top1) == len(out)
        assert all(g >= 0 for g in gaps) and all(t == t for t in top1)  # recorded, no NaN
    # prefill (index 0) and decode steps (the rest) against a forward without cache
    ref = uncached_margins(rig.target, rig.requests[1].prompt, plain.outputs[1])
    assert plain.margins[1] == pytest.approx(ref, abs=1e-4)


def test_verify_steps_record_no_margin(rig, plain):
    load_replay(rig, plain.outputs)
    res = rig.engine.run(rig.requests, FixedPolicy(3, rig.engine.tiers), concurrency=4)
    for gaps in res.margins:
        assert gaps[0] == gaps[0]  # the prefill's first token has one
        assert all(g != g for g in gaps[1:])  # NaN: chosen by a verification step


def test_divergence_from_the_reference_is_found_and_later_steps_are_not_clean(rig, plain):
    load_replay(rig, plain.outputs, accept=1.0)
    reference = [list(o) for o in plain.outputs]
    reference[0][5] += 1  # as if the plain run had chosen another token at index 5
    res = rig.engine.run(rig.requests, FixedPolicy(3, rig.engine.tiers), concurrency=4, reference=reference)
    assert res.outputs == plain.outputs
    assert res.diverged_at == [5, None, None, None, None, None] and res.diverged_requests == 1
    assert len(res.itl_clean) == len(res.itl_tokens) and not all(res.itl_clean)
    # accept = 1.0: index 0 is the prefill's, then steps emit 1-4 (clean), 5-8 and 9 (not clean)
    assert res.itl_clean.count(False) == 2
    assert res.mean_accept_len_clean == pytest.approx(
        sum(n for n, ok in zip(res.itl_tokens, res.itl_clean, strict=True) if ok) / res.itl_clean.count(True))
    same = rig.engine.run(rig.requests, FixedPolicy(3, rig.engine.tiers), concurrency=4, reference=plain.outputs)
    assert same.diverged_requests == 0 and all(same.itl_clean)
    assert same.mean_accept_len_clean == same.mean_accept_len
    with pytest.raises(EngineError, match="reference"):
        rig.engine.run(rig.requests, FixedPolicy(0, rig.engine.tiers), concurrency=2, reference=reference[:2])


def test_decode_time_and_step_shapes(rig, plain):
    load_replay(rig, plain.outputs)
    for res in (plain, rig.engine.run(rig.requests, FixedPolicy(3, rig.engine.tiers), concurrency=3)):
        assert 0 < res.decode_ms <= res.seconds * 1e3  # a part of the run
        assert res.decode_tokens == sum(res.itl_tokens) == res.tokens - len(rig.requests)
        assert res.decode_tok_s is not None and res.decode_tok_s > 0
        assert len(res.step_shapes) == res.steps
        assert {k for _, k, _ in res.step_shapes} == set(res.k_hist)
        assert all(1 <= b <= 3 and b * (k + 1) <= tier for b, k, tier in res.step_shapes)


def test_margin_tap_writes_one_token_forwards_only():
    logits = torch.tensor([[1.0, 3.0, 2.5], [0.0, -1.0, 0.0], [5.0, 1.0, 2.0]])
    assert top2_margin(logits).tolist() == [[0.5, 3.0], [0.0, 0.0], [3.0, 5.0]]  # a tie: margin 0
    tap = MarginTap(lambda ids, pos, meta: logits[: ids.shape[0]], 4, torch.device("cpu"))
    meta = AttnMeta(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
                    context_lens=torch.zeros(2, dtype=torch.int32), max_q=2)
    tap(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), meta)
    assert torch.isnan(tap.margins).all()  # a verification forward (max_q 2): nothing written
    tap(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), dataclasses.replace(meta, max_q=1))
    assert tap.margins[:3].tolist() == [[0.5, 3.0], [0.0, 0.0], [3.0, 5.0]]
