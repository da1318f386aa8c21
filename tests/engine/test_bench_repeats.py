"""The bench's A/B method: default arms from the simulator, repeats, intervals, drift, history confidences."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spectune.autotune.acceptance import load_acceptance
from spectune.cli import main
from spectune.engine.bench import Served, draws, rotated
from spectune.engine.bench_accounting import mean_interval, summarise
from spectune.engine.replay_drafter import DraftInput, ReplayDrafter
from spectune.runtime.request_history import request_confidences
from tests.engine.test_engine import write_policy

HIGH, LOW = "curve:0.9,0.81,0.729", "curve:0.3,0.09,0.027"


def test_bench_at_concurrency_3_and_4_with_cpu_defaults(tmp_path):
    # prompt 16 + 16 new tokens (the CPU defaults): warming the prefill of 3-4 prompts used to run
    # one prompt of the whole bucket and overran a request's block table
    policy, out = write_policy(tmp_path / "p.yaml"), tmp_path / "r.json"
    assert main(["bench", "--policy", str(policy), "--out", str(out), "--device", "cpu", "--no-progress",
                 "--concurrency", "3,4", "--arms", "plain,auto", "--repeats", "1", "--prompts", "4"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["concurrency"], r["arm"]) for r in rows} == {(3, "plain"), (4, "plain"), (3, "auto"), (4, "auto")}
    assert all(r["completed"] == 4 and r["hard_mismatches"] == 0 for r in rows)


def test_default_arms_repeats_drift_and_summary(tmp_path, capsys):
    policy, out = write_policy(tmp_path / "p.yaml"), tmp_path / "r.json"
    assert main(["bench", "--policy", str(policy), "--out", str(out), "--device", "cpu", "--no-progress",
                 "--concurrency", "2", "--repeats", "2", "--prompts", "4", "--max-new-tokens", "6",
                 "--prompt-len", "5", "--drift", f"{HIGH},{LOW}"]) == 0
    data = json.loads(out.read_text())
    head = data["header"]
    assert head["acceptance"].startswith(f"drift: {HIGH} -> {LOW}") and head["drift"] is True
    assert head["tuned_acceptance"] == "curve:0.8,0.6,0.45" and head["repeats"] == 2
    assert head["requests"] == {"2": 4}  # each run's requests, per concurrency
    arms = head["arms"]["2"]
    assert arms[0] == "plain" and arms[-1] == "auto" and 2 <= len(arms) - 2 <= 3  # best K and neighbours
    runs = [(r["repeat"], r["arm"]) for r in data["rows"]]
    assert [a for rep, a in runs if rep == 0] == list(arms)
    assert [a for rep, a in runs if rep == 1] == list(arms[1:]) + ["plain"]  # rotated: auto not last
    assert all(r["hard_mismatches"] == 0 for r in data["rows"])
    summary = data["summary"]
    assert {a["arm"] for a in summary["arms"]} == set(arms) and all(a["repeats"] == 2 for a in summary["arms"])
    (ratio,) = summary["ratios"]
    lo, hi = ratio["vs_best_other_ci95"]
    assert lo <= ratio["vs_best_other"] <= hi
    printed = capsys.readouterr().out
    assert "auto / " in printed and "95% interval" in printed


def test_drift_draws_switch_at_half_the_requests():
    high, low = load_acceptance(HIGH, max_k=3), load_acceptance(LOW, max_k=3)
    served = Served(high, low, "d", {}, "x")
    accept, coins = draws(served, 6, 3, 4, seed=0, repeat=0)
    assert torch.allclose(accept[:3], torch.tensor(0.9))
    assert torch.allclose(accept[3:], torch.tensor(0.3))
    assert coins.shape == (6, 4)
    other, _ = draws(Served(high, None, "h", {}, "x"), 6, 3, 4, seed=0, repeat=1)
    assert torch.allclose(other, torch.tensor(0.9))
    assert not torch.equal(coins, draws(served, 6, 3, 4, seed=0, repeat=1)[1])  # a repeat draws anew


def test_rotated_order():
    arms = ("plain", "fixed:2", "fixed:3", "auto")
    assert rotated(arms, 0) == list(arms)
    assert rotated(arms, 1) == ["fixed:2", "fixed:3", "auto", "plain"]
    assert rotated(arms, 3)[-1] == "fixed:3"


def test_mean_interval_and_summary_by_hand():
    mean, lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert (mean, hi - mean) == pytest.approx((2.0, 4.302653 / np.sqrt(3)))  # t(0.975, 2) = 4.3027
    assert mean_interval([5.0]) == (5.0, 5.0, 5.0) and mean_interval([]) is None
    rows = [{"concurrency": 1, "arm": a, "repeat": r, "decode_tok_s": v, "timed_out": a == "fixed:1" and r == 1}
            for a, vs in (("plain", [10.0, 10.0]), ("fixed:1", [12.0, 14.0]), ("auto", [12.0, 12.6]))
            for r, v in enumerate(vs)]
    s = summarise(rows)
    by = {a["arm"]: a for a in s["arms"]}
    assert by["fixed:1"]["decode_tok_s"] == 13.0 and by["fixed:1"]["timed_out"] == 1
    (ratio,) = s["ratios"]
    assert ratio["best_other"] == "fixed:1"
    assert ratio["vs_best_other"] == pytest.approx((12 / 12 + 12.6 / 14) / 2)  # paired per repeat
    assert ratio["vs_plain"] == pytest.approx(1.23)


def test_replay_confidences_are_request_history_never_the_sampled_rates():
    rd = ReplayDrafter(max_requests=3, max_len=8, max_k=2, vocab_size=50, device="cpu", prior=[0.8, 0.5])
    accept = torch.tensor([[0.99, 0.99], [0.01, 0.01], [0.5, 0.5]])
    rd.load([[1, 2, 3, 4, 5, 6, 7, 8]] * 3, accept, torch.full((3, 8), 0.4))
    inp = DraftInput(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
                     torch.zeros(3, dtype=torch.int32), torch.arange(3))
    _, conf = rd.propose(inp, 2)
    assert torch.allclose(conf, torch.tensor([[0.8, 0.5]] * 3))  # no history yet: the prior for all
    # request 0 accepted both granted drafts, request 1 none of 2, request 2 got no grant
    rd.record_step(torch.arange(3), torch.tensor([2, 2, 0]), torch.tensor([2, 0, 0]))
    assert rd.hist_acc.tolist() == [2.0, 0.0, 0.0]
    assert rd.hist_exp.tolist() == pytest.approx([1.3, 0.8, 0.0])  # 0.8 + 0.5; the first, rejected
    _, conf = rd.propose(inp, 2)
    want = request_confidences(torch.tensor([0.8, 0.5]), torch.tensor([2.0, 0.0, 0.0]), torch.tensor([1.3, 0.8, 0.0]))
    assert torch.allclose(conf, want)
    rd.set_rates([0.6, 0.3])
    assert rd.rates_cum.tolist() == pytest.approx([0.0, 0.6, 0.9])
    rd.reset_history()
    assert rd.hist_acc.sum() == 0 and rd.rates.tolist() == pytest.approx([0.8, 0.5])


def test_timed_runs_collect_no_garbage():
    import gc

    from spectune.engine.bench import quiet_gc

    assert gc.isenabled()
    with quiet_gc():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), quiet_gc():
        raise RuntimeError("a run that fails")
    assert gc.isenabled() and gc.get_freeze_count() == 0
