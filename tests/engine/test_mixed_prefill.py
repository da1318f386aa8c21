"""Mixed prefill: prompt pieces ride in the step's target forward; outputs are plain greedy's."""

from __future__ import annotations

import pytest
import torch

from spectune.engine.bench import FixedPolicy, arm_policy
from spectune.engine.engine import Engine, EngineError, Request
from spectune.engine.mixed import Filling, ride_shapes
from spectune.engine.prefill import Piece
from spectune.runtime.planner import load
from spectune.runtime.step import AdaptiveVerifier, GraphPool, StepError
from tests.engine.test_engine import (
    BLOCK,
    MAX_BATCH,
    MAX_K,
    MAX_NEW,
    PROMPT_LENS,
    cuda_parts,
    load_replay,
    make_rig,
    write_policy,
)

CHUNK = 8  # make_rig's prefill_chunk: the 19-token prompt needs three pieces


@pytest.fixture(scope="module")
def rig():
    return make_rig()


@pytest.fixture(scope="module")
def plain(rig):
    """Plain decoding with separate prefill forwards: the reference outputs."""
    return rig.engine.run(rig.requests, FixedPolicy(0, rig.engine.tiers), concurrency=3)


RIDE_ALL = 1 << 20  # a ride limit no admission passes: every prompt rides


def mixed_engine(rig, budget: int, ride_limit: int | None = RIDE_ALL, **kw) -> Engine:
    e = rig.engine
    return Engine(rig.target, tiers=e.tiers, max_batch=MAX_BATCH, max_k=MAX_K, max_len=e.max_len,
                  num_blocks=e.num_blocks, device="cpu", block_size=BLOCK, proposer=rig.proposer, kernels=False,
                  prefill_chunk=CHUNK, prefill_tokens=16, mixed_prefill=True, prefill_budget=budget,
                  ride_limit=ride_limit, **kw)


class StepPieces:
    """Records the pieces of every riding step (wraps ``MixedPrefill.plan``)."""

    def __init__(self, engine: Engine):
        self.steps: list[list[Piece]] = []
        mixed = engine.mixed
        assert mixed is not None
        inner = mixed.plan

        def plan(filling, prompts):
            pieces, ride = inner(filling, prompts)
            self.steps.append(list(pieces))
            return pieces, ride

        mixed.plan = plan  # type: ignore[method-assign]


def check_run(res, plain, rig) -> None:
    assert all(res.done) and not res.timed_out
    assert res.outputs == plain.outputs
    assert res.prefill_forwards == 0  # no separate prefill forward at all
    assert res.mixed_prefill_tokens == sum(PROMPT_LENS)  # every prompt token rode exactly once
    assert all(t is not None and t >= 0 for t in res.ttft_ms)
    assert res.decode_tokens == res.tokens - len(rig.requests)  # first tokens are the prompts' pieces'


def test_separate_prefill_runs_forwards(plain):
    assert plain.prefill_forwards > 0 and plain.mixed_prefill_tokens == 0 and plain.prefill_steps == 0


@pytest.mark.parametrize("concurrency", [1, 3, 4])
@pytest.mark.parametrize("budget", [16, 5])
def test_plain_arm_with_mixed_prefill_is_plain_greedy(rig, plain, concurrency, budget):
    engine = mixed_engine(rig, budget)
    res = engine.run(rig.requests, FixedPolicy(0, engine.tiers), concurrency=concurrency)
    check_run(res, plain, rig)
    assert set(res.k_hist) == {0}
    # prefill and decode margins of every token are recorded as with separate prefill forwards
    for got, want in zip(res.margins, plain.margins, strict=True):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("arm, concurrency", [("fixed:3", 4), ("fixed:1", 3), ("fixed:2", 1)])
def test_fixed_k_with_mixed_prefill_is_plain_greedy(rig, plain, arm, concurrency):
    load_replay(rig, plain.outputs)
    engine = mixed_engine(rig, 16)
    res = engine.run(rig.requests, arm_policy(arm, engine.tiers), concurrency=concurrency)
    check_run(res, plain, rig)
    assert res.mean_accept_len is not None and res.mean_accept_len > 1.0
    assert res.margins[0][0] == pytest.approx(plain.margins[0][0], abs=1e-4)  # the first token's margin


