"""Each bad input of issue 14 (tried by hand as a new user would) is one line naming the file or
the option, exit 2, and no file written; each friction point says what it should."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from spectune.cli import main
from spectune.runtime.table import Point, Row, write_table
from tests.tables import make_params, make_policy, make_profile, make_workload

ROOT = Path(__file__).resolve().parents[1]


def profile_dict(**workload):
    points = [Point("target", b, b * q, 5.0 + 0.1 * b * q, q=q) for b in (1, 4) for q in (1, 2, 4)]
    t = make_profile(make_params((5.0, 0.02, 64.0, 0.05, 30.0), (0.05, 0.4, 0.002), (0.02, 0.0001)),
                     make_workload(3, 8, context_len=64, **workload), points=points)
    return yaml.safe_load(__import__("spectune.runtime.table", fromlist=["x"]).table_to_yaml(t))


@pytest.fixture
def files(tmp_path):
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(profile_dict()))
    table = make_profile(make_params((5.0, 0.02, 64.0, 0.05, 30.0), (0.05, 0.4, 0.002), (0.02, 0.0001)),
                         make_workload(3, 8, context_len=64),
                         policy=make_policy([8, 16, 32], [Row((1, 4), 3, 12, tier=16), Row((5, 8), 2, 16, tier=32)],
                                            window=256.0, margin=0.01))
    policy = tmp_path / "policy.yaml"
    write_table(table, policy)
    return tmp_path, profile, policy


def refused(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.lower().startswith("warning")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def edited(tmp_path, fn, name="bad.yaml"):
    d = profile_dict()
    fn(d)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.mark.parametrize("write,needle", [
    (lambda p: p.write_bytes(b"schema: spectune/1\nhardware: {gpu: \xff\xfe}\n"), "not UTF-8"),
    (lambda p: p.write_text("schema: spectune/1\n1: a\nb: c\n"), "keys must be strings"),
    (lambda p: p.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n"), "nested deeper than 200"),
    (lambda p: p.write_text("a: " + "{b: " * 300 + "1" + "}" * 300 + "\n"), "nested deeper than 200"),
    (lambda p: p.write_text("a: [1, 2\n"), "not valid YAML"),
    (lambda p: p.write_text("a: &x [*x]\n"), "unknown key"),
])
def test_unreadable_tables(tmp_path, capsys, write, needle):
    path = tmp_path / "t.yaml"
    write(path)
    refused(capsys, ["validate", str(path)], str(path), needle)


def set_target(**fields):
    return lambda d: d["costs"]["model"]["target"].update(fields)


@pytest.mark.parametrize("fn,field", [
    (set_target(weight_ms=math.inf), "costs.model.target.weight_ms"),
    (set_target(weight_ms=0.0, token_ms=0.0, knee_tokens=0.0, compute_ms=0.0, kv_ms_per_mtok=0.0), "weight_ms"),
    (lambda d: d["costs"]["points"][0].update(batch=0), "costs.points[0].batch"),
    (lambda d: d["costs"]["points"][0].update(ms=-1.0), "costs.points[0].ms"),
    (lambda d: d["costs"]["points"][0].update(tokens=-4), "costs.points[0].tokens"),
    (lambda d: d["costs"]["model"]["overhead"].update(token_ms=-0.1), "costs.model.overhead.token_ms"),
    (lambda d: d["workload"].update(max_batch=100_000), "workload.max_batch"),
])
@pytest.mark.parametrize("command", ["validate", "tune"])
def test_tables_that_used_to_pass_validate(files, capsys, fn, field, command):
    tmp, _, _ = files
    bad = edited(tmp, fn)
    argv = ["validate", str(bad)] if command == "validate" else ["tune", str(bad), "--out", str(tmp / "o.yaml")]
    refused(capsys, argv, str(bad), field)
    assert not (tmp / "o.yaml").exists()


def set_policy(fn):
    def edit(path):
        d = yaml.safe_load(path.read_text())
        fn(d)
        path.write_text(yaml.safe_dump(d))
    return edit


@pytest.mark.parametrize("fn,field", [
    (lambda d: d["policy"].update(objective="gjodput"), "policy.objective"),
    (lambda d: d["policy"]["rows"][0].update(gain=1098.0), "policy.rows[0].gain"),
    (lambda d: d["policy"]["rows"][0].update(gain=-2.0), "policy.rows[0].gain"),
    (lambda d: d["policy"]["rows"][0].update(tier=8), "policy.rows[0].tier"),
    (lambda d: d["policy"]["online"].update(max_k=99), "policy.online.max_k"),
])
@pytest.mark.parametrize("command", ["validate", "export", "bench"])
def test_policies_that_used_to_pass(files, capsys, fn, field, command):
    tmp, _, policy = files
    set_policy(fn)(policy)
    argv = {"validate": ["validate", str(policy)],
            "export": ["export", str(policy), "--format", "vllm", "--out", str(tmp / "e.json")],
            "bench": ["bench", "--policy", str(policy), "--out", str(tmp / "b.json"), "--device", "cpu"]}[command]
    refused(capsys, argv, str(policy), field)
    assert not (tmp / "e.json").exists() and not (tmp / "b.json").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--latency-bound-ms", "-1"], "--latency-bound-ms"),
    (["--latency-bound-ms", "nan"], "--latency-bound-ms"),
    (["--objective", "latency", "--latency-bound-ms", "1e-4"], "below the fastest step"),
    (["--max-batch", "100000"], "--max-batch"),
    (["--acceptance", "curve:0.5,0.9"], "cannot increase"),
])
def test_tune_options(files, capsys, argv, needle):
    tmp, profile, _ = files
    refused(capsys, ["tune", str(profile), "--out", str(tmp / "o.yaml"), *argv], needle)
    assert not (tmp / "o.yaml").exists()


@pytest.mark.parametrize("out", ["folder", "/proc/spectune-readonly.yaml"])
def test_out_that_cannot_be_written(files, capsys, out):
    tmp, profile, policy = files
    target = str(tmp) if out == "folder" else out
    refused(capsys, ["tune", str(profile), "--out", target, "--trials", "2", "--no-progress"], target)
    refused(capsys, ["export", str(policy), "--format", "vllm", "--method", "ngram", "--out", target], target)
    if out != "folder":
        refused(capsys, ["report", str(policy), "--out", out], out)
    assert not list(tmp.glob(".*.tmp"))


def test_out_under_a_file_names_the_file_that_is_not_a_folder(files, capsys):
    tmp, profile, policy = files
    (tmp / "t1.yaml").write_text("x")
    target = str(tmp / "t1.yaml" / "sub" / "x.json")
    refused(capsys, ["export", str(policy), "--format", "vllm", "--method", "ngram", "--out", target],
            f"{tmp / 't1.yaml'} is a file, not a folder")
    assert (tmp / "t1.yaml").read_text() == "x"


def test_bench_refuses_huge_prompts_and_a_bad_acceptance_before_building(files, capsys):
    tmp, _, policy = files
    refused(capsys, ["bench", "--policy", str(policy), "--out", str(tmp / "b.json"), "--prompt-len", "100000"],
            "--prompt-len")
    refused(capsys, ["bench", "--policy", str(policy), "--out", str(tmp / "b.json"), "--acceptance", "curve:7"],
            "curve:7")


def test_validate_dev_zero_is_refused_without_reading_it_all(capsys):
    refused(capsys, ["validate", "/dev/zero"], "/dev/zero", "MiB")


def test_autotune_checks_the_acceptance_before_profiling(tmp_path, capsys):
    out = tmp_path / "a.yaml"
    refused(capsys, ["autotune", "--device", "cpu", "--no-progress", "--out", str(out), "--acceptance", "nonsense"],
            "nonsense")
    assert not list(tmp_path.iterdir())  # no profile, no journal: nothing was measured


def test_ctrl_c_in_tune_says_nothing_was_written(files, capsys, monkeypatch):
    import spectune.autotune.tune_pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "tune", interrupted)
    tmp, profile, _ = files
    assert main(["tune", str(profile), "--out", str(tmp / "o.yaml")]) == 130
    err = capsys.readouterr().err
    assert "nothing was written" in err and "resumes" not in err


def test_tune_warns_that_the_table_inherits_a_large_profile_error(files, capsys):
    tmp, _, _ = files
    noisy = edited(tmp, lambda d: d["costs"]["error"].update(held_out=12, median_rel=0.407, max_rel=0.751))
    out = tmp / "o.yaml"
    assert main(["tune", str(noisy), "--out", str(out), "--trials", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "WARNING" in err and "40.7%" in err and "75.1%" in err and f"{out} inherits it" in err


@pytest.mark.parametrize("name", ["sim_nvidia-h200_qwen3-8b_eagle-1l.json", "sim_h200_probe_qwen3-8b_eagle-1l.json"])
def test_report_reads_the_shipped_simulation_results(tmp_path, capsys, name):
    assert main(["report", str(ROOT / "benchmarks" / "results" / name), "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "Simulation: mean" in md and "Simulation: heterogeneous" in md
    rows = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["mean"]["rows"]
    assert f"{rows[0]['monte_carlo']['policy']:.1f}" in md or f"{rows[0]['monte_carlo']['policy']:.0f}" in md


def test_errors_name_the_file_they_are_about(files, capsys):
    tmp, _, policy = files
    no_drafts = edited(tmp, lambda d: d["workload"].update(max_k=0), "k0.yaml")
    refused(capsys, ["tune", str(no_drafts), "--out", str(tmp / "o.yaml")], str(no_drafts), "workload.max_k")
    plain = yaml.safe_load(policy.read_text())
    plain["policy"]["rows"] = [{"batch": [1, 8], "k": 0, "verify_budget": 0, "tier": 8}]
    plain_path = tmp / "plain.yaml"
    plain_path.write_text(yaml.safe_dump(plain))
    refused(capsys, ["export", str(plain_path), "--format", "vllm"], str(plain_path), "K is 0 everywhere")
    bad_acc = yaml.safe_load(policy.read_text())
    bad_acc["acceptance"] = {"source": "curve:0.8", "max_k": 1, "components": [{"weight": 0.5, "accept": [0.8]}]}
    acc_path = tmp / "acc.yaml"
    acc_path.write_text(yaml.safe_dump(bad_acc))
    refused(capsys, ["bench", "--policy", str(acc_path), "--out", str(tmp / "b.json"), "--device", "cpu"],
            str(acc_path), "acceptance.components", "sum to 1")


@pytest.mark.parametrize("error", [
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 1244659712 bytes. Error code 12 (Cannot allocate memory)"),
    type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines"),
])
def test_running_out_of_memory_while_building_is_one_line(tmp_path, capsys, monkeypatch, error):
    from spectune.models import build

    def out_of_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(build, "build_models", out_of_memory)
    out = tmp_path / "p.yaml"
    assert main(["profile", "--target", "tiny", "--out", str(out), "--trials", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("spectune profile: error: out of memory (") and "resumes" in err
    assert not out.exists()


def test_a_runtime_error_that_is_not_memory_is_not_swallowed(tmp_path, monkeypatch):
    from spectune.models import build

    def bug(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(build, "build_models", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["profile", "--target", "tiny", "--out", str(tmp_path / "p.yaml"), "--trials", "4"])
