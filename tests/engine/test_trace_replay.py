"""Token-by-token replay of a trace in the engine: the recorded drafter's right/wrong, offered and
confidence per draft position, against an independent step-by-step reference loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spectune.engine.bench import FixedPolicy
from spectune.engine.replay_drafter import DraftError
from spectune.engine.trace_replay import (
    TraceReplayError,
    cross_fitted,
    is_trace_source,
    load_trace_replay,
)
from spectune.models.specdecode import write_traces
from spectune.models.trace_steps import request_steps, token_tables
from spectune.runtime.planner import Plan, smallest_tier
from tests.engine import test_engine as base
from tests.engine.test_engine import MAX_K, MAX_NEWS

rig, plain = base.rig, base.plain  # the engine rig's fixtures


class BudgetPolicy:
    """K drafts per request, ``per_request`` x batch of them verified (the allocation picks)."""

    def __init__(self, k, per_request, tiers):
        self.k, self.per_request, self.tiers = k, per_request, tiers

    def plan(self, batch):
        budget = self.per_request * batch
        return Plan(self.k, budget, smallest_tier(self.tiers, batch + budget))


def records(steps_per_request, conf_of=None):
    """Trace lines from {request: [(offered, accepted), ...]}; conf: 0.9 on right drafts, 0.2 else."""
    out = []
    for name, steps in steps_per_request.items():
        for s, (o, a) in enumerate(steps):
            conf = [0.9 if j < a else 0.2 for j in range(o)] if conf_of is None else conf_of(name, o, a)
            out.append({"request": name, "step": s, "offered": o, "accepted": a, "conf": conf})
    return out


def reference_loop(run, offered, max_new, k, grant_of=None):
    """Emitted tokens per decode step of one request: a step at output index p verifies
    g = min(k, offered[p], remaining - 1) drafts and accepts min(run[p], g)."""
    p, emitted = 1, []  # output index 0 comes from the prefill
    while p < max_new:
        g = min(k, int(offered[p]), max_new - p - 1)
        if grant_of is not None:
            g = min(g, grant_of(p))
        a = min(int(run[p]), g)
        emitted.append(a + 1)
        p += a + 1
    return emitted


def test_token_tables_by_hand():
    # one request, K = 3: steps (offered, accepted) = (3, 1), (0, 0), (2, 2)
    recs = records({"r": [(3, 1), (0, 0), (2, 2)]},
                   conf_of=lambda n, o, a: [[0.5, 0.4, 0.3], [], [0.8, 0.7]][[3, 0, 2].index(o)])
    (req,) = request_steps(recs, 3)
    t = token_tables([req], [0], 1, 8, offset=1)
    # recorded indices: step 0 covers 0..1, step 1 covers 2, step 2 covers 3..5; output = recorded + 1
    assert t.run[0].tolist() == [0, 1, 0, 0, 2, 1, 0, 1]  # index 7 wraps to the request again
    assert t.offered[0].tolist() == [0, 3, 2, 0, 2, 1, 0, 3]
    assert t.conf[0, 1].tolist() == [0.5, 0.4, 0.3]
    assert t.conf[0, 2].tolist() == [0.4, 0.3, 0.0]  # step 0 resumed at its draft 1
    assert t.conf[0, 3].tolist() == [0.0, 0.0, 0.0]
    assert t.conf[0, 5].tolist() == [0.7, 0.0, 0.0]
    assert t.requests == ("r",)


def test_streams_follow_the_order_and_wrap():
    recs = records({"a": [(1, 1), (1, 0)], "b": [(2, 0)]})  # a covers 3 indices, b 1
    reqs = request_steps(recs, 2)
    t = token_tables(reqs, [1, 0], 2, 6, offset=0)
    assert t.requests == ("b", "a")
    assert t.run[0].tolist() == [0, 1, 0, 0, 0, 1]  # b, a, b...
    assert t.run[1].tolist() == [1, 0, 0, 0, 1, 0]  # a, b, a
    with pytest.raises(Exception, match="nothing to replay"):
        token_tables([], [], 1, 4)


def test_cross_fitting_never_uses_a_requests_own_split():
    # split 0 (requests 0, 2): conf 0.9 always right; split 1 (1, 3): conf 0.9 always wrong
    steps = {f"q{i}": [(2, 2 if i % 2 == 0 else 0)] * 4 for i in range(4)}
    reqs = request_steps(records(steps, conf_of=lambda n, o, a: [0.9] * o), 2)
    conf = cross_fitted(reqs, 2)
    # split 0 is calibrated by split 1's tables (0.9 was never right there) and vice versa
    assert np.nanmax(conf[0][:, 0]) == 0.0 and np.nanmin(conf[1][:, 0]) == 1.0


def test_is_trace_source():
    assert is_trace_source("a.jsonl.gz") and is_trace_source("traces:x") and not is_trace_source("curve:0.5")
    assert not is_trace_source(None)


@pytest.fixture()
def engine(rig):
    proposer = rig.engine.drafts.proposer
    rig.engine.drafts.proposer = rig.replay  # the replay itself: the engine reads its ``offered``
    yield rig.engine
    rig.engine.drafts.proposer = proposer


def stream(rng, n_requests, n_steps):
    out = {}
    for i in range(n_requests):
        steps = []
        for _ in range(n_steps):
            o = int(rng.integers(0, MAX_K + 1))
            steps.append((o, int(rng.integers(0, o + 1))))
        out[f"t{i}"] = steps
    return out


@pytest.mark.parametrize(("seed", "concurrency"), [(0, 1), (1, 3), (2, 4)])
def test_fixed_k_replays_the_trace_step_by_step(rig, plain, engine, seed, concurrency):
    rng = np.random.default_rng(seed)
    reqs = request_steps(records(stream(rng, 4, 6)), MAX_K)
    order = rng.permutation(len(reqs))
    n = len(rig.requests)
    t = token_tables(reqs, order, n, max(MAX_NEWS), offset=1)
    rig.replay.load_tokens(plain.outputs, t)
    for k in (MAX_K, 2):
        res = engine.run(rig.requests, FixedPolicy(k, engine.tiers), concurrency=concurrency)
        assert res.outputs == plain.outputs
        want = [e for i, m in enumerate(MAX_NEWS) for e in reference_loop(t.run[i], t.offered[i], m, k)]
        assert sorted(res.itl_tokens) == sorted(want)
        assert sum(res.itl_tokens) == sum(m - 1 for m in MAX_NEWS)


def test_confidence_allocation_grants_the_budget_to_confident_drafts(rig, plain, engine):
    # t0: always right, conf 0.9; t1: never right, conf 0.2 (same shape of steps)
    steps = {"t0": [(3, 3)] * 8, "t1": [(3, 0)] * 8}
    reqs = request_steps(records(steps), MAX_K)
    n = len(rig.requests)
    t = token_tables(reqs, [0, 1], n, max(MAX_NEWS), offset=1)
    lens = {}
    for mode in ("confidence", "uniform", "history"):
        rig.replay.load_tokens(plain.outputs, t)
        rig.replay.set_allocation(mode)
        res = engine.run(rig.requests, BudgetPolicy(MAX_K, 1, engine.tiers), concurrency=2)
        assert res.outputs == plain.outputs
        lens[mode] = res.mean_accept_len
    assert lens["confidence"] > lens["uniform"]
    with pytest.raises(DraftError, match="allocation"):
        rig.replay.set_allocation("best")


class Observing(FixedPolicy):
    """Fixed K that keeps the counters the engine hands to ``observe``."""

    def __init__(self, k, tiers):
        super().__init__(k, tuple(tiers))
        object.__setattr__(self, "seen", [])

    def observe(self, accepted, tested):
        self.seen.append((list(accepted), list(tested)))


def serve_traced(rig, plain, engine, steps, order, concurrency):
    """Replay the recorded ``steps`` (request name -> (offered, accepted) per step) in ``order``
    under a fixed-K policy that keeps every observation; the outputs are plain decoding's."""
    reqs = request_steps(records(steps), MAX_K)
    rig.replay.load_tokens(plain.outputs, token_tables(reqs, order, len(rig.requests), max(MAX_NEWS), offset=1))
    policy = Observing(MAX_K, engine.tiers)
    assert engine.run(rig.requests, policy, concurrency=concurrency).outputs == plain.outputs
    return policy