def test_auto_arm_with_mixed_prefill_is_plain_greedy(rig, plain, tmp_path):
    load_replay(rig, plain.outputs)
    planner = load(write_policy(tmp_path / "policy.yaml"))
    engine = mixed_engine(rig, 6)
    res = engine.run(rig.requests, arm_policy("auto", engine.tiers, planner), concurrency=4)
    check_run(res, plain, rig)
    assert set(res.k_hist) <= {2, 3} and res.k_hist and res.observed > 0


def test_a_binding_budget_splits_prompts_over_steps(rig, plain):
    engine = mixed_engine(rig, 5)  # below the chunk: every piece <= 5 tokens
    spy = StepPieces(engine)
    res = engine.run(rig.requests, FixedPolicy(0, engine.tiers), concurrency=4)
    check_run(res, plain, rig)
    riding = [s for s in spy.steps if s]
    assert all(sum(p.length for p in s) <= 5 for s in riding)
    assert any(sum(p.length for p in s) == 5 for s in riding)  # the budget bound
    assert len(riding) >= -(-sum(PROMPT_LENS) // 5)
    # the 19-token prompt (request 1, the only one past 15 tokens) went over four steps: 5+5+5+4
    assert max(p.start for s in riding for p in s) == 15
    assert res.prefill_steps >= 1  # the first admission has no live row yet
    wide = mixed_engine(rig, 16)
    spy_wide = StepPieces(wide)
    wide.run(rig.requests, FixedPolicy(0, wide.tiers), concurrency=4)
    assert max(p.length for s in spy_wide.steps for p in s) == CHUNK  # a 16-token budget: the chunk caps pieces
    assert max(len(s) for s in spy_wide.steps) >= 2  # several prompts in one step


@pytest.mark.parametrize("cap", [1, 2])
def test_a_step_carries_at_most_ride_pieces_pieces(rig, plain, cap):
    # a 16-token budget takes several short prompts a step (above); capped, at most ``cap`` ride,
    # the pieces' attention launch has that many slots, and the outputs stay plain greedy's
    engine = mixed_engine(rig, 16, ride_pieces=cap)
    assert engine.mixed is not None and engine.mixed.region.max_pieces == cap
    spy = StepPieces(engine)
    for arm, concurrency in (("plain", 4), ("fixed:2", 3)):
        load_replay(rig, plain.outputs)
        res = engine.run(rig.requests, arm_policy(arm, engine.tiers), concurrency=concurrency)
        check_run(res, plain, rig)
    riding = [s for s in spy.steps if s]
    assert riding and max(len(s) for s in riding) == cap
    with pytest.raises(EngineError, match="ride_pieces"):
        mixed_engine(rig, 16, ride_pieces=0)


@pytest.mark.parametrize("span", [3, 1])
def test_attention_slots_shorter_than_the_pieces_give_plain_greedy(rig, plain, span, monkeypatch):
    # each piece's attention as slots of <= span tokens (SPAN is 32, above every piece here)
    from spectune.engine import prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "SPAN", span)
    engine = mixed_engine(rig, 16)
    assert engine.mixed is not None and engine.mixed.region.span == span
    for arm, concurrency in (("plain", 4), ("fixed:2", 3)):
        load_replay(rig, plain.outputs)
        res = engine.run(rig.requests, arm_policy(arm, engine.tiers), concurrency=concurrency)
        check_run(res, plain, rig)
        assert res.margins[0][0] == pytest.approx(plain.margins[0][0], abs=1e-4)  # the first token's margin
        if arm == "plain":  # (a verify step records no margins)
            for got, want in zip(res.margins, plain.margins, strict=True):
                assert got == pytest.approx(want, abs=1e-4)


