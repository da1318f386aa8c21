"""The scaling benchmarks' logic on CPU (their numbers come from the commands in docs/SCALING.md)."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

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
                     "--trials", "0", "--noise-run"]) == 0
    both = json.loads((tmp_path / "profile_two_workers.json").read_text())
    again, res = both["one_again"], both["two_lock_on"]
    assert again["point_sets_equal"] and again["workers_two"] and -1 < again["point_rel_diff_signed_median"] < 1
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


# ---------------------------------------------------------------------------------------------
# targets_tables: profile -> tune -> validate/export -> held-out bench, per target

TINY = ["--device", "cpu", "--target", "tiny", "--batch-sizes", "1,2", "--max-k", "2", "--context-len", "32",
        "--trials", "0", "--bench-context", "24", "--concurrency", "1,2", "--repeats", "1", "--prompts", "2",
        "--prompt-len", "8", "--max-new-tokens", "6"]


def _tar_names(path):
    import tarfile

    with tarfile.open(path) as t:
        return {m.name for m in t.getmembers()}


@pytest.mark.slow
def test_targets_tables_all_stages_resume_on_cpu(tmp_path, capsys):
    """A profile call, then all stages with --resume-from it: the study resumes from the journal
    in the first call's tarball (every point kept, none measured again), tune validates and
    exports, the bench serves the held-out traces."""
    mod = load("targets_tables")
    first, second = tmp_path / "one", tmp_path / "two"
    assert mod.main([*TINY, "--dtype", "float32", "--stage", "profile", "--out-dir", str(first)]) == 0
    stem = "cpu_tiny_eagle-1l.float32"
    assert sorted(p.name for p in first.iterdir()) == sorted(
        [f"{stem}.yaml", f"{stem}.study.tar.gz", "targets_tables_tiny-float32_profile.json"])
    assert {f"{stem}.yaml.journal", f"{stem}.csv", "logs/profile.log"} <= _tar_names(first / f"{stem}.study.tar.gz")
    one = json.loads((first / "targets_tables_tiny-float32_profile.json").read_text())["stages"]["profile"]
    assert one["rc"] == 0 and one["points"] > 0 and "kept" not in one

    rc = mod.main([*TINY, "--dtype", "float32", "--stage", "all", "--resume-from", str(first),
                   "--out-dir", str(second)])
    files = sorted(p.name for p in second.iterdir())
    assert len(files) == 6 and not [f for f in files if f.startswith(".")]
    res = json.loads((second / "targets_tables_tiny-float32_profile-tune-bench.json").read_text())
    prof, tune, bench = (res["stages"][s] for s in ("profile", "tune", "bench"))
    assert prof["rc"] == 0 and prof["kept"] == one["points"] and prof["measured_now"] == 0
    assert prof["journal_restored_from"].endswith(f"{stem}.study.tar.gz:{stem}.yaml.journal")
    assert set(prof["step_ms"]) == {"1", "32", "128"} and prof["held_out"]["points"] > 0
    assert res["facts"]["weight_floor_ms"] > 0 and res["facts"]["bandwidth"]["read_gbps"] > 0
    policies = tune["policies"]
    assert set(policies) == {f"{stem}.policy.yaml", f"{stem}.ctx24.policy.yaml"} <= set(files)
    exported = _tar_names(second / f"{stem}.study.tar.gz")
    every_export_ok = True
    for name, p in policies.items():
        assert p["rc"] == 0 and p["validate"]["rc"] == 0 and json.loads(p["validate"]["stdout"])["valid"]
        assert [e["command"].split()[4] for e in p["exports"]] == ["vllm", "sglang", "trtllm"]
        for e in p["exports"]:
            out = "exports/" + Path(e["command"].split("--out ")[1]).name
            # CPU timings are noise: a policy the engines cannot express is refused in one line, named
            assert (e["rc"] == 0) == (out in exported), e
            assert e["rc"] == 0 or (e["rc"] == 2 and len(e["stderr"]) == 1 and name in e["stderr"][0])
            every_export_ok &= e["rc"] == 0
    assert rc == (0 if every_export_ok else 1)
    assert bench["rc"] == 0 and bench["complete"] and bench["hard_mismatches"] == 0
    assert bench["policy"] == f"{stem}.ctx24.policy.yaml" and "humaneval-ngram" in bench["served_acceptance"]
    assert [r["concurrency"] for r in bench["full_load"]] == [1, 2]
    assert bench["rows"] == sum(len(a) for a in bench["arms"].values())  # one repeat of every arm
    rows = json.loads((second / "bench_heldout_humaneval_tiny-float32_c1-2.json").read_text())
    assert rows["header"]["tuned_acceptance"] != rows["header"]["acceptance"]
    out = capsys.readouterr().out
    assert "auto/best" in out and "weight floor" in out


@pytest.mark.slow
def test_targets_tables_tune_stage_on_the_shipped_h200_profile(tmp_path):
    """The tune stage alone, on the shipped H200 profile as its input: both policies validate and
    all three exports succeed; vLLM's own lookup of the export gives the policy's K at every batch."""
    from spectune.autotune.export_vllm import lookup_vllm
    from spectune.runtime.planner import Planner
    from spectune.runtime.table import read_table

    mod = load("targets_tables")
    prev = tmp_path / "prev"
    prev.mkdir()
    shipped = Path(mod.ROOT) / "spectune" / "profiles" / "nvidia-h200_qwen3-8b_eagle-1l.yaml"
    (prev / "cpu_qwen3-8b_eagle-1l.yaml").write_bytes(shipped.read_bytes())
    out = tmp_path / "out"
    assert mod.main(["--device", "cpu", "--target", "qwen3-8b", "--stage", "tune", "--resume-from", str(prev),
                     "--tune-trials", "8", "--out-dir", str(out)]) == 0
    res = json.loads((out / "targets_tables_qwen3-8b_tune.json").read_text())["stages"]["tune"]
    assert res["rc"] == 0 and set(res["policies"]) == {"cpu_qwen3-8b_eagle-1l.policy.yaml",
                                                      "cpu_qwen3-8b_eagle-1l.ctx320.policy.yaml"}
    for name, p in res["policies"].items():
        assert p["validate"]["rc"] == 0 and all(e["rc"] == 0 for e in p["exports"])
        assert p["held_out"]["median_rel"] == pytest.approx(0.022276, abs=1e-5)  # the shipped profile's
        table = read_table(out / name)
        assert table.workload.context_len == 2048 and p["rows"]
        import tarfile

        with tarfile.open(out / "cpu_qwen3-8b_eagle-1l.study.tar.gz") as t:
            cfg = json.load(t.extractfile(f"exports/{name.removesuffix('.yaml')}.vllm.json"))
        ks = lookup_vllm(cfg, 1024)
        for row in table.policy.rows:
            assert ks[row.batch[0]: row.batch[1] + 1] == [row.k] * (row.batch[1] - row.batch[0] + 1)
        planner = Planner(table)  # past the rows: the runtime planner's own K there (Planner.uniform_k)
        assert ks[table.workload.max_batch + 1:] == [planner.uniform_k(b) for b in range(table.workload.max_batch + 1, 1025)]
    assert res["policies"]["cpu_qwen3-8b_eagle-1l.ctx320.policy.yaml"]["step_ms"]["1"] == pytest.approx(
        res["policies"]["cpu_qwen3-8b_eagle-1l.policy.yaml"]["step_ms"]["1"])


@pytest.mark.slow
def test_targets_tables_fp8_profile_and_tune_on_cpu(tmp_path):
    from spectune.runtime.table import read_table

    mod = load("targets_tables")
    rc = mod.main([*TINY, "--dtype", "fp8", "--stage", "profile,tune", "--out-dir", str(tmp_path)])
    stem = "cpu_tiny_eagle-1l.fp8"
    assert {f"{stem}.yaml", f"{stem}.policy.yaml", f"{stem}.ctx24.policy.yaml", f"{stem}.study.tar.gz",
            "targets_tables_tiny-fp8_profile-tune.json"} == {p.name for p in tmp_path.iterdir()}
    assert read_table(tmp_path / f"{stem}.yaml").workload.dtype == "fp8"
    res = json.loads((tmp_path / "targets_tables_tiny-fp8_profile-tune.json").read_text())
    assert res["stages"]["profile"]["rc"] == 0 and "bench" not in res["stages"]
    assert all(p["validate"]["rc"] == 0 for p in res["stages"]["tune"]["policies"].values())
    assert rc in (0, 1) and (rc == 0) == (res["stages"]["tune"]["rc"] == 0)
    # the floor is of the fp8 bytes: 1 per projection weight (plus scales), below bf16's 2
    import torch

    from spectune.models.config import resolve_target, weight_read_bytes

    assert res["facts"]["weight_read_bytes"] < weight_read_bytes(resolve_target("tiny"), torch.bfloat16)
    assert mod.stem_for("nvidia-h200", "qwen3-8b", "eagle-1l", "bfloat16") == "nvidia-h200_qwen3-8b_eagle-1l"


@pytest.mark.slow
def test_targets_tables_fused_profiles_the_fused_decoder_under_its_own_name(tmp_path):
    from spectune.runtime.table import read_table

    mod = load("targets_tables")
    assert mod.main([*TINY, "--dtype", "float32", "--stage", "profile", "--fused", "--out-dir", str(tmp_path)]) == 0
    stem = "cpu_tiny_eagle-1l.float32.fused"
    assert mod.stem_for("cpu", "tiny", "eagle-1l", "float32", fused=True) == stem
    res = json.loads((tmp_path / "targets_tables_tiny-float32_profile.json").read_text())
    assert res["stem"] == stem and " --fused" in res["stages"]["profile"]["command"]
    assert read_table(tmp_path / f"{stem}.yaml").workload.attention.endswith("+fused")


@pytest.mark.parametrize("bad, field", [
    (["--target", "no-such-model"], "--target"),
    (["--target", "tiny", "--stage", "profile,nope"], "--stage"),
    (["--target", "tiny", "--dtype", "int4"], "--dtype"),
    (["--target", "tiny", "--concurrency", "1,x"], "--concurrency"),
    (["--target", "tiny", "--source", "tuned"], "--source"),
    (["--target", "tiny", "--max-k", "0"], "--max-k"),
])
def test_targets_tables_refuses_bad_options(tmp_path, capsys, bad, field):
    mod = load("targets_tables")
    out = tmp_path / "out"
    assert mod.main(["--device", "cpu", *bad, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err
    assert not out.exists()


def test_targets_tables_refuses_a_resume_without_its_inputs(tmp_path, capsys):
    mod = load("targets_tables")
    out, empty = tmp_path / "out", tmp_path / "empty"
    empty.mkdir()
    for stage in ("profile", "tune", "bench"):
        assert mod.main(["--device", "cpu", "--target", "tiny", "--stage", stage, "--resume-from", str(empty),
                         "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--resume-from" in err
        assert not out.exists()


def test_targets_tables_stops_a_stage_at_the_deadline(tmp_path, monkeypatch):
    import sys
    import time

    mod = load("targets_tables")
    monkeypatch.setattr(mod, "RESERVE_S", 0.0)
    monkeypatch.setattr(mod, "MIN_STAGE_S", 0.0)
    child = ("import time\ntry:\n    print('started', flush=True); time.sleep(120)\n"
             "except KeyboardInterrupt:\n    print('wrote what it had', flush=True); raise SystemExit(130)\n")
    res = mod.run_cmd([sys.executable, "-c", child], tmp_path / "log", time.monotonic() + 2.0)
    assert res["stopped_at_deadline"] and res["rc"] == 130 and res["tail"][-1] == "wrote what it had"
    done = mod.run_cmd([sys.executable, "-c", "print('ok')"], tmp_path / "log2", time.monotonic() + 60.0)
    assert done["rc"] == 0 and not done["stopped_at_deadline"] and mod.ok(done)
    late = mod.run_cmd([sys.executable, "-c", "print('ok')"], tmp_path / "log3", time.monotonic() - 1.0)
    assert late["rc"] is None and "deadline" in late["skipped"] and not mod.ok(late)


@pytest.mark.slow
def test_fused_step_dry_run_on_cpu(tmp_path, capsys, monkeypatch):
    # every arm on the tiny preset over the paged Triton cache (Triton's interpreter): unfused,
    # fused with the separate cache write, fused with the write in the q/k-norm + RoPE kernel,
    # that with the small-M linear, that with cuBLASLt at 17..64 rows, the yardstick (eager)
    from spectune.models import paged

    mod = load("fused_step")
    separate_writes = []  # the backend's own write_kv calls
    real_write = paged.write_kv
    monkeypatch.setattr(paged, "write_kv", lambda *a: separate_writes.append(1) or real_write(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # paged Triton: the interpreter on CPU
    assert mod.main(["--device", device, "--preset", "tiny", "--batches", "2", "--context-len", "8",
                     "--compile-backend", "eager", "--attention", "triton", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fused_step.json").read_text())
    check = res["check"]
    for arm in ("fused", "fused_kv"):
        assert check[arm]["argmax_agree"] == 1.0
        assert check[arm]["max_abs_diff"] < 0.05 * check["ref_abs_max"]
    assert check["fused_kv_equals_fused"] is True
    small = check["fused_small_m_vs_fused_kv"]  # the small-M kernel sums in another order
    assert small["argmax_agree"] == 1.0 and small["max_abs_diff"] < 0.05 * check["ref_abs_max"]
    arms = ("unfused", "fused", "fused_kv", "fused_small_m", "fused_lt", "compiled")
    assert {(p["arm"], p["batch"]) for p in res["points"]} == {(a, 2) for a in arms}
    assert all(p["ms"] > 0 and "error" not in p for p in res["points"])
    assert res["attention"] == "triton" and separate_writes  # unfused and fused wrote on their own
    out = capsys.readouterr().out
    assert "fused_kv/fused" in out and "fused_kv/compiled" in out and "small_m/fused_kv" in out and "lt/small_m" in out
    assert "check_lt_rows" not in res  # no batch of 17..64 rows asked for
    with pytest.raises(SystemExit, match="--batches"):
        mod.main(["--device", "cpu", "--batches", "0", "--out-dir", str(tmp_path)])


def one_run_timer(monkeypatch, mod):
    """The script's timer, one timed run and no warm-up (these tests check what the script writes,
    not its times; under Triton's interpreter each run of a kernel costs seconds)."""
    from spectune.autotune.timing import WallClockTimer

    monkeypatch.setattr(mod, "default_timer", lambda device: WallClockTimer(warmup=0, reps=1, batches=1))


