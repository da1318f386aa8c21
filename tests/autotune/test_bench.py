"""``spectune bench`` on CPU (tiny preset, eager): results the report reads, exact outputs."""

from __future__ import annotations

import json

import pytest

from spectune.autotune.bench import bench_tiers, mismatches, parse_arms, weighted_quantile
from spectune.autotune.report import load_inputs
from spectune.cli import main
from tests.runtime.test_engine import write_policy

ARGS = ["--concurrency", "1,2", "--arms", "plain,fixed:2,auto", "--prompts", "3", "--max-new-tokens", "8",
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
    assert rs.get(1, "plain").k_counts.keys() == {0} and rs.get(1, "plain").mean_accept_len is None
    assert rs.get(2, "fixed:2").k_counts.keys() == {2}
    assert rs.get(2, "auto").k_counts.keys() <= {2, 3}
    assert rs.get(1, "fixed:2").mean_accept_len > 1.0


def test_bench_header_and_extra_fields(results):
    data = json.loads(results.read_text())
    head = data["header"]
    for key in ("gpu", "driver", "policy", "date", "target", "drafter", "spectune", "torch", "triton", "method"):
        assert key in head
    assert head["gpu"] == "cpu" and head["target"] == "tiny" and head["drafter"] == "eagle-1l"
    plain = next(r for r in data["rows"] if r["arm"] == "plain" and r["concurrency"] == 2)
    assert plain["drafter_calls"] == 0 and plain["tokens"] == 3 * 8 and not plain["timed_out"]


@pytest.mark.parametrize("argv, needle", [
    (["--arms", "plain,greedy"], "--arms"),
    (["--concurrency", "0,2"], "--concurrency"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--target", "nonsense"], "nonsense"),
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