def test_each_step_records_its_riding_tokens_and_the_prediction_prices_them(rig, plain, tmp_path):
    import dataclasses

    from spectune.engine.bench_accounting import predict_decode
    from spectune.runtime.planner import step_ms

    engine = mixed_engine(rig, 16)
    res = engine.run(rig.requests, FixedPolicy(0, engine.tiers), concurrency=3)
    assert len(res.ride_tokens) == len(res.step_shapes) == res.steps
    assert engine.mixed is not None and all(p == 0 or p in engine.mixed.buckets for p in res.ride_tokens)
    assert any(res.ride_tokens) and 0 in res.ride_tokens
    planner = load(write_policy(tmp_path / "policy.yaml"))
    cost = dataclasses.replace(planner.cost, context_len=40)
    want = sum(cost.drafter_ms(b, k) + cost.target_ms(t + p, b, verify=k > 0) + cost.overhead_ms(t + p)
               for (b, k, t), p in zip(res.step_shapes, res.ride_tokens, strict=True))
    assert want > sum(step_ms(cost, b, k, t) for b, k, t in res.step_shapes)  # the riding tokens cost
    got = predict_decode(planner.cost, planner_acceptance(planner), lambda: FixedPolicy(0, engine.tiers), res,
                         speculative=False, concurrency=3, requests=len(rig.requests), decode_tokens=4,
                         context_len=40, seed=0, at_measured_accept=False)
    assert got.at_measured_steps == pytest.approx(res.decode_tokens / want * 1e3)


def planner_acceptance(planner):
    from spectune.autotune.acceptance import AcceptanceModel

    return AcceptanceModel.from_dict(planner.table.acceptance)


def test_next_forward_caps_the_pieces():
    from spectune.runtime.prefill_plan import next_forward

    lens, done = [4, 3, 9, 2], [0, 3, 0, 0]  # the second prompt is cached: no piece
    assert [p.index for p in next_forward(lens, done, 8, 100)] == [0, 2, 3]
    assert [p.index for p in next_forward(lens, done, 8, 100, max_pieces=2)] == [0, 2]
    assert next_forward(lens, done, 8, 100, max_pieces=2)[1].length == 8  # the chunk still caps a piece
    assert [(p.index, p.length) for p in next_forward(lens, done, 8, 6, max_pieces=3)] == [(0, 4), (2, 2)]


def test_requests_admitted_one_at_a_time_and_done_at_their_first_token(rig):
    # max_new_tokens 1 everywhere: each request leaves after the step that ended its prompt
    reqs = [Request(r.prompt, 1) for r in rig.requests]
    base = rig.engine.run(reqs, FixedPolicy(0, rig.engine.tiers), concurrency=2)
    engine = mixed_engine(rig, 8)
    res = engine.run(reqs, FixedPolicy(0, engine.tiers), concurrency=2)
    assert res.outputs == base.outputs and all(len(o) == 1 for o in res.outputs)
    assert res.steps == 0 and res.prefill_steps > 0 and res.prefill_forwards == 0
    assert all(t is not None for t in res.ttft_ms)


def test_triton_kernels_with_mixed_prefill_give_the_reference_outputs(plain, monkeypatch):
    # the GPU path on CPU (Triton's interpreter): paged Triton attention over the merged metadata
    # (decode slots of query length 1..K+1 and prompt pieces of up to a chunk in one launch) and
    # the Triton pack / allocate / accept kernels, against the torch references' separate prefill
    from spectune.models.paged import PagedTritonAttention

    kernel_rig = make_rig()
    a, e = kernel_rig.target.args, kernel_rig.engine
    kernel_rig.target.backend = PagedTritonAttention(a.n_layers, e.num_blocks, BLOCK, a.n_kv_heads, a.head_dim,
                                                 torch.float32, "cpu")
    engine = Engine(kernel_rig.target, tiers=e.tiers, max_batch=MAX_BATCH, max_k=MAX_K, max_len=e.max_len,
                    num_blocks=e.num_blocks, device="cpu", block_size=BLOCK, proposer=kernel_rig.proposer, kernels=True,
                    prefill_chunk=CHUNK, mixed_prefill=True, prefill_budget=16, ride_limit=RIDE_ALL)
    load_replay(kernel_rig, plain.outputs)
    for k, concurrency in ((0, 3), (3, 4)):
        res = engine.run(kernel_rig.requests, FixedPolicy(k, engine.tiers), concurrency=concurrency)
        check_run(res, plain, kernel_rig)
    # the pieces' attention in slots of <= 3 tokens through the Triton kernel
    from spectune.engine import prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "SPAN", 3)
    engine = Engine(kernel_rig.target, tiers=e.tiers, max_batch=MAX_BATCH, max_k=MAX_K, max_len=e.max_len,
                    num_blocks=e.num_blocks, device="cpu", block_size=BLOCK, proposer=kernel_rig.proposer, kernels=True,
                    prefill_chunk=CHUNK, mixed_prefill=True, prefill_budget=16, ride_limit=RIDE_ALL)
    assert engine.mixed is not None and engine.mixed.region.span == 3
    res = engine.run(kernel_rig.requests, FixedPolicy(3, engine.tiers), concurrency=4)
    check_run(res, plain, kernel_rig)