def test_gemm_check_dry_run_on_cpu(tmp_path, capsys, monkeypatch):
    # every shape and M on the tiny preset; fp8 through torch._scaled_mm on CPU (its gate lifted),
    # cuBLASLt skipped off CUDA; the small-M Triton kernel under the interpreter (tests/conftest.py)
    # up to 16 rows, skipped at 17
    from spectune.kernels.gemv import heuristic_config
    from spectune.models.config import ModelArgs

    mod = load("gemm_check")
    monkeypatch.setattr(mod, "scaled_mm_ok", lambda x, w: True)
    one_run_timer(monkeypatch, mod)
    assert mod.main(["--device", "cpu", "--preset", "tiny", "--ms", "2,1,17", "--flush-mib", "1",
                     "--read-mib", "1", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gemm_check.json").read_text())
    tiny = ModelArgs.from_name("tiny")
    want = {"wqkv": (256, 128), "wo": (128, 128), "w13": (512, 128), "w2": (128, 256),
            "lm_head": (tiny.vocab_size, tiny.dim)}  # (H + 2 Hkv) D = 8 * 32, 2 I = 512
    assert {(r["shape"], r["n"], r["k"], r["m"]) for r in res["rows"]} == {
        (name, n, k, m) for name, (n, k) in want.items() for m in (1, 2, 17)}
    for r in res["rows"]:
        assert r["copies"] * 2 * r["n"] * r["k"] >= 2**20 or r["copies"] == mod.MAX_COPIES
        small = r["triton_small_m"]
        if r["m"] > 16:
            assert "skipped" in small
        else:
            assert "error" not in small and small["ms"] > 0
            assert small["weight_bytes"] == 2 * r["n"] * r["k"]
            assert small["config"] == dataclasses.asdict(heuristic_config(r["n"], r["k"], 1))
            # fp32 sums, one bf16 cast: within a bf16 rounding of the float32 product and F.linear
            assert small["rel_err"] < 0.01 and small["rel_err_linear"] < 0.01
        for arm in ("matmul", "linear", "fp8"):
            c = r[arm]
            assert "error" not in c and c["ms"] > 0
            assert c["gbps"] == pytest.approx(c["weight_bytes"] / (c["ms"] * 1e-3) / 1e9)
            assert c["of_read_bw"] == pytest.approx(c["gbps"] / res["read"]["gbps"])
        assert r["matmul"]["weight_bytes"] == 2 * r["n"] * r["k"]
        assert r["fp8"]["weight_bytes"] == r["n"] * r["k"] + 4 * r["n"]
        assert r["matmul"]["rel_err"] < 0.02 and 0 < r["fp8"]["rel_err"] < 0.15  # bf16 out; e4m3
        assert r["linear_lt"] == {"skipped": "CUDA only"}
    assert "lm_head" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--ms"):
        mod.main(["--device", "cpu", "--ms", "0,1", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--preset"):
        mod.main(["--device", "cpu", "--preset", "no-such-model", "--out-dir", str(tmp_path)])


def test_gemm_check_sweep_writes_a_config_table(tmp_path, monkeypatch):
    # --sweep on CPU (the interpreter), two candidates per shape: every swept shape gets a winner
    # among its candidates, and the table loads as kernels.gemv reads it
    from spectune.kernels import gemv

    mod = load("gemm_check")
    one_run_timer(monkeypatch, mod)
    monkeypatch.setattr(mod, "candidate_configs", lambda n, k, sms: gemv.candidate_configs(n, k, sms)[:2])
    monkeypatch.setattr(mod, "row_candidate_configs", lambda n, k, sms: gemv.row_candidate_configs(n, k, sms)[:2])
    assert mod.main(["--device", "cpu", "--preset", "tiny", "--ms", "1", "--flush-mib", "1",
                     "--read-mib", "1", "--out-dir", str(tmp_path), "--sweep"]) == 0
    res = json.loads((tmp_path / "gemm_check.json").read_text())
    table = gemv.load_table(str(tmp_path / "gemv_configs.json"))
    assert set(table) == {(r["n"], r["k"]) for r in res["rows"]}
    for r in res["rows"]:
        cell = r["triton_small_m"]
        swept = [gemv.GemvConfig(**e["config"]) for e in cell["sweep"]]
        assert swept == gemv.candidate_configs(r["n"], r["k"], 1)[:2]
        assert all(e["ms"] > 0 and "error" not in e for e in cell["sweep"])
        assert table[(r["n"], r["k"])] in swept
        row = r["triton_row"]  # the one-row kernel at M = 1, its two candidates swept too
        assert row["rel_err"] < 0.02 and row["config"] == dataclasses.asdict(
            gemv.row_default_config(torch.device("cpu"), r["n"], r["k"]))
        assert [gemv.GemvRowConfig(**e["config"]) for e in row["sweep"]] == gemv.row_candidate_configs(
            r["n"], r["k"], 1)[:2]
        assert all(e["ms"] > 0 and "error" not in e for e in row["sweep"])


def test_gemm_check_sweep_winner_is_the_best_over_all_m():
    mod = load("gemm_check")
    a, b, c = ({"block_n": bn, "block_k": 64, "split_k": 1, "num_warps": 4, "num_stages": 3}
               for bn in (16, 32, 64))

    def row(m, times):
        return {"n": 64, "k": 128, "m": m, "triton_small_m": {
            "sweep": [{"config": cfg, "ms": t} for cfg, t in zip((a, b, c), times, strict=True)]}}

    # a wins M 1 by a little, b wins M 16 by a lot; c is fastest at M 1 but failed at M 16
    rows = [row(1, (1.0, 1.1, 0.9)), row(16, (3.0, 2.0, float("inf"))), {"n": 8, "k": 8, "m": 17,
                                                                         "triton_small_m": {"skipped": "-"}}]
    assert mod.sweep_winners(rows) == {(64, 128): mod.GemvConfig(**b)}


def test_refit_profile_recomputes_the_fit_from_the_points_it_holds(tmp_path, capsys):
    from spectune.runtime.table import read_table

    mod = load("refit_profile")
    src = Path("benchmarks/results/profile_fp8_h200/nvidia-h200_qwen3-8b_eagle-1l.fp8.yaml")  # its first fit
    out = tmp_path / "refit.yaml"
    assert mod.main([str(src), "--out", str(out)]) == 0
    old, new = read_table(src), read_table(out)
    assert new.costs.points == old.costs.points and new.costs.model.overhead == old.costs.model.overhead
    assert new.costs.error.held_out == old.costs.error.held_out
    # the same points and held-out set; only the model's form differs (here: it takes a row tile)
    assert new.costs.model.target.tile_tokens > 1 and new.costs.error.median_rel < old.costs.error.median_rel
    assert "before: held-out median 3.02%" in capsys.readouterr().out
    policy = Path("spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fp8.policy.yaml")
    assert mod.main([str(policy), "--out", str(tmp_path / "x.yaml")]) == 2
    assert "a policy table" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()


def test_verify_attention_grid_flags_restrict_the_grid():
    mod = load("bench_verify_attention")
    grid = mod.grid_from_args(mod.parse_args(["--qs", "1,16", "--contexts", "2048", "--sweep-batches", "64"]))
    assert (grid.qs, grid.contexts, grid.sweep_batches, grid.batches) == ((1, 16), (2048,), (64,), mod.BATCHES)
    for argv, message in ((["--qs", "16"], "--qs: must include 1"), (["--qs", "1,x"], "--qs: cannot read"),
                          (["--qs", "1,17"], r"--qs: values must be in 1\.\.16, got 17"),
                          (["--contexts", "0"], "--contexts: values must be in")):
        with pytest.raises(SystemExit, match=message):
            mod.grid_from_args(mod.parse_args(argv))


def test_verify_attention_grades_each_gpu_against_its_own_bar():
    """The H200's 4.3 TB/s floor is the bar on an H200 only; another GPU is graded against the copy
    bandwidth it measured (an H100 copies at ~3.0 TB/s: graded against 4.3 every point missed)."""
    mod = load("bench_verify_attention")
    assert [mod.gpu_slug(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "H100")] == ["h200", "h100", "h100"]
    assert mod.kv_floor_gbs("NVIDIA H200") == 4300.0 and mod.kv_floor_gbs("NVIDIA H100 80GB HBM3") is None

    def rows():  # 64 x 2048 at 2 900 GB/s: q = 16 at 1.05 x q = 1
        kv = 64 * 2048 * 8 * 128 * 2 * 2
        return [{"ctx": 2048, "batch": 64, "q": q, "kv_bytes": kv, "triton_ms": kv / 2.9e9 * f,
                 "sdpa_gqa_ms": None, "folded_ms": None} for q, f in ((1, 1.0), (16, 1.05))]

    h100, h200 = rows(), rows()
    mod.summarize(h100, 3040.0, mod.kv_floor_gbs("NVIDIA H100 80GB HBM3"))
    mod.summarize(h200, 3040.0, mod.kv_floor_gbs("NVIDIA H200"))
    assert [r["meets_goal"] for r in h100] == [True, True] and h100[0]["pct_of_floor"] is None
    assert [r["meets_goal"] for r in h200] == [False, False] and round(h200[0]["pct_of_floor"]) == 67


def test_probe_common_int_list_is_one_parser_with_one_line_errors_naming_the_flag():
    mod = load("probe_common")
    assert mod.int_list("16,1, 4,16", "--qs", hi=16) == [1, 4, 16]  # sorted, distinct, spaces allowed
    for text, kw, message in (("1,x", {}, "--n: cannot read '1,x' (e.g. 1,2,4)"), (",", {}, "--n: empty list"),
                              ("0,2", {}, "--n: values must be >= 1, got 0"),
                              ("2,9", {"lo": 2, "hi": 8}, "--n: values must be in 2..8, got 9")):
        with pytest.raises(SystemExit) as err:
            mod.int_list(text, "--n", **kw)
        assert str(err.value).startswith(message) and "\n" not in str(err.value)

    class Refused(Exception):
        pass

    with pytest.raises(Refused, match="^--concurrency: cannot read"):
        mod.int_list("a", "--concurrency", error=Refused)


def test_sim_tables_plays_another_profiles_step_times(tmp_path, capsys):
    """``sim_tables.py --served-cost``: the bench's protocol with the runs timed by another profile;
    a profile of another target is refused in one line, nothing written."""
    from tests.engine.test_engine import write_policy
    from tests.tables import write_profile_like

    sim = load("sim_tables")
    policy = write_policy(tmp_path / "p.yaml")
    write_profile_like(policy, tmp_path / "slow.yaml", weight_factor=2.0)
    argv = [str(policy), "--sources", "low-0.55", "--concurrency", "4", "--requests", "8", "--decode-tokens", "8",
            "--repeats", "1"]
    assert sim.main([*argv, "--out", str(tmp_path / "own.json")]) == 0
    assert sim.main([*argv, "--served-cost", str(tmp_path / "slow.yaml"), "--out", str(tmp_path / "slow.json")]) == 0
    own, other = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("own", "slow"))
    assert other["served_cost"] == str(tmp_path / "slow.yaml") and own["served_cost"] is None
    plain = [next(r["goodput_tok_s"] for r in o["rows"] if r["arm"] == "plain") for o in (own, other)]
    assert plain[1] < 0.75 * plain[0]
    write_profile_like(policy, tmp_path / "other.yaml", weight_factor=2.0, target="another")
    capsys.readouterr()
    assert sim.main([*argv, "--served-cost", str(tmp_path / "other.yaml"), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "workload.target" in err[0] and not (tmp_path / "x.json").exists()


def test_sim_tables_serves_the_tables_own_acceptance_as_tuned(tmp_path, capsys):
    """``--sources tuned``: the acceptance the table was tuned on (what ``spectune bench`` serves by
    default) beside a held-out source; a table that records none is refused in one line."""
    from tests.engine.test_engine import POLICY_YAML, write_policy

    sim = load("sim_tables")
    policy = write_policy(tmp_path / "p.yaml")
    argv = ["--concurrency", "2", "--requests", "8", "--decode-tokens", "8", "--repeats", "1"]
    assert sim.main([str(policy), "--sources", "tuned,low-0.55", *argv, "--out", str(tmp_path / "t.json")]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    tuned = [r for r in rows if r["source"] == "tuned"]
    low = [r for r in rows if r["source"] == "low-0.55"]
    assert {r["arm"] for r in tuned} >= {"plain", "fixed:1", "auto"} and tuned and low
    # the tuned curve (0.8, 0.75, 0.75) accepts more than 0.55^i: longer accepted runs at fixed:3
    accept = {r["source"]: r["mean_accept_len"] for r in rows if r["arm"] == "fixed:3"}
    assert accept["tuned"] > accept["low-0.55"] + 0.3
    bare = tmp_path / "bare.yaml"
    text = POLICY_YAML.split("acceptance:")[0] + "policy:" + POLICY_YAML.split("policy:")[1]
    bare.write_text(text)
    capsys.readouterr()
    assert sim.main([str(bare), "--sources", "tuned", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tuned" in err[0] and "bare.yaml" in err[0] and not (tmp_path / "x.json").exists()


def test_mixed_prefill_compare_runs_on_cpu(tmp_path, capsys):
    mod = load("mixed_prefill")
    policy = Path(__file__).resolve().parent.parent / "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml"
    assert mod.main(["--out-dir", str(tmp_path), "--policy", str(policy), "--device", "cpu", "--no-fused",
                     "--modes", "separate,mixed:8,mixed:8:r12,mixed:8:all:p1,mixed:8:all:plan,mixed:8:r12:ahead",
                     "--concurrency", "2",
                     "--repeats", "1",
                     "--prompt-len", "6", "--max-new-tokens", "4"]) == 0
    table = json.loads((tmp_path / "mixed_prefill.json").read_text())
    assert set(table["modes"]) == {"separate", "mixed:8", "mixed:8:r12", "mixed:8:all:p1", "mixed:8:all:plan",
                                   "mixed:8:r12:ahead"}
    for mode, cells in table["modes"].items():
        for arm in ("plain", "auto"):
            cell = cells[f"2/{arm}"]
            assert cell["repeats"] == 1 and cell["hard_mismatches"] == 0 and cell["output_tok_s"] > 0
            assert cell["e2e_over_separate_decode"] > 0
        bench = json.loads((tmp_path / f"bench_{mode.replace(':', '_')}.json").read_text())
        rows = bench["rows"]
        if mode == "separate":
            assert all(r["mixed_prefill_tokens"] == 0 and r["prefill_forwards"] > 0 for r in rows)
        elif mode == "mixed:8":  # two 6-token prompts admitted at once pass the ride limit of 8: apart
            assert bench["header"]["ride_limit"] == 8 and all(r["prefill_forwards"] > 0 for r in rows)
        elif mode.startswith("mixed:8:r12"):  # the same two prompts (12 tokens) within a ride limit of 12: they ride
            assert bench["header"]["ride_limit"] == 12 and bench["header"]["prefill_budget"] == 8
            assert bench["header"]["admit_ahead"] == (4 if mode.endswith(":ahead") else 0)
            assert all(r["prefill_forwards"] == 0 and r["mixed_prefill_tokens"] > 0 for r in rows)
        else:  # every prompt rides (one piece a step with p1)
            assert all(r["prefill_forwards"] == 0 and r["mixed_prefill_tokens"] > 0 for r in rows)
            assert bench["header"]["ride_pieces"] == (1 if mode.endswith(":p1") else 16)
        # auto's riding steps: plan_ride's shapes, or the batch's plan with ``:plan``
        assert bench["header"]["ride_shapes"] == (None if mode == "separate" else
                                                  "plan" if mode.endswith(":plan") else "plan_ride")
    assert "e2e/sep.decode" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["mixed", "mixed:0", "mixed:8:some", "mixed:8:", "fused", "mixed:8:p0",
                                  "mixed:8:all:p", "mixed:p4", "mixed:plan", "mixed:8:plan:p4", "mixed:8:r0",
                                  "mixed:8:r", "mixed:8:rx", "mixed:ahead", "mixed:8:ahead:plan"])
def test_mixed_prefill_refuses_a_bad_mode(tmp_path, mode):
    mod = load("mixed_prefill")
    with pytest.raises(SystemExit, match="--modes"):
        mod.main(["--out-dir", str(tmp_path), "--modes", mode, "--device", "cpu"])
    assert not (tmp_path / "mixed_prefill.json").exists()


def test_attention_parts_dry_run_on_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load("attention_parts")
    assert mod.main(["--out-dir", str(tmp_path), "--device", "cpu", "--batches", "2,3", "--pieces", "24",
                     "--context", "40"]) == 0
    res = json.loads((tmp_path / "attention_parts.json").read_text())
    assert [(r["batch"], r["piece"]) for r in res["rows"]] == [(2, 24), (3, 24)]
    assert all(r["max_abs_diff"] < 1e-4 for r in res["rows"])  # two launches give one launch's rows
    assert "two / one" in capsys.readouterr().out


@pytest.mark.parametrize("q_tokens, ctx", [(1, 64), (3, 96), (16, 64)])
def test_attention_q16_variants_match_the_reference(monkeypatch, q_tokens, ctx):
    """The stripped loop's exact variants (``full``, ``lazy``) against ``verify_attention_ref`` on
    fresh random inputs, in Triton's interpreter; queries scaled up so the running max moves by
    more than the lazy threshold between tiles."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load("attention_q16")
    q, kc, vc, bt = mod.make_inputs(2, ctx, q_tokens, "cpu", torch.float32, seed=ctx + q_tokens)
    q = q * 4.0
    ref = mod.reference(q, kc, vc, bt, ctx, q_tokens)
    for variant in ("full", "lazy"):
        out = mod.run_variant(variant, q, kc, vc, bt, ctx, q_tokens, torch.empty_like(q), block_n=16)
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), variant
    # the leave-a-stage-out variants run (their outputs are not attention)
    for variant in ("loads", "dots"):
        mod.run_variant(variant, q, kc, vc, bt, ctx, q_tokens, torch.empty_like(q), block_n=16)


def test_attention_q16_refuses_without_a_gpu_and_bad_options(capsys):
    mod = load("attention_q16")
    if not torch.cuda.is_available():
        assert mod.main(["--out-dir", "."]) == 2
        assert "CUDA" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--qs"):
        mod.main(["--qs", "0,16"])


def test_attention_resources_compiles_for_sm90_without_a_gpu(tmp_path, capsys):
    import os
    import subprocess
    import sys

    # a process of its own: the test session's kernels may be the interpreter's (TRITON_INTERPRET)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH.parent), env.get("PYTHONPATH", "")])
    out = tmp_path / "res.json"
    run = subprocess.run([sys.executable, str(BENCH / "attention_resources.py"), "--configs", "16/64/4/2,64/64/4/2",
                          "--variants", "shipped,lazy", "--out", str(out)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "regs" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["block_m"]) for r in rows] == [("shipped", 16), ("shipped", 64), ("lazy", 16), ("lazy", 64)]
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] > 0
        assert 1 <= r["ctas"] == min(r["ctas_by_registers"], r["ctas_by_shared"], r["ctas_by_warps"])
        assert r["ptx_ops"]["cp.async.cg"] > 0  # the K/V tiles are async 16-byte copies
    big = {r["kernel"]: r for r in rows if r["block_m"] == 64}
    assert big["shipped"]["ptx_ops"]["wgmma.mma_async"] > 0  # 64 rows: Hopper's warpgroup MMA
    mod = load("attention_resources")
    with pytest.raises(SystemExit, match="--configs"):
        mod.main(["--configs", "64/64/4"])
    with pytest.raises(SystemExit, match="--variants"):
        mod.main(["--variants", "shipped,fast"])


def test_predict_e2e_beside_the_h200_runs():
    mod = load("predict_e2e")
    root = BENCH.parent
    res = BENCH / "results" / "engine_speed_h200_v14"
    rows = [r for d in ("bursts_apart_p64", "bursts_apart_p256", "every_prompt_rides_p256")
            for f in ("bench_separate.json", "bench_mixed_256.json", "bench_mixed256.json")
            if (res / d / f).exists() for r in mod.predict_file(res / d / f, root)]
    separate = [r for r in rows if r["prefill"] == "separate"]
    assert {(r["prompt_len"], r["concurrency"], r["arm"]) for r in separate} == {
        (64, 32, "plain"), (64, 32, "auto"), (64, 64, "plain"), (64, 64, "auto"),
        (256, 64, "plain"), (256, 64, "auto"), (256, 32, "plain"), (256, 32, "auto")}
    for r in separate:
        assert r["predicted_output_tok_s"] < r["predicted_decode_tok_s"]
        assert abs(r["output_error"]) < 0.15  # measured on the H200 vs the profile's cost model
        assert r["predicted_ride_steps"] is None and r["excess_ms_per_ride_step"] is None
    # mixed prefill: the bursts-apart runs (ride limit 256) and the runs from before the limit
    # existed (every prompt rode)
    riding = {(r["prefill"], r["prompt_len"], r["concurrency"], r["arm"]): r for r in rows if r not in separate}
    assert {key[0] for key in riding} == {"ride:256:256", "ride:256:all"}
    assert riding["ride:256:all", 256, 32, "plain"]["predicted_ride_steps"] > 0  # every prompt rode
    assert riding["ride:256:256", 256, 64, "plain"]["predicted_ride_steps"] == 0  # plain's waves are bursts
    for r in riding.values():
        assert r["predicted_output_tok_s"] > 0 and r["output_error"] is not None


def test_sim_ride_aware_compares_riding_shapes_on_the_same_runs(tmp_path, capsys):
    mod = load("sim_ride_aware")
    policy = str(BENCH.parent / "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml")
    out = tmp_path / "ride.json"
    assert mod.main([policy, "--sources", "high-0.9", "--shapes", "p256-all", "--concurrency", "16",
                     "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert (row["source"], row["shape"], row["concurrency"], row["ride_limit"]) == ("high-0.9", "p256-all", 16, 1 << 20)
    assert row["plan_ride_over_as_planned"] == pytest.approx(row["e2e_auto_plan_ride"] / row["e2e_auto_as_planned"])
    # every prompt rides past the knee: riding steps ran smaller K than the choice's own steps
    assert row["k_hist_plan_ride"] != row["k_hist_as_planned"]
    assert min(map(int, row["k_hist_plan_ride"])) < min(map(int, row["k_hist_as_planned"]))
    assert row["plan_ride_over_as_planned"] > 1.0  # and end to end it gains there (1.033 on this seed)
    assert "plan_ride / as planned over 1 cells" in capsys.readouterr().out


def test_predict_e2e_prices_riding_steps_at_the_shapes_the_run_gave_them(tmp_path):
    # a run from before plan_ride (no ``ride_shapes`` in its header) ran its riding steps at
    # plan(batch): predicted so; the same run marked as plan_ride is predicted with plan_ride
    mod = load("predict_e2e")
    src = BENCH / "results" / "engine_speed_h200_v14" / "every_prompt_rides_p256" / "bench_mixed256.json"
    data = json.loads(src.read_text())
    assert "ride_shapes" not in data["header"]
    data["rows"] = [r for r in data["rows"] if r["concurrency"] == 32]
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(data))
    data["header"]["ride_shapes"] = "plan_ride"
    new.write_text(json.dumps(data))
    before = {r["arm"]: r for r in mod.predict_file(old, BENCH.parent)}
    after = {r["arm"]: r for r in mod.predict_file(new, BENCH.parent)}
    assert before["plain"]["predicted_output_tok_s"] == after["plain"]["predicted_output_tok_s"]
    assert after["auto"]["predicted_output_tok_s"] > before["auto"]["predicted_output_tok_s"]
    # a ``:plan`` mode's run (ride_shapes "plan") ran its riding steps at plan(batch) too
    data["header"]["ride_shapes"] = "plan"
    planned = tmp_path / "planned.json"
    planned.write_text(json.dumps(data))
    as_planned = {r["arm"]: r for r in mod.predict_file(planned, BENCH.parent)}
    assert as_planned["auto"]["predicted_output_tok_s"] == before["auto"]["predicted_output_tok_s"]


def test_e2e_ceiling_prices_the_prompts_at_the_fits_token_past_the_knee(tmp_path, capsys):
    """``e2e_ceiling.py``: each row's ceiling is (N / (N - 1)) / (1 + decode x P / (N - 1) x the
    fit's ms a token past the knee); the simulated end to end stays under decode and, where the arm's
    steps run past the knee, within the cost model's error of the ceiling; bad options are refused
    in one line, nothing written."""
    mod = load("e2e_ceiling")
    policy = str(BENCH.parent / "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml")
    out = tmp_path / "ceiling.json"
    assert mod.main([policy, "--concurrency", "64", "--arms", "plain,auto", "--repeats", "1", "--prompt-len", "64",
                     "--new-tokens", "256", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["arm"]: r for r in res["rows"]}
    assert set(rows) == {"plain", "auto"} and res["prompt_len"] == 64 and res["new_tokens"] == 256
    target = mod.load(policy, on_gpu_mismatch="ignore").table.costs.model.target
    m = target.token_ms + target.compute_ms
    for r in rows.values():
        assert r["marginal_us_per_token"] == pytest.approx(m * 1e3)
        assert r["ceiling"] == pytest.approx((256 / 255) / (1.0 + r["decode_tok_s"] * 64 / 255 * m / 1e3))
        assert r["separate_over_decode"] < 1.0 and r["riding_over_decode"] < 1.0
    # plain at 64 runs 64 tokens a step (below the knee); auto's drafts take it past it, where the
    # simulated riding run is within a few per cent of the ceiling and not far above it
    assert not rows["plain"]["past_knee"] and rows["auto"]["past_knee"]
    assert 0.95 * rows["auto"]["ceiling"] < rows["auto"]["riding_over_decode"] < 1.02 * rows["auto"]["ceiling"]
    # admitted ahead: auto's successors' prompts are cached while the rows they replace may still
    # run, and join as a slot frees (no step a row short): closer to the ceiling, not past it;
    # plain's waves end together (bursts of separate forwards as before): within half a per cent
    assert rows["auto"]["riding_over_decode"] < rows["auto"]["ahead_over_decode"] < 1.02 * rows["auto"]["ceiling"]
    assert rows["plain"]["ahead_over_decode"] == pytest.approx(rows["plain"]["riding_over_decode"], rel=5e-3)
    capsys.readouterr()
    for bad, field in ((["--concurrency", "0"], "--concurrency"), (["--arms", "fixed:x"], "--arms"),
                       (["--new-tokens", "1"], "--new-tokens")):
        assert mod.main([policy, *bad, "--out", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and field in err[0]
    assert not (tmp_path / "x.json").exists()


def test_sim_host_lag_replays_a_stored_h200_run_with_and_without_the_lag(tmp_path, capsys):
    """``sim_host_lag.py`` recomputes the bench's prediction of a stored run (the same seeds,
    requests and acceptance: without the lag it is the stored ``predicted_tok_s``) and with the
    engine's host lag, whose idle rows are near the measured ones; a trace replay is skipped."""
    mod = load("sim_host_lag")
    root = BENCH.parent
    tuned = root / "benchmarks/results/heldout_h200_v17/bench_heldout_tuned_h200.json"
    trace = root / "benchmarks/results/heldout_h200_v17/bench_heldout_humaneval_h200.json"
    out = tmp_path / "lag.json"
    assert mod.main([str(tuned), str(trace), "--concurrency", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {r["file"] for r in res["rows"]} == {tuned.name}  # the trace replay: skipped
    stored = {(r["concurrency"], r["arm"]): r["predicted_tok_s"] for r in json.loads(tuned.read_text())["rows"]}
    for r in res["rows"]:
        # (auto's prediction is its planner's: a later controller change moves it a little)
        rel = 0.01 if r["arm"] == "auto" else 1e-6
        assert r["predicted_tok_s"] == pytest.approx(stored[(r["concurrency"], r["arm"])], rel=rel)
        if r["arm"] == "plain":  # one token a step: no idle row, no change
            assert r["idle_rows"] == r["idle_rows_simulated"] == 0
            assert r["predicted_host_lag_tok_s"] == pytest.approx(r["predicted_tok_s"])
        else:
            assert r["idle_rows_simulated"] == pytest.approx(r["idle_rows"], abs=5)
            assert r["predicted_host_lag_tok_s"] < r["predicted_tok_s"]
    assert res["summary"]["error_host_lag"]["median_abs"] < res["summary"]["error"]["median_abs"]
    assert "skipped" in capsys.readouterr().err


def test_bench_planner_times_every_step_kind_on_cpu(tmp_path, capsys):
    """``bench_planner.py``: the planner's host time per call and per server step, shifting and
    steady traffic, written as JSON (times are not asserted: they are this machine's)."""
    mod = load("bench_planner")
    out = tmp_path / "bp.json"
    loops = []  # each step loop runs once a round: its best of --rounds is what is written
    step_us, sampled_us = mod.step_us, mod.sampled_us
    mod.step_us = lambda p, n, sizes, **kw: loops.append(("step", len(sizes), tuple(kw.items()))) or step_us(p, n, sizes, **kw)
    mod.sampled_us = lambda p, n, sizes, **kw: loops.append(("sampled", len(sizes))) or sampled_us(p, n, sizes, **kw)
    mod.main(["--calls", "2000", "--rounds", "3", "--out", str(out)])
    assert len(loops) == 3 * 7 and all(loops.count(x) == 3 for x in loops[:7])
    res = json.loads(out.read_text())
    assert res["rounds"] == 3
    keys = ("us_per_call", "plan_ride_us", "step_us_fixed_batch", "step_us_served_batch", "step_us_varying_batch",
            "step_us_steady_fixed_batch", "step_us_steady_served_batch", "step_us_sampled_fixed_batch",
            "step_us_sampled_served_batch", "decisions_per_100_steps_sampled_fixed_batch",
            "decisions_per_100_steps_sampled_served_batch")
    assert all(res[k] > 0 for k in keys) and res["max_k"] == 15 and res["calls"] == 2000
    printed = capsys.readouterr().out
    assert "holds still" in printed and "plans moved" in printed and "counted per request" in printed
    # the per-request counters: position j tested by the requests that accepted every draft before
    # it, none past K; about a 0.75 share of the tested accepted
    rng = mod.random.Random(1)
    for b, k in ((1, 3), (32, 4), (200, 15)):
        acc, tested = mod.request_counters(rng, b, k, 15)
        assert tested[0] == b and all(t == 0.0 for t in tested[k:]) and all(a == 0.0 for a in acc[k:])
        assert all(acc[j] == tested[j + 1] for j in range(k - 1)) and all(a <= t for a, t in zip(acc, tested, strict=True))
    acc, tested = mod.request_counters(rng, 4000, 1, 15)
    assert 0.72 < acc[0] / tested[0] < 0.78
    # the steady counters: K positions tested, none past the plan's K
    planner = mod.Planner(mod.synthetic_table())
    plans, seen, plan = [], [], planner.plan
    planner.plan = lambda b: plans.append(plan(b)) or plans[-1]  # type: ignore[method-assign]
    planner.observe = lambda acc, tested: seen.append((plans[-1].k, tested))  # type: ignore[method-assign]
    mod.step_us(planner, 50, [32], steady=True)
    assert len(seen) == 50 and any(k for k, _ in seen)
    assert all(all(t == 0.0 for t in tested[k:]) and all(t > 0 for t in tested[:k]) for k, tested in seen)


def test_bench_planner_times_another_planner_beside_this_one(tmp_path, capsys):
    """``bench_planner.py --against-file``: both planners' step loops in one process, each loop's
    time per planner and the ratio, written as JSON; a file that is not there is one line."""
    import spectune.runtime.planner as planner

    mod = load("bench_planner")
    out = tmp_path / "cmp.json"
    mod.main(["--calls", "2000", "--rounds", "1", "--against-file", planner.__file__, "--out", str(out)])
    res = json.loads(out.read_text())
    assert [r["loop"] for r in res["rows"]] == [name for _, name, _ in mod.STEP_LOOPS] and len(res["rows"]) == 6
    assert all(r["us"] > 0 and r["us_against"] > 0 and r["ratio"] == r["us"] / r["us_against"] for r in res["rows"])
    assert "counted per request, a server's batch" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mod.main(["--calls", "2000", "--against-file", str(tmp_path / "none.py"), "--out", str(out)])


def test_planner_trace_passes_the_same_planner_and_names_the_step_a_changed_one_differs(tmp_path, capsys):
    """``planner_trace.py``: a reference planner equal to the working copy's gives the same plans
    and end state on every workload (exit 0); one whose estimate shrinks less toward the prior is
    reported per workload with where it first differs (exit 1); a bad revision or table is one line."""
    import spectune.runtime.planner as planner

    mod = load("planner_trace")
    table = str(Path(planner.__file__).resolve().parents[1] / "profiles" / "nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml")
    src = Path(planner.__file__).read_text()
    same = tmp_path / "same.py"
    same.write_text(src)
    assert mod.main([table, "--against-file", str(same), "--steps", "120"]) == 0
    assert "15 of 15 the same" in capsys.readouterr().out
    assert "SHRINK = 32.0" in src
    changed = tmp_path / "changed.py"
    changed.write_text(src.replace("SHRINK = 32.0", "SHRINK = 8.0", 1))
    assert mod.main([table, "--against-file", str(changed), "--steps", "120"]) == 1
    out = capsys.readouterr().out
    assert out.count("differs:") >= 3 and "of 15 the same" in out and "15 of 15" not in out
    assert "step " in out or "end state" in out
    with pytest.raises(SystemExit) as e:
        mod.main([table, "--against", "no-such-revision"])
    assert "no-such-revision" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit):
        mod.main([str(tmp_path / "missing.yaml"), "--against-file", str(same)])
    assert "missing.yaml: no such policy table" in capsys.readouterr().err


def test_declined_drafts_simulates_a_trace_set_per_offered_draft_and_by_token_replay(tmp_path, capsys):
    # every other step offers nothing: per offered draft a fixed K = 1 always accepts; replayed,
    # the output runs 2, 1, 0 (a step of 3 offered, 2 right) then 0 (a step that offered none),
    # so K = 1 steps start at runs 2, 0, 0: 4 tokens in 3 steps
    mod = load("sim_declined_drafts")
    steps = [{"request": f"r{r}", "step": i, "offered": 0 if i % 2 else 3, "accepted": 0 if i % 2 else 2}
             for r in range(8) for i in range(40)]
    src, out = tmp_path / "t.jsonl", tmp_path / "both.json"
    src.write_text("".join(json.dumps(x) + "\n" for x in steps))
    table = str(Path(__file__).resolve().parents[1] / "spectune" / "profiles"
                / "nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml")
    assert mod.main([table, "--trace", str(src), "--concurrency", "1", "--requests", "2", "--decode-tokens", "15",
                     "--repeats", "1", "--arms", "fixed:1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    (offered,), (replayed,) = got["per_offered_draft"], got["token_replay"]
    # (a request's last step has no room to draft: 15 tokens)
    assert offered["mean_accept_len"] >= 1.85 and replayed["mean_accept_len"] == pytest.approx(4 / 3, abs=0.05)
    assert "classes per offered draft" in capsys.readouterr().out


def test_declined_drafts_reads_measured_full_load_ratios_to_plain(tmp_path):
    mod = load("sim_declined_drafts")
    arms = [{"concurrency": 16, "arm": "plain", "full_tok_s": 100.0}, {"concurrency": 16, "arm": "fixed:1", "full_tok_s": 110.0},
            {"concurrency": 64, "arm": "fixed:1", "full_tok_s": 90.0}]  # no plain at 64: no ratio there
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"summary_full_load": {"arms": arms}}))
    b.write_text(json.dumps({"summary_full_load": {"arms": [{**arms[0]}, {**arms[1], "full_tok_s": 120.0}]}}))
    assert mod.measured_ratios([str(a), str(b)]) == {(16, "fixed:1"): pytest.approx(1.15)}
    with pytest.raises(SystemExit):
        mod.main(["p.yaml", "--trace", "t.jsonl", "--concurrency", "1,16", "--requests", "1,2,3"])


def test_sim_planner_files_runs_each_planner_against_one_set_of_fixed_arms(tmp_path, capsys):
    """``sim_planner_files.py``: the fixed arms of a (table, source, c) are run once and cached; a
    planner file and its copy read the same; a changed planner reads otherwise; bad names: exit 2."""
    import spectune.runtime.planner as planner

    mod = load("sim_planner_files")
    src = Path(planner.__file__).read_text()
    same, changed = tmp_path / "same.py", tmp_path / "changed.py"
    same.write_text(src)
    assert "SHRINK = 32.0" in src
    changed.write_text(src.replace("SHRINK = 32.0", "SHRINK = 8.0", 1))  # an estimate nearer its counts
    cache, out = tmp_path / "cache", tmp_path / "out.json"
    args = ["--tables", "qwen3-8b_eagle-1l.ctx320", "--sources", "mtbench-ngram", "--concurrency", "1",
            "--repeats", "1", "--workers", "1", "--cache", str(cache)]
    assert mod.main([*args, "--planners", f"{same},{planner.__file__}", "--out", str(out)]) == 0
    assert len(list(cache.iterdir())) == 1  # plain and every fixed K of the cell, run once
    row, = json.loads(out.read_text())["rows"]
    a, b = row["auto"][str(same)], row["auto"][planner.__file__]
    assert a == b and 0.9 < a["full_ratio_vs_best_other"] < 1.1 and sum(a["k_hist"].values()) > 0
    assert mod.main([*args, "--planners", str(changed), "--out", str(out)]) == 0
    assert len(list(cache.iterdir())) == 1  # the cached arms served the second call
    c = json.loads(out.read_text())["rows"][0]["auto"][str(changed)]
    assert c["k_hist"] != a["k_hist"]
    capsys.readouterr()
    assert mod.main([*args, "--planners", str(same), "--sources", "no-such-source"]) == 2
    err = capsys.readouterr().err
    assert "no-such-source" in err and err.count("\n") == 1


def test_sim_batch1_hands_the_counters_over_late(tmp_path, capsys):
    """``sim_batch1.py``: the planner reads each step's counters ``--late`` plans after the
    simulator hands them over (as an engine's host that runs ahead), and the cells land in JSON."""
    sim_batch1 = load("sim_batch1")

    seen = []

    class Recorder:
        def observe(self, acc, tested):
            seen.append(acc[0])

    late = sim_batch1.Late(Recorder(), 1)
    for i in range(3):
        late.observe([float(i)], [1.0])
    assert seen == [0.0, 1.0]  # the third step's counters wait for the next plan
    table = "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml"
    out = tmp_path / "c1.json"
    assert sim_batch1.main([table, "--sources", "mtbench-ngram", "--late", "1", "--repeats", "1", "--out", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert list(cells) == [f"{Path(table).name}|mtbench-ngram"] and 0.5 < cells[f"{Path(table).name}|mtbench-ngram"][0] < 1.5
    assert "trace cells: mean" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--late"):
        sim_batch1.main([table, "--late", "-1"])


def test_trace_two_states_bounds_on_the_shipped_traces(tmp_path):
    """``trace_two_states.py``: the rule after a hit runs K, after a miss plain, K = 1 after m plain
    steps; with the counters late it sees one step less; the four trace sets land in JSON."""
    mod = load("trace_two_states")
    rule = mod.two_states(3, 2)
    assert rule([]) == 1 and rule([(1, 1)]) == 3 and rule([(1, 0)]) == 0 and rule([(1, 0), (0, 0), (0, 0)]) == 1
    ms = {k: 1.0 + 0.1 * k for k in range(8)}
    span = [[4, 3, 2, 1, 0, 0, 0, 0]]  # a 4-token span, then nothing
    assert mod.goodput(span, ms, lambda _: 0, 8, 0) == pytest.approx(1.0)
    assert mod.goodput(span, ms, rule, 8, 1) < mod.goodput(span, ms, rule, 8, 0)  # a step late: less known
    out = tmp_path / "t.json"
    assert mod.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["traces"] for r in rows] == list(mod.TRACES)
    assert all(r["two_states_late0"]["x_plain"] >= r["two_states_late1"]["x_plain"] for r in rows)
