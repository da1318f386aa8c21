"""benchmarks/heldout_ab.py end to end on CPU (tiny preset, short settings)."""

import json
import runpy
from pathlib import Path

from tests.engine.test_engine import write_policy

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "heldout_ab.py"


def test_heldout_script_writes_one_results_file_per_source(tmp_path, capsys):
    policy = write_policy(tmp_path / "p.yaml")
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "out"
    argv = ["--sources", "low,drift", "--out", str(out), "--policy", str(policy), "--concurrency", "1,2",
            "--repeats", "2", "--prompt-len", "5", "--max-new-tokens", "6", "--prompts", "3", "--device", "cpu",
            "--tag", "cpu"]
    assert main(argv) == 0
    low = json.loads((out / "bench_heldout_low_cpu.json").read_text())
    drift = json.loads((out / "bench_heldout_drift_cpu.json").read_text())
    assert low["header"]["acceptance"].startswith("curve:0.55,0.3025") and low["header"]["drift"] is False
    assert drift["header"]["acceptance"].startswith("drift: curve:0.9,") and drift["header"]["drift"] is True
    for res in (low, drift):
        assert res["header"]["tuned_acceptance"] == "curve:0.8,0.6,0.45" and res["header"]["complete"]
        assert res["header"]["requests"] == {"1": 3, "2": 3}
        assert {r["repeat"] for r in res["rows"]} == {0, 1}
        assert {r["concurrency"] for r in res["summary"]["ratios"]} == {1, 2}
        assert {r["concurrency"] for r in res["summary_full_load"]["ratios"]} == {1, 2}
        assert res["summary_full_load"]["metric"] == "full_tok_s"
        for r in res["rows"]:  # batch 1 is always full
            assert (r["full_share"] == 1.0) if r["concurrency"] == 1 else (0 < r["full_share"] <= 1)
            if r["concurrency"] == 2 and r["arm"] == "plain":  # 3 requests of one length: the third runs alone
                assert r["full_share"] < 1
    table = capsys.readouterr().out
    assert "auto/best" in table and table.count("drift") == 4  # per concurrency: full load, then the whole run
    assert table.count(" full ") == table.count(" run ") == 4
    assert (out / "heldout_summary_cpu.json").exists()


def short_run(tmp_path, sources, concurrency, prompts, *extra):
    """(main, argv, out folder) of a one-repeat CPU run of the script on a tiny policy."""
    policy = write_policy(tmp_path / "p.yaml")
    out = tmp_path / "out"
    argv = ["--sources", sources, "--out", str(out), "--policy", str(policy), "--concurrency", concurrency,
            "--repeats", "1", "--prompt-len", "5", "--max-new-tokens", "4", "--prompts", str(prompts),
            "--device", "cpu", "--tag", "cpu", *extra]
    return runpy.run_path(str(SCRIPT))["main"], argv, out


def test_a_source_can_run_at_its_own_concurrencies(tmp_path, capsys):
    # low named twice: one run of it at the union of its concurrencies (not a second run whose
    # file replaces the first's)
    main, argv, out = short_run(tmp_path, "low@2,high,low@1/2", "1", 2, "--time-limit", "60")
    assert main(argv) == 0
    low = json.loads((out / "bench_heldout_low_cpu.json").read_text())
    high = json.loads((out / "bench_heldout_high_cpu.json").read_text())
    assert {r["concurrency"] for r in low["rows"]} == {1, 2}
    assert {r["concurrency"] for r in high["rows"]} == {1}
    assert list(json.loads((out / "heldout_summary_cpu.json").read_text())) == ["low", "high"]
    table = capsys.readouterr().out
    assert table.count("low ") == 4 and table.count("high ") == 2  # (full load and the whole run per c)
    assert main([*argv[:1], "low@1/x", *argv[2:]]) == 2
    assert "concurrencies must be integers" in capsys.readouterr().err


def test_the_engine_switches_reach_the_bench(tmp_path):
    # --fused / --mixed-prefill: the served engine is the one a table was profiled with
    main, argv, out = short_run(tmp_path, "low", "2", 3, "--fused", "--mixed-prefill")
    assert main(argv) == 0
    res = json.loads((out / "bench_heldout_low_cpu.json").read_text())
    assert res["header"]["fused"] is True and res["header"]["mixed_prefill"] is True
    assert all(r["prefill_forwards"] == 0 and r["mixed_prefill_tokens"] == 3 * 5 for r in res["rows"])


def test_runs_that_captured_graphs_are_named(tmp_path, capsys, monkeypatch):
    # a capture inside a timed run stalls its step: the script names every such run (CPU runs
    # capture nothing, so the runs are the engine's as a GPU would report them)
    main, argv, out = short_run(tmp_path, "low,high", "2", 3)
    summary = {"arms": [], "ratios": []}

    def fake(config, jobs):
        return [{"rows": [{"arm": "auto", "concurrency": 2, "graph_captures_in_run": n},
                          {"arm": "fixed:2", "concurrency": 2, "graph_captures_in_run": 0}],
                 "summary": summary, "summary_full_load": summary,
                 "header": {"acceptance": "a", "tuned_acceptance": "t"}} for n in (0, 2)]

    from spectune.engine import bench

    monkeypatch.setattr(bench, "run_sources", fake)
    assert main(argv) == 0
    assert capsys.readouterr().err == "warning: 1 timed runs captured CUDA graphs inside the run: high: auto@2\n"