class Admissions:
    """Records each admission's prompt tokens and whether it rode (wraps ``Engine._admit``)."""

    def __init__(self, engine: Engine):
        self.rode: list[tuple[int, bool, int]] = []  # (prompt tokens, rode, requests filling before)
        inner = engine._admit

        def admit(run, queue, concurrency, it, marks, admit_mark):
            rows, filling, waiting = len(engine.rows), len(engine.filling), list(queue)
            inner(run, queue, concurrency, it, marks, admit_mark)
            new = waiting[: len(waiting) - len(queue)]
            if new:
                tokens = sum(len(run.requests[r].prompt) for r in new)
                rode = len(engine.filling) > filling  # joined the requests filling by pieces
                assert rode != (len(engine.rows) > rows)  # else prefilled now by separate forwards
                self.rode.append((tokens, rode, filling))

        engine._admit = admit  # type: ignore[method-assign]


@pytest.mark.parametrize("limit", [8, 12])
def test_a_burst_takes_separate_forwards_and_smaller_admissions_ride(rig, plain, limit):
    # the first admission of 4 prompts (5 + 19 + 1 + 8 = 33 tokens, nothing filling) is a burst:
    # separate prefill forwards; later single admissions of <= limit tokens ride in the steps
    engine = mixed_engine(rig, 16, ride_limit=limit)
    spy = Admissions(engine)
    res = engine.run(rig.requests, FixedPolicy(0, engine.tiers), concurrency=4)
    assert all(res.done) and res.outputs == plain.outputs
    assert spy.rode[0] == (33, False, 0) and res.prefill_forwards > 0
    for tokens, rode, filling in spy.rode:
        assert rode == (filling > 0 or tokens <= limit), (tokens, rode, filling, limit)
    ridden = sum(t for t, rode, _ in spy.rode if rode)
    assert ridden > 0 and res.mixed_prefill_tokens == ridden  # every riding prompt token rode once
    assert [t for t, _, _ in spy.rode] and sum(t for t, _, _ in spy.rode) == sum(PROMPT_LENS)


def test_the_default_ride_limit_is_the_budget(rig):
    assert mixed_engine(rig, 16, ride_limit=None).ride_limit == 16
    with pytest.raises(EngineError, match="ride_limit"):
        mixed_engine(rig, 16, ride_limit=0)


def test_a_step_that_carried_pieces_is_not_timed_as_the_plan(rig, plain, tmp_path):
    # the controller's time feedback is the plan's step cost: prompt pieces riding in a step are
    # not part of it (nor a graph capture); every other step is reported
    load_replay(rig, plain.outputs)
    planner = load(write_policy(tmp_path / "policy.yaml"))
    engine = mixed_engine(rig, 6)
    spy = StepPieces(engine)
    res = engine.run(rig.requests, arm_policy("auto", engine.tiers, planner), concurrency=4)
    riding = sum(1 for s in spy.steps if s) - res.prefill_steps  # live-row steps that carried pieces
    assert riding > 0
    # the last one or two spans may still be in flight when the run ends (as without pieces)
    assert res.steps - riding - 2 <= res.timed_steps <= res.steps - riding


def test_filling_keeps_admission_order():
    f = Filling()
    for rid, mark in ((7, 0), (3, 1), (5, 1)):
        f.add(rid, mark)
    ended, stay = f.advance([Piece(0, 0, 4, False), Piece(1, 0, 2, True), Piece(2, 0, 6, False)])
    assert ended == [(1, 3, 1)] and stay == [0, 2]
    assert f.rids == [7, 5] and f.done == [4, 6] and f.marks == [0, 1]
    ended, stay = f.advance([Piece(0, 4, 1, True), Piece(1, 6, 1, True)])
    assert ended == [(0, 7, 0), (1, 5, 1)] and stay == [] and len(f) == 0


