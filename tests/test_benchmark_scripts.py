"""The scaling benchmarks' logic on CPU (their numbers come from the commands in docs/SCALING.md)."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_two_worker_profile_compare_runs_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    mod = load("profile_two_workers")
    assert mod.main(["--device", "cpu", "--target", "tiny", "--batch-sizes", "1,2", "--max-k", "1",
                     "--trials", "0"]) == 0
    res = json.loads((tmp_path / "profile_two_workers.json").read_text())["two_lock_on"]
    assert res["grid_and_held_out_equal"] and res["duplicates"] == [0, 0]
    assert res["common_points"] == res["points"][0] == res["points"][1]
    assert sum(res["workers_two"].values()) == res["points"][1]
    assert "grid + held-out point sets equal: True" in capsys.readouterr().out


def test_seed_experiment_runs_on_cpu(tmp_path, capsys):
    mod = load("seed_experiment_gpu")
    assert mod.main(["--out-dir", str(tmp_path), "--device", "cpu", "--target", "tiny", "--datasets", "humaneval",
                     "--concurrency", "2", "--prompts", "2", "--max-new-tokens", "6", "--prompt-len", "4",
                     "--repeats", "2"]) == 0
    res = json.loads((tmp_path / "seed_experiment_gpu.json").read_text())
    assert res["header"]["complete"] and not res["errors"]
    arms = {(r["arm"], r["repeat"]) for r in res["rows"] if r["dataset"] == "humaneval"}
    assert arms == {(a, r) for a in mod.ARMS for r in (0, 1)}
    assert all(r["completed"] == 2 and r["diverged_requests"] == 0 for r in res["rows"])
    summary = {(s["arm"], s["concurrency"]): s for s in res["summary"]}
    assert summary[("K5", 2)]["mean_accept_len_clean"][0] >= 1.0
    assert "token replay of humaneval-suffix.jsonl.gz" in res["header"]["traces"]["humaneval"]
    assert "### humaneval: decode goodput" in (tmp_path / "seed_experiment_gpu.md").read_text()
    assert "| 2 |" in capsys.readouterr().out


def test_seed_experiment_refuses_bad_options(tmp_path, capsys):
    mod = load("seed_experiment_gpu")
    assert mod.main(["--out-dir", str(tmp_path), "--datasets", "nope", "--device", "cpu"]) == 2
    assert "--datasets" in capsys.readouterr().err
    assert not (tmp_path / "seed_experiment_gpu.json").exists()


@pytest.mark.slow
def test_gpu_reliability_dry_run_on_cpu(tmp_path, capsys):
    """The oom and kill sections on CPU (the lock section is ``two_workers_vs_one``, run above)."""
    mod = load("gpu_reliability")
    rc = mod.main(["--device", "cpu", "--target", "tiny", "--sections", "oom,kill", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "gpu_reliability.json").read_text())
    assert rc == 0, {k: res[k].get("error") for k in ("oom", "kill")}
    oom = res["oom"]
    assert oom["infeasible"] > 0 and all(":b=8:" in k or ":b=16:" in k for k in oom["infeasible_keys"])
    assert oom["check"]["never_schedules_infeasible"] and oom["check"]["rows_end_at"] == oom["check"]["expected_cap"] < 8
    kill = res["kill"]
    assert [k["killed"] for k in kill["kills"]] == [True, True] and kill["points_settled_twice"] == {}
    assert kill["compare"]["point_sets_equal"] and kill["trial_states"].get("FAIL", 0) >= 2
    assert len(list(tmp_path.iterdir())) <= 8
    assert "never schedules them: True" in capsys.readouterr().out


@pytest.mark.slow
def test_two_gpu_script_dry_run_on_cpu(tmp_path):
    mod = load("profile_two_gpus")
    assert mod.main(["--device", "cpu", "--target", "tiny", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "profile_two_gpus.json").read_text())["one_vs_two"]
    assert res["dry_run"] and res["mode"] == "cpu" and res["compare"]["duplicates"] == [0, 0]
    assert res["compare"]["grid_and_held_out_equal"] and sum(w["points"] for w in res["workers"]) == res["compare"]["points"][1]


def test_targets_probe_quick_path_on_cpu(tmp_path, monkeypatch, capsys):
    mod = load("targets_probe")
    real_step = mod.target_step

    def flaky_step(model, *, batch, **kw):  # one bad point must not end its target
        if batch == 3:
            raise RuntimeError("injected failure\nsecond line")
        return real_step(model, batch=batch, **kw)

    monkeypatch.setattr(mod, "target_step", flaky_step)
    assert mod.main(["--device", "cpu", "--target", "tiny,tiny:fp8,no-such-model", "--batches", "1,3",
                     "--context-len", "16", "--copy-mib", "1", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "targets_probe.json").read_text())
    bw = res["bandwidth"]
    assert bw["read_gbps"] > 0 and bw["copy_gbps"] > 0 and bw["bytes"] == 2**20
    plain, fp8, bad = res["targets"]
    assert (plain["label"], fp8["label"]) == ("tiny:bf16", "tiny:fp8") and fp8["fp8"]
    assert "no-such-model" in bad["error"] and bad["points"] == []
    assert fp8["weight_read_bytes"] < plain["weight_read_bytes"]
    for t in (plain, fp8):
        ok, failed = t["points"]
        assert ok["batch"] == 1 and ok["ms"] > 0 and ok["mode"] == "wall-clock"
        assert ok["weight_floor_ms"] == pytest.approx(t["weight_read_bytes"] / (bw["read_gbps"] * 1e9) * 1e3)
        kv = 16 * t["kv_bytes_per_token"]
        assert ok["weight_kv_floor_ms"] == pytest.approx((t["weight_read_bytes"] + kv) / (bw["read_gbps"] * 1e9) * 1e3)
        assert failed["batch"] == 3 and failed["error"] == "RuntimeError: injected failure" and "ms" not in failed
    assert res["gemm"] == []  # CUDA only
    out = capsys.readouterr().out
    assert "tiny:fp8" in out and "injected failure" in out


@pytest.mark.slow
def test_fused_step_dry_run_on_cpu(tmp_path, capsys):
    # every arm on the tiny preset: unfused, fused (Triton's interpreter), the yardstick (eager)
    mod = load("fused_step")
    assert mod.main(["--device", "cpu", "--preset", "tiny", "--batches", "2", "--context-len", "8",
                     "--compile-backend", "eager", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fused_step.json").read_text())
    assert res["check"]["argmax_agree"] == 1.0
    assert res["check"]["max_abs_diff"] < 0.05 * res["check"]["ref_abs_max"]
    assert {(p["arm"], p["batch"]) for p in res["points"]} == {(a, 2) for a in ("unfused", "fused", "compiled")}
    assert all(p["ms"] > 0 and "error" not in p for p in res["points"])
    assert "fused/compiled" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--batches"):
        mod.main(["--device", "cpu", "--batches", "0", "--out-dir", str(tmp_path)])