def test_declined_drafts_count_as_tested_and_rejected(rig, plain, engine):
    # t0 never offers a draft; t1 offers 1 of K and it is right: the controller must see the
    # planned slots the drafter left empty as rejected drafts, not as untested ones
    policy = serve_traced(rig, plain, engine, {"t0": [(0, 0)] * 8, "t1": [(1, 1)] * 8}, [0, 1], 2)
    engine.verifier.poll_stats()
    acc = [sum(a[i] for a, _ in policy.seen) for i in range(MAX_K)]
    tested = [sum(x[i] for _, x in policy.seen) for i in range(MAX_K)]
    assert acc[0] > 0 and acc[1:] == [0] * (MAX_K - 1)  # only t1's one draft is ever right
    # t0's empty slots, and t1's declined 2nd draft (unless its request had one token left)
    assert tested[0] > acc[0] and 0 < tested[1] <= acc[0]
    assert tested[2:] == [0] * (MAX_K - 2)


def test_load_trace_replay_file(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "t.jsonl.gz"
    write_traces(path, [dict(r, dataset="d", drafter="suffix", model="m") for r in records(stream(rng, 6, 5))])
    tr = load_trace_replay(str(path), MAX_K)
    assert tr.has_conf and len(tr.requests) == 6 and len(tr.rates) == MAX_K
    assert "other split" in tr.calibration and "6 requests" in tr.describe()
    t1, t2 = tr.tables(5, 12, seed=0, repeat=0), tr.tables(5, 12, seed=0, repeat=1)
    assert t1.run.shape == (5, 12) and t1.conf.shape == (5, 12, MAX_K)
    assert t1.requests != t2.requests  # repeats replay in another order
    raw = load_trace_replay(str(path), MAX_K, calibration="raw")
    assert np.array_equal(np.nan_to_num(raw.conf[0]), np.nan_to_num(raw.requests[0].conf))
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(TraceReplayError, match="no trace records"):
        load_trace_replay(str(empty), MAX_K)


def test_load_tokens_checks_the_table_shape(rig, plain):
    reqs = request_steps(records({"a": [(1, 1)]}), MAX_K)
    short = token_tables(reqs, [0], len(rig.requests), 3)
    with pytest.raises(DraftError, match="tables"):
        rig.replay.load_tokens(plain.outputs, short)


def test_sampled_rates_still_replay_exactly(rig, plain, engine):
    n = len(rig.requests)
    g = torch.Generator().manual_seed(4)
    accept = torch.full((n, MAX_K), 0.6)
    coins = torch.rand(n, max(MAX_NEWS), generator=g)
    rig.replay.load(plain.outputs, accept, coins)
    assert rig.replay.allocation == "history"
    res = engine.run(rig.requests, FixedPolicy(MAX_K, engine.tiers), concurrency=3)
    assert res.outputs == plain.outputs
    # the sampled rule: draft j of a step at p is right while coins[p + j] < accept[j]
    length = max(MAX_NEWS)
    run = np.zeros((n, length), np.int64)
    for i in range(n):
        for p in range(length):
            while run[i, p] < MAX_K and coins[i, min(p + int(run[i, p]), length - 1)] < 0.6:
                run[i, p] += 1
    full = np.full(length, MAX_K)
    want = [e for i, m in enumerate(MAX_NEWS) for e in reference_loop(run[i], full, m, MAX_K)]
    assert sorted(res.itl_tokens) == sorted(want)


def test_bench_serves_a_trace_file_token_by_token(tmp_path):
    from spectune.cli import main
    from tests.engine.test_engine import write_policy

    trace = "spectune/data/traces/humaneval-suffix.jsonl.gz"
    out = tmp_path / "r.json"
    argv = ["bench", "--policy", str(write_policy(tmp_path / "p.yaml")), "--out", str(out), "--acceptance", trace,
            "--concurrency", "2", "--arms", "plain,fixed:3,auto", "--repeats", "2", "--prompts", "3",
            "--max-new-tokens", "12", "--prompt-len", "5", "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    data = __import__("json").loads(out.read_text())
    assert data["header"]["method"].startswith("replay drafter, token by token")
    assert data["header"]["acceptance"].startswith("token replay of humaneval-suffix.jsonl.gz")
    rows = {(r["arm"], r["repeat"]): r for r in data["rows"]}
    assert all(r["mismatches"] == 0 for r in rows.values())
    assert rows[("fixed:3", 0)]["mean_accept_len"] > 1.0


def test_a_steps_declined_drafts_read_with_that_steps_counts(rig, plain, engine):
    """At batch 1 the controller reads each step's counts as that request's (``Planner``'s two
    states): a step whose drafter offered nothing shows its declined first draft in its own
    counts, not in the next step's -- every observed step tested exactly one first draft."""
    policy = serve_traced(rig, plain, engine, {"t0": [(0, 0)] * 8}, [0, 0], 1)
    # one first draft per step (none where the request's last token leaves no room to draft)
    assert len(policy.seen) > 20 and all(tested[0] <= 1 and acc == [0] * MAX_K for acc, tested in policy.seen)
    assert sum(tested[0] for _, tested in policy.seen) > 0.8 * len(policy.seen)
    # each request's first drafting step is observed with its own declined draft: no step's
    # counts hold two (the next step's, as when they were added after this step's copy)
    assert all(tested[0] == 1 for _, tested in policy.seen[:3]), policy.seen[:3]