def test_ride_shapes_cover_a_full_batch_at_the_largest_k():
    shapes = ride_shapes([1, 4, 8, 16, 32], [0, 3], 4, [16, 32])
    assert {t for t, _, _ in shapes} == {1, 4, 8, 16}  # 4 rows x (1 + 3) tokens: tier 16
    assert len(shapes) == 4 * 2 * 2 and shapes[0] == (16, True, 32)
    plain = ride_shapes([1, 4, 8], [0], 3, [16])
    assert plain == [(4, False, 16), (1, False, 16)]
    # a verify-only arm still needs the smallest tier's decode step (a step with no live row)
    assert (1, False, 16) in ride_shapes([1, 4], [2], 1, [16]) and (1, True, 16) in ride_shapes([1, 4], [2], 1, [16])


def test_ride_shapes_cover_a_deeper_k_at_a_smaller_batch():
    # an adaptive policy drafts deeper at small batches than the table's K at the run's
    # concurrency (``Planner.draft_shapes``): its riding steps' tiers are captured too
    tiers = [1, 4, 8, 16, 32, 64]
    base = ride_shapes(tiers, [0, 1], 8, [16])
    assert max(t for t, _, _ in base) == 16  # 8 rows x (1 + 1)
    deeper = ride_shapes(tiers, [0, 1], 8, [16], {1: 8, 7: 4})
    assert max(t for t, _, _ in deeper) == 32 and (32, True, 16) in deeper  # 4 rows x (1 + 7)
    assert set(base) < set(deeper)
    # a K's batch past the run's concurrency counts at the concurrency
    assert max(t for t, _, _ in ride_shapes(tiers, [0, 1], 8, [16], {3: 64})) == 32  # 8 x 4
    assert ride_shapes(tiers, [0, 1], 8, [16], {}) == base


def test_bad_budget_and_ride_name_the_field(rig):
    e = rig.engine
    with pytest.raises(EngineError, match="prefill_budget"):
        Engine(rig.target, tiers=e.tiers, max_batch=MAX_BATCH, max_k=MAX_K, max_len=e.max_len,
               num_blocks=e.num_blocks, device="cpu", block_size=BLOCK, kernels=False, mixed_prefill=True,
               prefill_budget=0)
    engine = mixed_engine(rig, 16)
    z = torch.zeros(MAX_BATCH, dtype=torch.int64)
    with pytest.raises(StepError, match="ride"):
        engine.verifier.step(z, None, None, 1, FixedPolicy(0, engine.tiers).plan(1),
                             context_lens=z.to(torch.int32), ride=32)  # not a bucket
    plain_pool = AdaptiveVerifier(GraphPool(lambda *a: None, [4], max_batch=2, max_k=1, device="cpu", kernels=False))
    with pytest.raises(StepError, match="ride"):  # a pool without a rider
        plain_pool.step(z, None, None, 1, FixedPolicy(0, (4,)).plan(1), context_lens=z.to(torch.int32), ride=16)
    with pytest.raises(StepError, match="batch_size"):  # no live row needs riding tokens
        plain_pool.step(z, None, None, 0, FixedPolicy(0, (4,)).plan(1), context_lens=z.to(torch.int32))


