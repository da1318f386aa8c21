import json

import pytest
import torch
import yaml

from spectune.cli import main

SMALL = ["--batch-sizes", "1,2", "--max-k", "1", "--context-len", "16", "--trials", "0", "--no-progress",
         "--device", "cpu"]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "tiny.yaml"
    assert main(["profile", "--target", "tiny", "--out", str(out), *SMALL]) == 0
    return out


def test_profile_smoke(profile, capsys):
    assert profile.exists() and profile.with_suffix(".csv").exists()
    assert profile.with_name(profile.name + ".journal").exists()
    assert main(["validate", str(profile), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["valid"] is True and info["kind"] == "profile" and info["rows"] == 0
    assert (info["gpu"], info["target"], info["drafter"]) == ("cpu", "tiny", "eagle-1l")
    assert info["cost_model"]["held_out"] >= 1
    data = yaml.safe_load(profile.read_text())
    assert data["workload"]["max_batch"] == 2 and data["costs"]["timer"] == "wall-clock"
    assert data["costs"]["model"]["overhead"]["source"] == "pack-reference"


def test_profile_rerun_resumes_without_measuring(profile, capsys):
    # the finished study is in the journal: a second run measures nothing and rewrites the same points
    before = yaml.safe_load(profile.read_text())["costs"]["points"]
    assert main(["profile", "--target", "tiny", "--out", str(profile), *SMALL]) == 0
    assert yaml.safe_load(profile.read_text())["costs"]["points"] == before


def test_profile_with_fp8_target_projections(tmp_path, monkeypatch, capsys):
    from spectune.models import build

    built = []
    real = build.build_models
    monkeypatch.setattr(build, "build_models", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    out = tmp_path / "fp8.yaml"
    assert main(["profile", "--target", "tiny", "--dtype", "fp8", "--out", str(out), *SMALL]) == 0
    (models,) = built
    assert models.fp8 and models.dtype is torch.bfloat16
    assert type(models.target.layers[0].attn.wqkv).__name__ == "Fp8Linear"
    assert type(models.drafter.layers[0].attn.wqkv).__name__ == "Parameter"  # the drafter stays bf16
    assert yaml.safe_load(out.read_text())["workload"]["dtype"] == "fp8"
    assert main(["validate", str(out)]) == 0


def test_show(profile, capsys):
    assert main(["show", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "workload: tiny + eagle-1l" in out and "TargetCost" in out and "q=2" in out


def one_error_line(capsys, command):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"spectune {command}: error: ")
    return err


@pytest.mark.parametrize("argv,needle", [
    (["--batch-sizes", "0-3"], "--batch-sizes"),
    (["--batch-sizes", "4-2"], "--batch-sizes"),
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--target", "nonsense"], "nonsense"),
    (["--drafter", "medusa"], "medusa"),
    (["--max-k", "0"], "--max-k"),
    (["--device", "cuda:7"] if not __import__("torch").cuda.is_available() else ["--device", "tpu"], "--device"),
    (["--storage", "redis://x"], "storage"),
])
def test_profile_bad_input(tmp_path, capsys, argv, needle):
    out = tmp_path / "p.yaml"
    assert main(["profile", "--out", str(out), "--no-progress", *argv]) == 2
    assert needle in one_error_line(capsys, "profile")
    assert not out.exists() and not out.with_suffix(".csv").exists()


@pytest.mark.parametrize("content,needle", [
    (None, "cannot read"),
    ("schema: [unclosed\n", "not valid YAML"),
    ("schema: spectune/1\n", "hardware: missing"),
])
@pytest.mark.parametrize("command", ["validate", "show"])
def test_bad_files(tmp_path, capsys, content, needle, command):
    path = tmp_path / "t.yaml"
    if content is not None:
        path.write_text(content)
    assert main([command, str(path)]) == 2
    err = one_error_line(capsys, command)
    assert needle in err and str(path) in err


def test_validate_names_the_field(profile, tmp_path, capsys):
    data = yaml.safe_load(profile.read_text())
    data["costs"]["model"]["target"]["weight_ms"] = "fast"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["validate", str(bad), "--json"]) == 2
    assert "costs.model.target.weight_ms" in one_error_line(capsys, "validate")
    assert capsys.readouterr().out == ""


def test_batch_sizes_forms():
    from spectune.autotune.profiler import parse_batch_sizes

    assert parse_batch_sizes("1-4") == (1, 2, 3, 4)
    assert parse_batch_sizes("1,2,4,8") == (1, 2, 4, 8)
    assert parse_batch_sizes("1-3,16,32") == (1, 2, 3, 16, 32)


@pytest.mark.gpu
def test_profile_on_gpu_uses_graphs(tmp_path, capsys):
    out = tmp_path / "gpu.yaml"
    argv = ["profile", "--target", "tiny", "--device", "cuda", "--batch-sizes", "1-4", "--max-k", "2",
            "--context-len", "64", "--trials", "2", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    data = yaml.safe_load(out.read_text())
    assert data["costs"]["timer"] == "cuda-graph" and data["workload"]["device"] == "cuda"
    assert data["costs"]["capture"] and data["costs"]["model"]["overhead"]["source"] == "pack-kernel"
    assert data["hardware"]["gpu"] != "cpu"


@pytest.mark.parametrize("command", ["simulate", "bench"])
def test_a_fixed_k_past_the_tables_max_k_is_refused(tmp_path, capsys, command):
    # a row at K 9 of a max_k 3 table would charge K 9's drafter with K 3's acceptance
    from tests.engine.test_engine import write_policy

    policy = write_policy(tmp_path / "p.yaml")
    out = tmp_path / "r.json"
    extra = ["--out", str(out), "--device", "cpu", "--no-progress"] if command == "bench" else []
    argv = [command, *(["--policy"] if command == "bench" else []), str(policy), "--concurrency", "2",
            "--arms", "fixed:3,fixed:9", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "arm 'fixed:9': past the table's workload.max_k 3 (fixed:K in 0..3)" in err
    assert not out.exists()


def test_simulate_json_rows_and_default_arms(tmp_path, capsys, monkeypatch):
    from spectune.runtime import planner as planner_mod
    from tests.engine.test_engine import write_policy

    policy = write_policy(tmp_path / "p.yaml")
    loads, fresh = [], []
    real, real_fresh = planner_mod.load, planner_mod.Planner.fresh
    monkeypatch.setattr(planner_mod, "load", lambda *a, **kw: loads.append(1) or real(*a, **kw))
    monkeypatch.setattr(planner_mod.Planner, "fresh", lambda self: fresh.append(self) or real_fresh(self))
    argv = ["simulate", str(policy), "--acceptance", "curve:0.5,0.25,0.12", "--concurrency", "1,4",
            "--requests", "8", "--repeats", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["acceptance"] == "curve:0.5,0.25,0.12" and out["tuned_acceptance"] == "curve:0.8,0.6,0.45"
    arms = [r["arm"] for r in out["rows"] if r["concurrency"] == 1]
    assert arms == ["plain", "fixed:1", "fixed:2", "fixed:3", "auto"]  # max_k 3: every fixed K
    # the table read once; a fresh planner of it for whatif, then one per auto run (2 seeds x 2 c)
    assert len(loads) == 1 and len(fresh) == 1 + 2 * 2 and len({id(p) for p in fresh}) == 1
    for r in out["rows"]:
        assert r["goodput_tok_s"] > 0 and r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert (r["ratio_vs_best_other"] is not None) == (r["arm"] == "auto")
    auto = next(r for r in out["rows"] if r["arm"] == "auto" and r["concurrency"] == 4)
    best = max(r["goodput_tok_s"] for r in out["rows"] if r["concurrency"] == 4 and r["arm"] != "auto")
    assert auto["ratio_vs_best_other"] == pytest.approx(auto["goodput_tok_s"] / best)
    best_full = max(r["full_tok_s"] for r in out["rows"] if r["concurrency"] == 4 and r["arm"] != "auto")
    assert auto["full_ratio_vs_best_other"] == pytest.approx(auto["full_tok_s"] / best_full)
    assert main(["simulate", str(policy), "--concurrency", "2", "--arms", "plain,auto", "--requests", "4",
                 "--drift", "curve:0.9,0.8,curve:0.3,0.1"]) == 0
    text = capsys.readouterr().out
    assert "served: drift: curve:0.9,0.8 -> curve:0.3,0.1" in text and "auto" in text
    # the bench's protocol: one planner, trained first, serves both seeds; shorter requests
    loads.clear()
    fresh.clear()
    assert main(["simulate", str(policy), "--acceptance", "curve:0.5,0.25,0.12", "--concurrency", "4",
                 "--arms", "fixed:1,auto", "--requests", "8", "--repeats", "2", "--decode-tokens", "16",
                 "--shared-planner", "--json"]) == 0
    shared = json.loads(capsys.readouterr().out)
    assert len(loads) == 1 and len(fresh) == 1 + 1  # the table; whatif's fresh planner, then the one trained
    fixed = next(r for r in shared["rows"] if r["arm"] == "fixed:1")
    long = next(r for r in out["rows"] if r["arm"] == "fixed:1" and r["concurrency"] == 4)
    assert fixed["goodput_tok_s"] > 0 and fixed != long


@pytest.mark.parametrize("argv,needle", [
    (["--arms", "plain,greedy"], "--arms"),
    (["--concurrency", "0"], "--concurrency"),
    (["--drift", "curve:0.9,0.8"], "--drift"),
    (["--acceptance", "nonsense"], "nonsense"),
    (["--repeats", "0"], "--repeats"),
    (["--decode-tokens", "0"], "--decode-tokens"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--prompt-len", "many"], "--prompt-len"),
    (["--prompt-len", str(1 << 20)], "--prompt-len"),  # past any profiled context
    (["--served-cost", "missing-profile.yaml"], "missing-profile.yaml"),
])
def test_simulate_bad_input(tmp_path, capsys, argv, needle):
    from tests.engine.test_engine import write_policy

    policy = write_policy(tmp_path / "p.yaml")
    assert main(["simulate", str(policy), *argv]) == 2
    assert needle in one_error_line(capsys, "simulate")
    assert main(["simulate", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in one_error_line(capsys, "simulate")


def simulate_json(capsys, *argv: str) -> dict:
    """``spectune simulate ... --json``'s output, parsed (the run must succeed)."""
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_prompt_len_adds_end_to_end(tmp_path, capsys):
    from tests.engine.test_engine import write_policy

    policy = write_policy(tmp_path / "p.yaml")
    base = ["simulate", str(policy), "--acceptance", "curve:0.5,0.25,0.12", "--concurrency", "4",
            "--arms", "plain,fixed:2,auto", "--requests", "8", "--repeats", "1", "--json"]
    assert main(base) == 0
    decode_only = json.loads(capsys.readouterr().out)
    assert decode_only["prompt_len"] is None and all(r["output_tok_s"] is None for r in decode_only["rows"])
    assert main([*base, "--prompt-len", "64"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert main([*base, "--prompt-len", "2048"]) == 0
    long = json.loads(capsys.readouterr().out)
    assert short["prompt_len"] == 64
    for a, b, c in zip(decode_only["rows"], short["rows"], long["rows"], strict=True):
        assert a["goodput_tok_s"] == b["goodput_tok_s"] == c["goodput_tok_s"]  # the decode run is the same
        assert 0 < c["output_tok_s"] < b["output_tok_s"]  # longer prompts cost more end to end
    assert main([*base[:-1], "--prompt-len", "64"]) == 0
    assert "e2e" in capsys.readouterr().out


def test_simulate_mixed_prefill_rides_the_prompts(tmp_path, capsys):
    from tests.engine.test_engine import write_policy

    policy = write_policy(tmp_path / "p.yaml")
    base = ["simulate", str(policy), "--acceptance", "curve:0.5,0.25,0.12", "--concurrency", "4",
            "--arms", "plain,fixed:2", "--requests", "8", "--repeats", "1", "--prompt-len", "64", "--json"]
    assert main(base) == 0
    separate = json.loads(capsys.readouterr().out)
    assert separate["mixed_prefill"] is None
    assert main([*base, "--mixed-prefill", "--prefill-budget", "128", "--ride-limit", "4096", "--no-admit-ahead"]) == 0
    riding = json.loads(capsys.readouterr().out)
    assert riding["mixed_prefill"] == {"budget": 128, "ride_limit": 4096, "admit_ahead": False}
    for a, b in zip(separate["rows"], riding["rows"], strict=True):
        assert b["output_tok_s"] > 0 and b["output_tok_s"] != a["output_tok_s"]
        assert b["goodput_tok_s"] != a["goodput_tok_s"]  # the riding steps are decode steps
    # admitted ahead (mixed prefill's default): a request's successor rides beside its last step
    assert main([*base, "--mixed-prefill", "--prefill-budget", "128", "--ride-limit", "4096"]) == 0
    ahead = json.loads(capsys.readouterr().out)
    assert ahead["mixed_prefill"]["admit_ahead"] is True
    assert main([*base, "--mixed-prefill", "--prefill-budget", "128", "--ride-limit", "4096", "--admit-ahead"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == ahead["rows"]
    for a, b in zip(riding["rows"], ahead["rows"], strict=True):
        assert b["output_tok_s"] > 0 and b["output_tok_s"] != a["output_tok_s"]
    # a ride limit below every admission: the prompts take separate forwards, as without riding
    assert main([*base, "--mixed-prefill", "--ride-limit", "1"]) == 0
    bursts = json.loads(capsys.readouterr().out)
    for a, b in zip(separate["rows"], bursts["rows"], strict=True):
        assert b["output_tok_s"] == pytest.approx(a["output_tok_s"]) and b["goodput_tok_s"] == pytest.approx(
            a["goodput_tok_s"])


def test_simulate_host_lag_plays_the_engines_idle_rows(tmp_path, capsys):
    from tests.engine.test_engine import write_policy

    base = [str(write_policy(tmp_path / "p.yaml")), "--acceptance", "curve:0.9,0.81,0.73", "--concurrency", "1,4",
            "--arms", "plain,fixed:2", "--requests", "12", "--repeats", "2"]
    now, late = simulate_json(capsys, *base), simulate_json(capsys, *base, "--host-lag")
    assert now["host_lag"] is False and late["host_lag"] is True
    for a, b in zip(now["rows"], late["rows"], strict=True):
        if b["arm"] == "plain":  # one token a step: every end is foreseen
            assert b["goodput_tok_s"] == pytest.approx(a["goodput_tok_s"])
        else:  # requests that end on a multi-token step ride one more step idle
            assert b["goodput_tok_s"] < a["goodput_tok_s"]


@pytest.mark.parametrize("argv,needle", [
    (["--mixed-prefill"], "--prompt-len"),
    (["--prompt-len", "64", "--prefill-budget", "128"], "--prefill-budget"),
    (["--prompt-len", "64", "--ride-limit", "128"], "--ride-limit"),
    (["--prompt-len", "64", "--admit-ahead"], "--admit-ahead"),
    (["--prompt-len", "64", "--no-admit-ahead"], "--no-admit-ahead"),
    (["--prompt-len", "64", "--mixed-prefill", "--prefill-budget", "0"], "--prefill-budget"),
    (["--prompt-len", "64", "--mixed-prefill", "--ride-limit", "x"], "--ride-limit"),
])
def test_simulate_mixed_prefill_bad_input(tmp_path, capsys, argv, needle):
    from tests.engine.test_engine import write_policy

    policy = write_policy(tmp_path / "p.yaml")
    assert main(["simulate", str(policy), "--concurrency", "2", *argv]) == 2
    assert needle in one_error_line(capsys, "simulate")


def test_simulate_served_cost_plays_another_profiles_step_times(tmp_path, capsys):
    """``--served-cost``: the policy plans on its own table, the runs are timed by the other
    profile's cost model; a profile of another target is refused in one line."""
    from tests.engine.test_engine import write_policy
    from tests.tables import write_profile_like

    policy = write_policy(tmp_path / "p.yaml")
    write_profile_like(policy, tmp_path / "slow.yaml", weight_factor=2.0)
    argv = ["simulate", str(policy), "--concurrency", "4", "--arms", "plain,auto", "--requests", "8", "--json"]
    assert main(argv) == 0
    own = json.loads(capsys.readouterr().out)
    assert main([*argv, "--served-cost", str(tmp_path / "slow.yaml")]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["served_cost"] == str(tmp_path / "slow.yaml") and own["served_cost"] is None
    plain = [next(r["goodput_tok_s"] for r in o["rows"] if r["arm"] == "plain") for o in (own, other)]
    assert plain[1] < 0.75 * plain[0]  # plain decoding is a weight read: twice the weight time
    write_profile_like(policy, tmp_path / "other.yaml", weight_factor=2.0, target="another")
    assert main([*argv, "--served-cost", str(tmp_path / "other.yaml")]) == 2
    assert "workload.target" in one_error_line(capsys, "simulate")


def test_status_and_collect_merge_the_study(profile, tmp_path, capsys):
    journal = str(profile) + ".journal"
    assert main(["status", "--storage", journal]) == 0
    out = capsys.readouterr().out
    assert "0 claimed, 0 waiting, 0 remaining" in out and "complete" in out and "worker " in out
    name = out.split(":")[0]
    merged = tmp_path / "merged.yaml"
    assert main(["profile", "--storage", journal, "--study-name", name, "--collect", "--out", str(merged)]) == 0
    assert f"collected study {name}" in capsys.readouterr().out
    assert yaml.safe_load(merged.read_text())["costs"]["points"] == yaml.safe_load(profile.read_text())["costs"]["points"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["profile", "--workers", "two"], "--workers: expected a number or auto"),
    (["profile", "--workers", "-1"], "--workers: must be >= 1"),
    (["profile", "--collect"], "--collect: needs --storage and --study-name"),
    (["status", "--storage", "postgresql://x/y", "--repair"], "--repair: only a journal file"),
])
def test_scale_out_options_bad_input(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_collect_of_a_missing_study_names_it(profile, capsys):
    journal = str(profile) + ".journal"
    assert main(["profile", "--storage", journal, "--study-name", "nope", "--collect"]) == 2
    assert "no study 'nope'" in capsys.readouterr().err


def test_collect_from_a_storage_that_does_not_exist_creates_nothing(tmp_path, capsys):
    journal = tmp_path / "nodir" / "x.journal"
    assert main(["profile", "--storage", str(journal), "--study-name", "s", "--collect",
                 "--out", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"storage {journal}: no such journal file" in err
    assert list(tmp_path.iterdir()) == []


def test_fused_option_reaches_the_models_and_the_study_identity(monkeypatch):
    from spectune.autotune import profiler
    from spectune.cli import _profile_config, build_parser
    from spectune.models import build

    args = build_parser().parse_args(["profile", "--target", "tiny", "--fused", *SMALL])
    config = _profile_config(args, None)
    assert config.fused
    built = []
    real = build.build_models
    monkeypatch.setattr(build, "build_models", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    profiler.model_point_factory(profiler.resolve(config))
    (models,) = built
    assert models.fused and models.target.fused and models.drafter.fused
    s = profiler.setup(config)
    assert s.identity["fused"] is True and s.identity["attention"] == "torch_folded+fused"
    plain = profiler.setup(_profile_config(build_parser().parse_args(["profile", "--target", "tiny", *SMALL]), None))
    assert "fused" not in plain.identity and plain.identity["attention"] == "torch_folded"
    bench = build_parser().parse_args(["bench", "--policy", "p.yaml", "--out", "r.json", "--fused"])
    assert bench.fused


def test_python_dash_m_spectune_is_the_command(tmp_path):
    import subprocess
    import sys

    # bad input through `python -m spectune`: the command's one-line error and exit code 2
    out = subprocess.run([sys.executable, "-m", "spectune", "validate", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "missing.yaml" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
