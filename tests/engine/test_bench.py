"""``spectune bench`` on CPU (tiny preset, eager): results the report reads, exact outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from spectune.autotune.report import load_inputs
from spectune.cli import main
from spectune.engine import bench
from spectune.engine.bench import bench_tiers, exact_float32, parse_arms, weighted_quantile
from spectune.engine.bench_accounting import (
    NEAR_TIE,
    NearTie,
    accept_scale_for,
    classify_mismatches,
    mismatches,
)
from tests.engine.test_engine import write_policy

ARGS = ["--concurrency", "1,2", "--arms", "plain,fixed:2,auto", "--repeats", "1", "--prompts", "3", "--max-new-tokens", "8",
        "--prompt-len", "9", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    policy = write_policy(d / "policy.yaml")
    out = d / "results.json"
    assert main(["bench", "--policy", str(policy), "--out", str(out), *ARGS]) == 0
    return out


def test_bench_writes_results_the_report_reads(results):
    inputs = load_inputs([results])
    (rs,) = inputs.results
    assert rs.kind == "bench"
    assert rs.concurrencies == [1, 2] and rs.arms == ["plain", "fixed:2", "auto"]
    for row in rs.rows:
        assert row.failed == 0 and row.completed == 3
        assert row.mismatches == 0
        assert row.output_tok_s > 0 and row.predicted_tok_s is not None and row.predicted_tok_s > 0
        assert row.itl_p50_ms is not None and row.itl_p50_ms <= row.itl_p99_ms
        assert row.joules_per_token is None  # no NVML on CPU
        assert row.hard_mismatches == 0 and row.near_tie_mismatches == 0 and row.diverged_requests == 0
        assert row.decode_tok_s is not None and row.decode_tok_s > 0
        assert row.prediction_error is not None and math.isfinite(row.prediction_error)
        assert row.predicted_tok_s_at_measured_accept is not None and row.predicted_tok_s_at_measured_accept > 0
        # fp32 and no divergence: every step is clean
        assert row.mean_accept_len_clean == row.mean_accept_len
    assert rs.get(1, "plain").k_counts.keys() == {0} and rs.get(1, "plain").mean_accept_len is None
    assert rs.get(2, "fixed:2").k_counts.keys() == {2}
    auto = rs.get(2, "auto").k_counts  # the online correction may move K (min_evidence 1 in this table)
    assert auto.keys() <= {0, 1, 2, 3} and max(auto) > 0
    assert rs.get(1, "fixed:2").mean_accept_len > 1.0


def test_bench_header_and_extra_fields(results):
    data = json.loads(results.read_text())
    head = data["header"]
    for key in ("gpu", "driver", "policy", "date", "target", "drafter", "spectune", "torch", "triton", "method"):
        assert key in head
    assert head["gpu"] == "cpu" and head["target"] == "tiny" and head["drafter"] == "eagle-1l"
    assert head["dtype"] == "float32" and head["tf32"] is None and "0.0001" in head["near_tie_tolerance"]
    assert head["complete"] is True
    plain = next(r for r in data["rows"] if r["arm"] == "plain" and r["concurrency"] == 2)
    assert plain["drafter_calls"] == 0 and plain["tokens"] == 3 * 8 and not plain["timed_out"]
    assert plain["decode_tokens"] == 3 * 7 and 0 < plain["decode_seconds"] <= plain["seconds"]
    e2e = data["summary_end_to_end"]
    assert e2e["metric"] == "output_tok_s" and {r["concurrency"] for r in e2e["ratios"]} == {1, 2}
    for arm in e2e["arms"]:
        runs = [r["output_tok_s"] for r in data["rows"] if (r["concurrency"], r["arm"]) == (arm["concurrency"], arm["arm"])]
        assert arm["output_tok_s"] == pytest.approx(sum(runs) / len(runs))
    for row in data["rows"]:
        assert row["predicted_tok_s_at_measured_steps"] > 0
        assert row["prediction_error"] == pytest.approx(row["decode_tok_s"] / row["predicted_tok_s"] - 1)
        # end to end: the separate prefill forwards' time on top of the decode steps'
        assert 0 < row["predicted_output_tok_s"] < row["predicted_tok_s"] * 8 / 7
        assert row["output_prediction_error"] == pytest.approx(row["output_tok_s"] / row["predicted_output_tok_s"] - 1)
        # K over time, run-length coded: the same steps as k_hist, no two neighbours equal
        runs = row["k_runs"]
        assert sum(n for _, n in runs) == row["steps"] and all(a[0] != b[0] for a, b in zip(runs, runs[1:], strict=False))
        hist = {}
        for k, n in runs:
            hist[str(k)] = hist.get(str(k), 0) + n
        assert hist == row["k_hist"]
        # the steps whose device time reached the policy: the auto arm's (all but the last few,
        # still in flight when the run ended); a fixed arm has no observe_time
        if row["arm"] == "auto":
            assert row["steps"] - 2 <= row["timed_steps"] < row["steps"] and row["observed_steps"] > 0
        else:
            assert row["timed_steps"] == 0
    auto = next(r for r in data["rows"] if r["arm"] == "auto" and r["concurrency"] == 2)
    view = auto["controller"]
    assert len(view["choice"]) == 3 and len(view["rates"]) == 3 and all(0 <= a <= 1 for a in view["rates"])
    assert view["time_ratios"] and all(n >= 1 and x > 0 for n, x in view["time_ratios"].values())
    assert "controller" not in plain


def test_k_runs_codes_the_steps_in_order():
    from spectune.engine.bench_accounting import k_runs

    assert k_runs([(4, 2, 8), (4, 2, 8), (4, 0, 4), (3, 2, 6), (3, 2, 6), (3, 2, 6)]) == [[2, 2], [0, 1], [2, 3]]
    assert k_runs([]) == []


@pytest.mark.parametrize("argv, needle", [
    (["--arms", "plain,greedy"], "--arms"),
    (["--concurrency", "0,2"], "--concurrency"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--target", "nonsense"], "nonsense"),
    (["--prefill-budget", "64"], "--prefill-budget"),  # without --mixed-prefill
    (["--mixed-prefill", "--prefill-budget", "0"], "--prefill-budget"),
    (["--ride-limit", "64"], "--ride-limit"),  # without --mixed-prefill
    (["--mixed-prefill", "--ride-limit", "0"], "--ride-limit"),
    (["--ride-pieces", "4"], "--ride-pieces"),  # without --mixed-prefill
    (["--admit-ahead"], "--admit-ahead"),  # without --mixed-prefill
    (["--no-admit-ahead"], "--no-admit-ahead"),  # without --mixed-prefill
    (["--mixed-prefill", "--ride-pieces", "0"], "--ride-pieces"),
])
def test_bad_options_are_one_line(tmp_path, capsys, argv, needle):
    policy = write_policy(tmp_path / "policy.yaml")
    out = tmp_path / "r.json"
    assert main(["bench", "--policy", str(policy), "--out", str(out), *ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err
    assert not out.exists()


def test_mismatches_count_requests_and_first_index():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert mismatches(ref, ref) == (0, None)
    assert mismatches([[1, 2, 3], [4, 0, 6], [7, 8, 0]], ref) == (2, 1)


def test_weighted_quantile_counts_each_token():
    # a step of 10 ms that emitted 4 tokens gives four 2.5 ms latencies
    assert weighted_quantile([2.5, 9.0], [4, 1], 0.5) == 2.5
    assert weighted_quantile([2.5, 9.0], [4, 1], 0.99) == 9.0
    assert weighted_quantile([], [], 0.5) is None


def test_bench_tiers_hold_every_full_batch_step():
    tiers = bench_tiers([64, 128], [1, 8], [0, 3])
    assert {1, 8, 4, 32, 64, 128} <= set(tiers) and tiers == sorted(tiers)
    assert parse_arms("plain, fixed:3,plain") == ("plain", "fixed:3")


def _plain(outputs, margins, top1):
    from spectune.engine.engine import RunResult

    n = len(outputs)
    return RunResult(outputs=outputs, done=[True] * n, ttft_ms=[0.0] * n, itl_ms=[], itl_tokens=[], k_hist={},
                     tier_hist={}, steps=0, seconds=1.0, tokens=0, idle_rows=0, waits=0, drafter_calls=0,
                     observed=0, captures=0, timed_out=False, margins=margins, top1=top1)


def test_mismatches_at_near_ties_are_told_from_hard_ones():
    nan = float("nan")
    plain = _plain([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]],
                   margins=[[2.0, 0.01, 2.0], [2.0, 0.9, 2.0], [2.0, nan, 2.0], [0.0, 0.0, 0.0]],
                   top1=[[9.0, 9.0, 9.0], [40.0, 40.0, 40.0], [9.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    spec = [[1, 0, 3],  # index 1, margin 0.01: a near tie in bf16, not in fp32
            [4, 0, 6],  # index 1, margin 0.9 > 40 x 2^-6 = 0.625: hard
            [7, 0, 9],  # index 1, no margin recorded (a verification step chose it): hard
            [1, 1, 1]]  # equal
    bf16 = classify_mismatches(spec, plain, NEAR_TIE["bfloat16"])
    assert (bf16.total, bf16.near_tie, bf16.hard, bf16.first) == (3, 1, 2, 1)
    fp32 = classify_mismatches(spec, plain, NEAR_TIE["float32"])
    assert (fp32.total, fp32.near_tie, fp32.hard) == (3, 0, 3)
    loose = classify_mismatches(spec, plain, NearTie(0.05, 2.0**-5))  # 40 / 32 = 1.25 > 0.9
    assert (loose.near_tie, loose.hard) == (2, 1)
    assert classify_mismatches(plain.outputs, plain, NEAR_TIE["bfloat16"]).total == 0


def test_near_tie_tolerance_is_absolute_or_relative():
    tol = NEAR_TIE["bfloat16"]
    assert tol.holds(0.05, 1.0) and not tol.holds(0.06, 1.0)  # the floor
    assert tol.holds(0.15, 9.6) and not tol.holds(0.16, 9.6)  # 9.6 / 64 = 0.15
    assert tol.holds(0.0, -3.0) and not tol.holds(float("nan"), 1.0)


def short_bench(tmp_path, arms):
    """(policy, results) of a one-repeat CPU bench at concurrency 2 of these arms (2 requests)."""
    policy = write_policy(tmp_path / "policy.yaml")
    out = tmp_path / "r.json"
    args = ["--concurrency", "2", "--arms", arms, "--repeats", "1", "--prompts", "2", "--max-new-tokens", "6",
            "--prompt-len", "5", "--device", "cpu", "--no-progress"]
    assert main(["bench", "--policy", str(policy), "--out", str(out), *args]) == 0
    return policy, out


def test_bench_classifies_a_forced_near_tie(tmp_path, monkeypatch):
    # a fixed arm whose verification picks the second-best token at output index 3 of request 0:
    # the plain margin there is real; with a tolerance above it the divergence is a near tie
    real = bench.row_for
    seen = {}

    def flipped(arm, concurrency, res, reading, plain, predicted, tolerance):
        if arm != "plain":
            res.outputs[0][3] = (res.outputs[0][3] + 1) % 512
            seen["margin"] = plain.margins[0][3]
            tolerance = NearTie(plain.margins[0][3], 0.0) if arm == "fixed:2" else NearTie(0.0, 0.0)
        return real(arm, concurrency, res, reading, plain, predicted, tolerance)

    monkeypatch.setattr(bench, "row_for", flipped)
    _, out = short_bench(tmp_path, "plain,fixed:2,auto")
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert seen["margin"] > 0
    assert (rows["fixed:2"]["near_tie_mismatches"], rows["fixed:2"]["hard_mismatches"]) == (1, 0)
    assert (rows["auto"]["near_tie_mismatches"], rows["auto"]["hard_mismatches"]) == (0, 1)
    assert rows["plain"]["mismatches"] == 0


@pytest.mark.parametrize("hard, ties, needle", [(1, 2, "clear plain margin"), (0, 2, "near ties")])
def test_cli_warning_tells_hard_mismatches_from_near_ties(tmp_path, capsys, monkeypatch, hard, ties, needle):
    row = {"concurrency": 1, "arm": "fixed:3", "output_tok_s": 1.0, "decode_tok_s": 2.0, "predicted_tok_s": 2.0,
           "predicted_tok_s_at_measured_accept": 2.0, "itl_p50_ms": 1.0, "itl_p99_ms": 1.0,
           "mean_accept_len": 2.0, "mean_accept_len_clean": 2.5, "joules_per_token": None, "completed": 4,
           "failed": 0, "mismatches": hard + ties, "hard_mismatches": hard, "near_tie_mismatches": ties}
    head = {"gpu": "g", "target": "t", "drafter": "d", "prompt_len": 8, "max_new_tokens": 8, "acceptance": "a",
            "dtype": "bfloat16", "near_tie_tolerance": str(NEAR_TIE["bfloat16"])}
    def fake(config, on_row=None):
        on_row(row)
        return {"header": head, "rows": [row]}

    monkeypatch.setattr(bench, "run_bench", fake)
    policy = write_policy(tmp_path / "policy.yaml")
    assert main(["bench", "--policy", str(policy), "--out", str(tmp_path / "r.json"), "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and needle in err and f"{ties}" in err
    assert "fixed:3" in out


def test_cli_prints_auto_over_plain_once_where_plain_is_the_best_other(tmp_path, capsys, monkeypatch):
    # "auto / plain = 0.939 [...], auto / plain = 0.939 [...]" read as two findings
    row = {"concurrency": 1, "arm": "plain", "output_tok_s": 1.0, "decode_tok_s": 2.0, "predicted_tok_s": None,
           "predicted_tok_s_at_measured_accept": None, "itl_p50_ms": None, "itl_p99_ms": None,
           "mean_accept_len": None, "mean_accept_len_clean": None, "joules_per_token": None, "completed": 4,
           "failed": 0, "mismatches": 0, "hard_mismatches": 0, "near_tie_mismatches": 0}
    head = {"gpu": "g", "target": "t", "drafter": "d", "prompt_len": 8, "max_new_tokens": 8, "acceptance": "a",
            "dtype": "float32", "near_tie_tolerance": str(NEAR_TIE["float32"])}
    ratios = [{"concurrency": 1, "best_other": "plain", "vs_best_other": 0.939, "vs_best_other_ci95": [0.9, 0.97],
               "vs_plain": 0.939, "vs_plain_ci95": [0.9, 0.97]},
              {"concurrency": 8, "best_other": "fixed:3", "vs_best_other": 0.98, "vs_best_other_ci95": [0.96, 1.0],
               "vs_plain": 1.5, "vs_plain_ci95": [1.4, 1.6]}]
    summary = {"arms": [], "ratios": ratios}
    monkeypatch.setattr(bench, "run_bench", lambda config, on_row=None: {
        "header": head, "rows": [row], "summary": summary, "summary_full_load": summary})
    policy = write_policy(tmp_path / "policy.yaml")
    assert main(["bench", "--policy", str(policy), "--out", str(tmp_path / "r.json"), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "c=1: auto / plain = 0.939 [0.900, 0.970]" in lines
    assert "c=8: auto / fixed:3 = 0.980 [0.960, 1.000], auto / plain = 1.500 [1.400, 1.600]" in lines
    full = [line for line in lines if "at full load" in line]
    assert len(full) == 2 and full[0].endswith("): auto / plain = 0.939 [0.900, 0.970]")
    assert full[1].endswith("auto / plain = 1.500 [1.400, 1.600]")


def test_accept_scale_for_finds_the_measured_length():
    def length(s):  # 1 + s + s^2 for s <= 1, flat after: K = 2 at conditional rate s
        s = min(s, 1.0)
        return 1 + s + s * s

    assert accept_scale_for(length, 1.75, 2.0) == pytest.approx(0.5, abs=2e-3)
    assert accept_scale_for(length, 3.5, 2.0) == 2.0  # beyond the longest: the top of the range


def test_exact_float32_turns_tf32_off_only_on_cuda():
    before = torch.backends.cuda.matmul.allow_tf32
    with exact_float32(torch.device("cpu"), "float32") as tf32:
        assert tf32 is None
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.gpu
def test_float32_gate_on_cuda(tmp_path):
    policy = write_policy(tmp_path / "policy.yaml")
    out = tmp_path / "r.json"
    torch.backends.cuda.matmul.allow_tf32 = True
    args = ["--concurrency", "1,2", "--arms", "plain,fixed:2,auto", "--prompts", "3", "--max-new-tokens", "8",
            "--prompt-len", "9", "--device", "cuda", "--dtype", "float32", "--target", "tiny", "--no-progress"]
    assert main(["bench", "--policy", str(policy), "--out", str(out), *args]) == 0
    assert torch.backends.cuda.matmul.allow_tf32  # restored
    data = json.loads(out.read_text())
    assert data["header"]["tf32"] is False
    assert all(r["hard_mismatches"] == 0 and r["decode_tok_s"] > 0 for r in data["rows"])


def test_prefill_ms_follows_the_engines_schedule_and_buckets():
    from spectune.runtime.costs import CostModel
    from spectune.runtime.prefill_plan import prefill_ms
    from spectune.runtime.table import CostModelParams, DrafterCost, OverheadCost, TargetCost

    cost = CostModel(CostModelParams(TargetCost(5.0, 0.01, 100.0, 0.02, 30.0), DrafterCost(0.0, 0.0, 0.0),
                                     OverheadCost(0.5, 0.01)), "autoregressive", 2048)
    ms = prefill_ms(cost, 600, 512, 4096)
    # one 600-token prompt: a 512-token piece, then the last 88 tokens (bucket 128) after them
    assert ms(1) == pytest.approx(cost.target_ms(512, 1, 256) + cost.target_ms(128, 1, 512 + 44))
    # eight: pieces of 512 (4096 a forward: 8 pieces), then eight 88-token tails in one forward (704 -> 768)
    assert ms(8) == pytest.approx(cost.target_ms(4096, 8, 256) + cost.target_ms(768, 8, 512 + 44))
    assert ms(8) < 8 * ms(1)  # one weight read serves a whole admission


def test_bench_table_shows_end_to_end_beside_its_prediction(tmp_path, capsys):
    policy = write_policy(tmp_path / "policy.yaml")
    out = tmp_path / "r.json"
    assert main(["bench", "--policy", str(policy), "--out", str(out), "--concurrency", "1", "--arms", "plain",
                 "--repeats", "1", "--prompts", "2", "--max-new-tokens", "4", "--prompt-len", "5", "--device", "cpu",
                 "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:5] == ["conc", "arm", "rep", "e2e", "pred"])
    row = json.loads(out.read_text())["rows"][0]
    cells = lines[head + 1].split()
    assert float(cells[3]) == pytest.approx(row["output_tok_s"], abs=0.06)
    assert float(cells[4]) == pytest.approx(row["predicted_output_tok_s"], abs=0.06)


def test_a_gpu_table_benched_on_cpu_says_what_ran(tmp_path, capsys):
    from pathlib import Path

    policy = Path(__file__).parents[2] / "spectune" / "profiles" / "nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml"
    out = tmp_path / "r.json"
    assert main(["bench", "--policy", str(policy), "--out", str(out), "--concurrency", "1", "--arms", "plain",
                 "--repeats", "1", "--prompts", "1", "--max-new-tokens", "2", "--prompt-len", "4", "--device", "cpu",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "note: on CPU the bench serves the `tiny` target in float32, not qwen3-8b" in err
    assert "NVIDIA H200 figures" in err
    assert json.loads(out.read_text())["header"]["target"] == "tiny"


def test_auto_prepares_every_drafter_shape_its_controller_may_plan(tmp_path, monkeypatch):
    # the auto arm's warm-up captures the drafter shapes of every K the controller may move to
    # (``Planner.draft_shapes``), not only the table's: one captured when first planned stalls a
    # timed step; a fixed arm prepares its own K only
    from spectune.engine.engine import Engine

    calls = []
    real = Engine.prepare

    def recorded(self, ks, concurrency, draft_shapes=None):
        calls.append((list(ks), concurrency, dict(draft_shapes or {})))
        return real(self, ks, concurrency, draft_shapes)

    monkeypatch.setattr(Engine, "prepare", recorded)
    policy, _ = short_bench(tmp_path, "fixed:2,auto")
    plain, fixed, auto = calls  # (plain: the reference outputs, run first)
    assert plain == ([0], 2, {}) and fixed == ([2], 2, {})
    from spectune.runtime.planner import load
    shapes = load(str(policy), on_gpu_mismatch="ignore").draft_shapes(2)
    assert auto[2] == shapes and set(range(1, max(shapes) + 1)) <= shapes.keys()


@pytest.mark.parametrize("captures", [0, 3])
def test_cli_warns_where_a_timed_run_captured_graphs(tmp_path, capsys, monkeypatch, captures):
    row = {"concurrency": 16, "arm": "auto", "output_tok_s": 1.0, "decode_tok_s": 2.0, "predicted_tok_s": 2.0,
           "predicted_tok_s_at_measured_accept": 2.0, "itl_p50_ms": 1.0, "itl_p99_ms": 1.0,
           "mean_accept_len": 2.0, "mean_accept_len_clean": 2.0, "joules_per_token": None, "completed": 4,
           "failed": 0, "mismatches": 0, "hard_mismatches": 0, "near_tie_mismatches": 0,
           "graph_captures_in_run": captures}
    head = {"gpu": "g", "target": "t", "drafter": "d", "prompt_len": 8, "max_new_tokens": 8, "acceptance": "a",
            "dtype": "bfloat16", "near_tie_tolerance": str(NEAR_TIE["bfloat16"])}

    def fake(config, on_row=None):
        on_row(row)
        return {"header": head, "rows": [row, dict(row, arm="fixed:2", graph_captures_in_run=0)]}

    monkeypatch.setattr(bench, "run_bench", fake)
    policy = write_policy(tmp_path / "policy.yaml")
    assert main(["bench", "--policy", str(policy), "--out", str(tmp_path / "r.json"), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert ("warning: 1 timed runs captured CUDA graphs inside the run (auto@16)" in err) == bool(captures)
    assert "fixed:2@" not in err