@pytest.mark.gpu
def test_captured_mixed_prefill_on_cuda_matches_separate_prefill():
    target, replay, requests, max_len, blocks = cuda_parts()
    tiers = (1, 2, 3, 4, 8, 12, 16)

    def engine(mixed: bool) -> Engine:
        return Engine(target, tiers=tiers, max_batch=MAX_BATCH, max_k=MAX_K, max_len=max_len, num_blocks=blocks,
                      device="cuda", block_size=BLOCK, proposer=replay, prefill_chunk=CHUNK, mixed_prefill=mixed,
                      prefill_budget=16, ride_limit=RIDE_ALL if mixed else None)  # every admission rides

    base = engine(False).run(requests, FixedPolicy(0, tiers), concurrency=3)
    mixed = engine(True)
    assert mixed.pool.capture
    res = mixed.run(requests, FixedPolicy(0, tiers), concurrency=3)
    assert res.outputs == base.outputs and res.prefill_forwards == 0 and res.captures > 0
    n, g = len(requests), torch.Generator().manual_seed(1)
    replay.load(base.outputs, torch.full((n, MAX_K), 0.8), torch.rand(n, MAX_NEW, generator=g))
    mixed.prepare([3], 4)
    spec = mixed.run(requests, FixedPolicy(3, tiers), concurrency=4)
    assert spec.outputs == base.outputs and spec.mean_accept_len > 1.0
    again = mixed.run(requests, FixedPolicy(3, tiers), concurrency=4)
    assert again.outputs == base.outputs and again.captures == 0  # every graph captured once
    # a K deeper than the run's own at its batch (``Planner.draft_shapes``): its drafter graphs
    # and its riding steps' tiers are captured ahead, none inside the run
    deep = engine(True)
    deep.prepare([0, 1], 3, {3: 3})
    assert any(t == 12 for t, _, _ in deep.pool.ride_graphs)  # 3 rows x (1 + 3)
    res = deep.run(requests, FixedPolicy(3, tiers), concurrency=3)
    assert res.outputs == base.outputs and res.captures == 0


def test_bench_with_mixed_prefill_runs_no_prefill_forward_and_stays_exact(tmp_path):
    import json

    from spectune.cli import main

    policy = write_policy(tmp_path / "policy.yaml")
    out = tmp_path / "results.json"
    argv = ["bench", "--policy", str(policy), "--out", str(out), "--concurrency", "2", "--arms", "plain,fixed:2",
            "--repeats", "1", "--prompts", "3", "--max-new-tokens", "6", "--prompt-len", "9", "--device", "cpu",
            "--no-progress", "--mixed-prefill", "--prefill-budget", "8", "--ride-limit", "1000"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["header"]["mixed_prefill"] is True and data["header"]["prefill_budget"] == 8
    assert data["header"]["ride_limit"] == 1000
    for row in data["rows"]:
        assert row["completed"] == 3 and row["mismatches"] == 0
        assert row["prefill_forwards"] == 0 and row["mixed_prefill_tokens"] == 3 * 9
        assert row["predicted_output_tok_s"] > 0  # the riding steps in the simulator
    assert data["header"]["ride_pieces"] == 16
    assert main([*argv, "--ride-pieces", "1"]) == 0
    data = json.loads(out.read_text())
    assert data["header"]["ride_pieces"] == 1
    assert all(row["completed"] == 3 and row["mismatches"] == 0 for row in data["rows"])
    assert data["header"]["admit_ahead"] == 4  # on by default: rows for admissions ahead, max(4, max batch / 4)
    assert main([*argv, "--no-admit-ahead"]) == 0
    data = json.loads(out.read_text())
    assert data["header"]["admit_ahead"] == 0
    for row in data["rows"]:
        assert row["completed"] == 3 and row["mismatches"] == 0 and row["prefill_forwards"] == 0
    assert main([*argv, "--admit-ahead"]) == 0
    data = json.loads(out.read_text())
    assert data["header"]["admit_ahead"] == 4
    for row in data["rows"]:
        assert row["completed"] == 3 and row["mismatches"] == 0 and row["prefill_forwards"] == 0
    assert data["header"]["await_ends"] is False
    assert main([*argv, "--await-ends"]) == 0
    data = json.loads(out.read_text())
    assert data["header"]["await_ends"] is True
    assert all(row["completed"] == 3 and row["mismatches"] == 0 for row in data["rows"])
    # the default ride limit is the budget: a 9-token prompt is a burst of its own, prefilled apart
    assert main(argv[:-2]) == 0
    data = json.loads(out.read_text())
    assert data["header"]["ride_limit"] == 8
    for row in data["rows"]:
        assert row["completed"] == 3 and row["mismatches"] == 0
        assert row["prefill_forwards"] > 0 and row["mixed_prefill_tokens"] == 0


class RidesAtOne:
    """fixed:3, except that a step carrying prompt tokens runs K ``ride_k`` (``Planner.plan_ride``'s hook)."""

    def __init__(self, tiers, ride_k=1):
        self.fixed3, self.fixed1 = FixedPolicy(3, tiers), FixedPolicy(ride_k, tiers)
        self.rides: list[tuple[int, int]] = []

    def plan(self, batch_size):
        return self.fixed3.plan(batch_size)

    def plan_ride(self, batch_size, ride):
        self.rides.append((batch_size, ride))
        return self.fixed1.plan(batch_size)


@pytest.mark.parametrize("ride_k", [1, 0])
def test_a_riding_step_asks_the_policy_for_its_shape(rig, plain, ride_k):
    # the engine hands the step's prompt bucket to ``plan_ride`` before the step (the pieces do
    # not depend on the plan), runs the shape it returns (plain decoding too), and the outputs
    # stay plain greedy's
    load_replay(rig, plain.outputs)
    engine = mixed_engine(rig, 16)
    spy = StepPieces(engine)
    policy = RidesAtOne(engine.tiers, ride_k)
    res = engine.run(rig.requests, policy, concurrency=3)
    check_run(res, plain, rig)
    assert policy.rides and all(ride > 0 for _, ride in policy.rides)
    riding_with_rows = len(policy.rides)
    assert res.k_hist.get(ride_k, 0) == riding_with_rows  # every riding step with live rows ran ride_k
    assert res.k_hist.get(3, 0) > 0  # the others the plan's K 3
    assert len([s for s in spy.steps if s]) >= riding_with_rows  # (+ steps with no live row)


def ahead_engine(rig, budget: int, ahead: int) -> Engine:
    return mixed_engine(rig, budget, admit_ahead=ahead)


@pytest.mark.parametrize("concurrency", [1, 2, 3])
def test_admitting_ahead_is_plain_greedy_with_fewer_rows_short(rig, plain, concurrency):
    # plain decoding: each step emits one token a row, so the engine knows the step that ends a
    # request and admits its successor's prompt to ride beside it; the outputs stay plain greedy's
    # and the batch runs short on fewer steps (plain decoding: fewer steps in all)
    base = mixed_engine(rig, 16)
    after = base.run(rig.requests, FixedPolicy(0, base.tiers), concurrency=concurrency)
    engine = ahead_engine(rig, 16, 2)
    ahead = engine.run(rig.requests, FixedPolicy(0, engine.tiers), concurrency=concurrency)
    check_run(ahead, plain, rig)
    check_run(after, plain, rig)
    # forwards in all: decode steps, and steps of prompt pieces alone (no live row)
    assert len(ahead.step_shapes) + ahead.prefill_steps < len(after.step_shapes) + after.prefill_steps
    if concurrency == 1:  # the next prompt rides beside the last step instead of a step of its own
        assert ahead.prefill_steps < after.prefill_steps
    assert max(n for n, _, _ in ahead.step_shapes) <= concurrency


@pytest.mark.parametrize("arm, concurrency", [("fixed:3", 4), ("fixed:1", 3), ("fixed:2", 2)])
def test_admitting_ahead_with_drafts_is_plain_greedy(rig, plain, arm, concurrency):
    load_replay(rig, plain.outputs)
    engine = ahead_engine(rig, 16, 2)
    res = engine.run(rig.requests, arm_policy(arm, engine.tiers), concurrency=concurrency)
    check_run(res, plain, rig)
    assert max(n for n, _, _ in res.step_shapes) <= concurrency


def test_admitting_ahead_is_capped_by_its_rows(rig, plain):
    # no row past max_batch (admit_ahead 0 rows is the engine without it): the same steps as it
    base = mixed_engine(rig, 16)
    want = base.run(rig.requests, FixedPolicy(0, base.tiers), concurrency=2)
    engine = mixed_engine(rig, 16, admit_ahead=0)
    res = engine.run(rig.requests, FixedPolicy(0, engine.tiers), concurrency=2)
    assert res.outputs == plain.outputs and res.step_shapes == want.step_shapes


def test_admit_ahead_names_the_field(rig):
    e = rig.engine
    kw = dict(tiers=e.tiers, max_batch=MAX_BATCH, max_k=MAX_K, max_len=e.max_len, num_blocks=e.num_blocks,
              device="cpu", block_size=BLOCK, kernels=False)
    with pytest.raises(EngineError, match="admit_ahead: needs mixed_prefill"):
        Engine(rig.target, admit_ahead=2, **kw)
    with pytest.raises(EngineError, match="admit_ahead: must be >= 0"):
        Engine(rig.target, mixed_prefill=True, admit_ahead=-1, **kw)


def test_may_end_counts_k_plus_one_for_each_step_in_flight_and_the_next():
    from spectune.engine.run_log import RunLog

    log = RunLog([Request((1, 2), 9)], None)
    log.outputs[0] += [7, 7]
    log.inflight[0] = 1  # 2 seen, a step in flight: after the next one at most 2 + 2 x width
    assert not log.may_end(0, 3) and log.may_end(0, 4) and log.may_end(0, 5)
    log.inflight[0] = 7  # 2 + 7 >= 9: surely done already, so not "may end"
    assert log.surely_done(0) and not log.may_end(0, 4)


class LateCopies:
    """On CPU every copy lands at once; this makes the engine's host run a step ahead of the
    device, as on a GPU: a copy is read only where the engine waits for it (``must_before``)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        return None


def lagging(engine: Engine, monkeypatch) -> Engine:
    send = engine._send

    def late_send(run, copy):
        send(run, copy)
        copy.event = LateCopies()

    monkeypatch.setattr(engine, "_send", late_send)
    return engine


@pytest.mark.parametrize("arm, concurrency", [("fixed:3", 2), ("fixed:2", 1)])
def test_await_ends_reads_the_last_step_where_a_row_may_have_ended(rig, plain, monkeypatch, arm, concurrency):
    # a host a step ahead learns a request that ended on a multi-token step a step late: it rides
    # one more step as an idle row; waiting for the last step's tokens where a row may have ended
    # (and a request is queued) removes those rows, and the outputs stay plain greedy's
    load_replay(rig, plain.outputs)
    e = rig.engine
    runs = {}
    for wait in (False, True):
        engine = lagging(Engine(rig.target, tiers=e.tiers, max_batch=MAX_BATCH, max_k=MAX_K, max_len=e.max_len,
                                num_blocks=e.num_blocks, device="cpu", block_size=BLOCK, proposer=rig.proposer,
                                kernels=False, await_ends=wait), monkeypatch)
        runs[wait] = engine.run(rig.requests, arm_policy(arm, engine.tiers), concurrency=concurrency)
        assert runs[wait].outputs == plain.outputs and all(runs[wait].done)
    assert runs[False].idle_rows > 0
    assert runs[True].idle_rows < runs[False].idle_rows
    # the slots go to the next requests a step sooner: fewer steps in all
    assert len(runs[True].step_shapes) < len(runs[False].step_shapes)


@pytest.mark.parametrize("arm, concurrency", [("fixed:3", 2), ("fixed:3", 3), ("fixed:1", 4)])
def test_admitting_ahead_with_a_host_a_step_behind(rig, plain, monkeypatch, arm, concurrency):
    # the host learns ends a step late (idle rows): admitted ahead, a successor's prompt is cached
    # while the row it replaces may still run, waits ready and joins as the slot frees; the
    # outputs stay plain greedy's, fewer forwards run, and never more rows than the concurrency
    load_replay(rig, plain.outputs)
    runs, most_ready = {}, {}
    for ahead in (0, 2):
        engine = lagging(mixed_engine(rig, 16, admit_ahead=ahead), monkeypatch)
        promote, seen = engine._promote, [0]

        def spy(promote=promote, engine=engine, seen=seen):
            seen[0] = max(seen[0], len(engine.ready))
            promote()

        monkeypatch.setattr(engine, "_promote", spy)
        runs[ahead] = res = engine.run(rig.requests, arm_policy(arm, engine.tiers), concurrency=concurrency)
        check_run(res, plain, rig)
        assert res.idle_rows > 0 and max(n for n, _, _ in res.step_shapes) <= concurrency
        most_ready[ahead] = seen[0]
    assert most_ready[0] == 0 and most_ready[2] > 0  # some successor waited ready
    forwards = {a: len(r.step_shapes) + r.prefill_steps for a, r in runs.items()}
    assert forwards[2] < forwards[0]
