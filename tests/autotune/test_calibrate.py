"""spectune calibrate on result files written in the engines' own output formats
(vllm/benchmarks/latency.py, vllm/benchmarks/serve.py, sglang/benchmark/one_batch.py and
serving.py): a hidden engine whose costs differ from the profile by known factors."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from spectune.autotune.calibrate import (
    CalibrationError,
    EnginePoint,
    calibrate_profile,
    read_engine_results,
)
from spectune.cli import main
from spectune.runtime.costs import CostModel
from spectune.runtime.table import read_table

PROFILE = Path(__file__).parents[2] / "spectune" / "profiles" / "nvidia-h200_qwen3-8b_eagle-1l.yaml"
TRUE = {"weight": 1.3, "token": 0.8, "drafter": 1.6}  # the user's engine vs the reference engine


def _engine_ms(model, b, k, ctx, rng):
    n = b * (k + 1)
    w = model.params.target.weight_ms
    ms = (
        TRUE["weight"] * w
        + TRUE["token"] * (model.target_ms(n, b, ctx) - w + model.overhead_ms(n))
        + TRUE["drafter"] * model.drafter_ms(b, k, ctx)
    )
    return ms * (1 + rng.normal(0, 0.01))


def _write_results(tmp_path, model):
    rng = np.random.default_rng(0)
    files = []
    for b in (1, 4, 16, 64):  # vllm bench latency --output-json, lengths in the selector
        out = 128
        lat = [_engine_ms(model, b, 0, 32 + out / 2, rng) * out / 1e3 for _ in range(3)]
        f = tmp_path / f"lat-b{b}.json"
        f.write_text(
            json.dumps(
                {
                    "model_id": "qwen3-8b",
                    "avg_latency": float(np.mean(lat)),
                    "latencies": lat,
                    "percentiles": {"50": float(np.median(lat))},
                }
            )
        )
        files.append(f"{f}#batch={b}&input=32&output={out}")
    for conc in (1, 8, 32):  # vllm bench serve --save-result at K = 3 (acceptance length 2.5)
        for k in (3,):
            step = _engine_ms(model, conc, k, 1024 + 128, rng)
            drafts = 1000
            f = tmp_path / f"serve-c{conc}-k{k}.json"
            f.write_text(
                json.dumps(
                    {
                        "max_concurrency": conc,
                        "completed": 100,
                        "total_input_tokens": 102400,
                        "total_output_tokens": 25600,
                        "median_tpot_ms": step / 2.5,
                        "mean_tpot_ms": step / 2.5,
                        "spec_decode_num_drafts": drafts,
                        "spec_decode_draft_tokens": drafts * k,
                        "spec_decode_accepted_tokens": int(1.5 * drafts),
                        "spec_decode_acceptance_length": 2.5,
                    }
                )
            )
            files.append(str(f))
    lines = []  # sglang bench_one_batch result.jsonl
    for b in (2, 8, 128):
        lines.append(
            json.dumps(
                {
                    "run_name": "default",
                    "batch_size": b,
                    "input_len": 256,
                    "output_len": 64,
                    "prefill_latency": 0.05,
                    "median_decode_latency": _engine_ms(model, b, 0, 288, rng) / 1e3,
                }
            )
        )
    f = tmp_path / "result.jsonl"
    f.write_text("\n".join(lines) + "\n")
    files.append(str(f))
    f = tmp_path / "sglang-serving.jsonl"  # sglang bench_serving at speculative_num_steps 5
    f.write_text(
        json.dumps(
            {
                "max_concurrency": 16,
                "completed": 50,
                "total_input_tokens": 51200,
                "total_output_tokens": 12800,
                "median_tpot_ms": _engine_ms(model, 16, 5, 1152, rng) / 3.0,
                "accept_length": 3.0,
                "server_info": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 5},
            }
        )
        + "\n"
    )
    files.append(str(f))
    return files


def test_reads_each_engine_format(tmp_path):
    model = CostModel.of(read_table(PROFILE), residuals=False)
    files = _write_results(tmp_path, model)
    pts = [p for spec in files for p in read_engine_results(spec)]
    assert len(pts) == 4 + 3 + 3 + 1
    serve = [p for p in pts if "serve-c8" in p.source][0]
    assert (serve.batch, serve.k, serve.context) == (8, 3, 1024 + 128)
    sgl = [p for p in pts if "sglang-serving" in p.source][0]
    assert (sgl.batch, sgl.k) == (16, 5)
    assert [p.batch for p in pts if "result.jsonl" in p.source] == [2, 8, 128]


def test_calibration_recovers_the_engine_and_reports_held_out_error(tmp_path):
    table = read_table(PROFILE)
    model = CostModel.of(table, residuals=False)
    pts = [p for spec in _write_results(tmp_path, model) for p in read_engine_results(spec)]
    cal = calibrate_profile(table, pts)
    for key, want in TRUE.items():
        assert cal.scales[key] == pytest.approx(want, rel=0.1)
    assert cal.held_out == len(pts) // 3
    assert cal.error_after[0] < 0.03 < cal.error_before[0]
    assert cal.table.policy is None and cal.table.costs.error.held_out == cal.held_out
    new = CostModel.of(cal.table, residuals=False)
    p = EnginePoint("x", 24, 2, 600.0, 0.0)
    want = _engine_ms(model, p.batch, p.k, p.context, np.random.default_rng(1)) / (
        1 + 0
    )  # ~1 % noise
    got = new.step_ms(p.batch, p.k, p.batch * 3, p.context)
    assert got == pytest.approx(want, rel=0.05)


def test_cli_calibrate_then_tune(tmp_path, capsys):
    model = CostModel.of(read_table(PROFILE), residuals=False)
    files = _write_results(tmp_path, model)
    out = tmp_path / "calibrated.yaml"
    assert main(["calibrate", str(PROFILE), "--engine-results", *files, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "held-out points: median" in text and "uncalibrated" in text
    policy = tmp_path / "policy.yaml"
    assert (
        main(
            [
                "tune",
                str(out),
                "--acceptance",
                "curve:0.8,0.7,0.6",
                "--out",
                str(policy),
                "--trials",
                "2",
            ]
        )
        == 0
    )
    assert read_table(policy).policy is not None


def test_bad_result_files_are_one_line(tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps({"avg_latency": 1.0, "latencies": [1.0], "percentiles": {}}))
    with pytest.raises(CalibrationError, match="names no batch size"):
        read_engine_results(str(lat))
    # vLLM's own record of the run's arguments beside it (SAVE_TO_PYTORCH_BENCHMARK_FORMAT=1)
    (tmp_path / "lat.pytorch.json").write_text(
        json.dumps(
            [
                {
                    "benchmark": {
                        "name": "vLLM benchmark",
                        "extra_info": {
                            "args": {
                                "batch_size": 4,
                                "input_len": 32,
                                "output_len": 100,
                                "speculative_config": None,
                            }
                        },
                    },
                    "model": {"name": "m"},
                    "metric": {"name": "latency", "benchmark_values": [1.0]},
                }
            ]
        )
    )
    (p,) = read_engine_results(str(lat))
    assert (p.batch, p.k, p.context, p.ms) == (4, 0, 82.0, 10.0)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"foo": 1}))
    assert (
        main(
            [
                "calibrate",
                str(PROFILE),
                "--engine-results",
                str(other),
                "--out",
                str(tmp_path / "o.yaml"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "other.json" in err
    assert not (tmp_path / "o.yaml").exists()
    serve = tmp_path / "serve.json"
    serve.write_text(
        json.dumps(
            {
                "median_tpot_ms": 5.0,
                "completed": 1,
                "total_input_tokens": 1,
                "total_output_tokens": 1,
                "max_concurrency": None,
            }
        )
    )
    with pytest.raises(CalibrationError, match="max_concurrency"):
        read_engine_results(str(serve))


def _dynamic_sd_profile(tmp_path, model, batches=(1, 4, 16, 64, 256), ks=(0, 1, 3, 5), context=384):
    # what vllm/v1/spec_decode/dynamic/generate_config.py writes: DynamicSpeculativeConfig.model_dump()
    # with batch_stats[batch][K] = median ITL (ms) of `vllm bench serve` at that max concurrency and
    # K (0: no speculation); json.dump turns the integer keys into strings
    rng = np.random.default_rng(2)
    stats = {b: {k: _engine_ms(model, b, k, context, rng) for k in ks} for b in batches}
    f = tmp_path / "dynamic_speculative_config.json"
    f.write_text(
        json.dumps(
            {
                "is_online": False,
                "max_num_speculative_tokens": max(ks),
                "acceptance_rate_per_pos": [0.8, 0.6, 0.45, 0.3, 0.2][: max(ks)],
                "batch_stats": stats,
            },
            indent=4,
        )
    )
    return f


def test_vllm_dynamic_sd_profile_calibrates(tmp_path):
    table = read_table(PROFILE)
    model = CostModel.of(table, residuals=False)
    f = _dynamic_sd_profile(tmp_path, model)
    pts = read_engine_results(f"{f}#context=384")
    assert sorted((p.batch, p.k) for p in pts) == sorted(
        (b, k) for b in (1, 4, 16, 64, 256) for k in (0, 1, 3, 5)
    )
    assert all(p.context == 384 for p in pts)
    cal = calibrate_profile(table, pts)
    for key, want in TRUE.items():
        assert cal.scales[key] == pytest.approx(want, rel=0.1)
    assert cal.error_after[0] < 0.03 < cal.error_before[0]


def test_vllm_dynamic_sd_profile_bad_input_is_one_line(tmp_path, capsys):
    model = CostModel.of(read_table(PROFILE), residuals=False)
    f = _dynamic_sd_profile(tmp_path, model, batches=(1, 8), ks=(0, 2))
    with pytest.raises(CalibrationError, match="context"):
        read_engine_results(str(f))
    obj = json.loads(f.read_text())
    for bad, match in (
        ({"1": {"two": 5.0}}, "'two'"),
        ({"0": {"0": 5.0}}, "'0'"),
        ({"1": {"0": -1}}, "must be a number > 0"),
        ({"1": {"0": "fast"}}, "must be a number"),
        ({}, "non-empty"),
        ({"1": []}, "non-empty"),
    ):
        f.write_text(json.dumps(dict(obj, batch_stats=bad)))
        with pytest.raises(CalibrationError, match=match):
            read_engine_results(f"{f}#context=100")
    out = tmp_path / "o.yaml"
    assert (
        main(["calibrate", str(PROFILE), "--engine-results", f"{f}#context=100", "--out", str(out)])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f.name in err
    assert not out.exists()


def _cli_refuses(tmp_path, capsys, *specs, name=None):
    """`spectune calibrate` on the engine results: exit 2, one line naming the file, no profile."""
    out = tmp_path / "refused.yaml"
    assert main(["calibrate", str(PROFILE), "--engine-results", *specs, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and (name or Path(specs[-1].partition("#")[0]).name) in err
    assert not out.exists()
    return err


def _rewrite(src, dst, drop=(), **fields):
    # an engine result with fields changed or dropped
    obj = dict(json.loads(src.read_text()), **fields)
    dst.write_text(json.dumps({k: v for k, v in obj.items() if k not in drop}))
    return dst


def test_sglang_pd_router_server_info_is_read_from_the_decode_servers(tmp_path, capsys):
    # a PD router's /server_info: {"prefill": [...], "decode": [...]}; serving.py reads "decode"[0]
    model = CostModel.of(read_table(PROFILE), residuals=False)
    files = _write_results(tmp_path, model)
    src = tmp_path / "sglang-serving.jsonl"
    (want,) = read_engine_results(str(src))
    info = json.loads(src.read_text())["server_info"]
    pd = _rewrite(src, tmp_path / "pd.jsonl", server_info={"prefill": [{}], "decode": [info]})
    (got,) = read_engine_results(str(pd))
    assert (got.batch, got.k, got.ms) == (want.batch, 5, want.ms)
    for decode, match in (
        ([], "server_info.decode"),
        ([{"speculative_algorithm": "EAGLE3"}], "server_info.decode\\[0\\].speculative_num_steps"),
    ):
        _rewrite(src, pd, server_info={"decode": decode})
        with pytest.raises(CalibrationError, match=match):
            read_engine_results(str(pd))
    assert "server_info.decode" in _cli_refuses(tmp_path, capsys, *files[:-1], str(pd))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"drop": ["spec_decode_num_drafts"]},
            "'spec_decode_num_drafts' must be an integer >= 1, got None",
        ),
        ({"spec_decode_num_drafts": 0, "spec_decode_draft_tokens": 0}, "'spec_decode_num_drafts'"),
        ({"spec_decode_num_drafts": "1000"}, "'spec_decode_num_drafts'"),
        ({"drop": ["spec_decode_draft_tokens"]}, "'spec_decode_draft_tokens' must be an integer"),
        ({"spec_decode_draft_tokens": None}, "'spec_decode_draft_tokens' must be an integer"),
        ({"spec_decode_draft_tokens": 3500}, "drafts per step varied"),
        ({"drop": ["spec_decode_acceptance_length"]}, "'spec_decode_acceptance_length'"),
        (
            {"spec_decode_acceptance_length": 50},
            "'spec_decode_acceptance_length' must be a number in \\[1, 4\\]",
        ),
        (
            {"spec_decode_acceptance_length": 0},
            "'spec_decode_acceptance_length' must be a number in \\[1, 4\\]",
        ),
        ({"median_tpot_ms": -1.0}, "'median_tpot_ms' must be a number > 0"),
        ({"completed": 0}, "'completed' must be an integer >= 1"),
        ({"max_concurrency": 8.5}, "'max_concurrency' must be an integer >= 1"),
    ],
)
def test_vllm_serve_speculation_fields_resolve_k_or_are_refused(tmp_path, capsys, fields, match):
    # vLLM writes the spec_decode_* fields together (serve.py): K = draft tokens / drafts, and
    # the acceptance length (TPOT -> step) lies in [1, K + 1]; none may fall back to K = 0
    model = CostModel.of(read_table(PROFILE), residuals=False)
    files = _write_results(tmp_path, model)
    bad = _rewrite(tmp_path / "serve-c8-k3.json", tmp_path / "serve-bad.json", **fields)
    with pytest.raises(CalibrationError, match=match):
        read_engine_results(str(bad))
    _cli_refuses(tmp_path, capsys, *files, str(bad))


def test_unreadable_or_empty_result_files_are_one_line(tmp_path, capsys):
    model = CostModel.of(read_table(PROFILE), residuals=False)
    files = _write_results(tmp_path, model)
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n \n")
    gz = tmp_path / "result.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "result.jsonl").read_bytes()))
    utf16 = tmp_path / "utf16.json"
    utf16.write_text((tmp_path / "serve-c8-k3.json").read_text(), encoding="utf-16")
    for f, match in ((empty, "no result"), (blank, "no result"), (gz, "gzip"), (utf16, "UTF-8")):
        with pytest.raises(CalibrationError, match=match):
            read_engine_results(str(f))
        _cli_refuses(tmp_path, capsys, *files, str(f))
    bom = tmp_path / "bom.json"  # a UTF-8 byte-order mark is still UTF-8
    bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "serve-c8-k3.json").read_bytes())
    assert read_engine_results(str(bom))[0].k == 3


def test_latency_arguments_and_latencies_are_checked(tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps({"avg_latency": 1.0, "latencies": [1.0], "percentiles": {}}))
    pt = tmp_path / "lat.pytorch.json"
    args = {"batch_size": 4, "input_len": 32, "output_len": 100}
    for text, match in (
        ("{not json", "lat.pytorch.json: not JSON"),
        ("[]", "lat.pytorch.json: field '\\[0\\].benchmark.extra_info.args'"),
        ('[{"benchmark": {}}]', "lat.pytorch.json: field '\\[0\\].benchmark.extra_info.args'"),
        (
            json.dumps([{"benchmark": {"extra_info": {"args": dict(args, input_len=None)}}}]),
            "names no input length",
        ),
        (
            json.dumps([{"benchmark": {"extra_info": {"args": dict(args, batch_size="4")}}}]),
            "'args.batch_size' must be an integer >= 1",
        ),
    ):
        pt.write_text(text)
        with pytest.raises(CalibrationError, match=match):
            read_engine_results(str(lat))
        _cli_refuses(tmp_path, capsys, str(lat), name="lat.")
    pt.unlink()
    for latencies in (["a"], [None], [0.5, -1.0]):
        lat.write_text(json.dumps({"avg_latency": 1.0, "latencies": latencies, "percentiles": {}}))
        with pytest.raises(
            CalibrationError, match="field 'latencies\\[\\d\\]' must be a number > 0"
        ):
            read_engine_results(f"{lat}#batch=1&input=32&output=128")
        _cli_refuses(tmp_path, capsys, f"{lat}#batch=1&input=32&output=128")


def test_sglang_server_info_and_accept_length_are_checked(tmp_path, capsys):
    model = CostModel.of(read_table(PROFILE), residuals=False)
    _write_results(tmp_path, model)
    src = tmp_path / "sglang-serving.jsonl"
    bad = tmp_path / "sgl-bad.jsonl"
    for fields, match in (
        ({"server_info": [1]}, "'server_info' must be an object or null, got list"),
        (
            {"server_info": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": "five"}},
            "'server_info.speculative_num_steps' must be an integer >= 1, got 'five'",
        ),
        ({"accept_length": 9.0}, "'accept_length' must be a number in \\[1, 6\\]"),
        ({"accept_length": "3"}, "'accept_length' must be a number"),
        (
            {"server_info": {"speculative_algorithm": None}},
            "'accept_length' is 3.0 but server_info",
        ),
        ({"server_info": None}, "#k=K"),  # SGLang writes null when /server_info failed
    ):
        _rewrite(src, bad, **fields)
        with pytest.raises(CalibrationError, match=match):
            read_engine_results(str(bad))
        _cli_refuses(tmp_path, capsys, str(bad))
    # a null server_info: the selector names K; without speculation no accept_length is needed
    (p,) = read_engine_results(f"{bad}#k=5")
    assert p.k == 5 and p.ms == pytest.approx(json.loads(src.read_text())["median_tpot_ms"] * 3.0)
    (p,) = read_engine_results(str(_rewrite(src, bad, server_info=None, accept_length=None)))
    assert p.k == 0


def test_selector_fills_in_only_what_the_file_does_not_record(tmp_path, capsys):
    model = CostModel.of(read_table(PROFILE), residuals=False)
    files = _write_results(tmp_path, model)
    lat, serve = f"{tmp_path / 'lat-b1.json'}", f"{tmp_path / 'serve-c8-k3.json'}"
    for spec, match in (
        (f"{lat}#batch=0&input=32&output=128", "batch must be >= 1"),
        (f"{lat}#batch=1&input=32&output=0", "output must be >= 1"),
        (f"{serve}#batch=4&k=7", "selector batch=4 does not apply to a vllm bench serve result"),
        (f"{serve}#k=3", "does not apply"),
        (f"{lat}#batch=1&input=32&output=128&k=3", "selector k=3 does not apply"),
        (f"{tmp_path / 'result.jsonl'}#batch=2", "does not apply to a sglang bench_one_batch"),
        (
            f"{tmp_path / 'sglang-serving.jsonl'}#k=4",
            "k=4 contradicts the file's server_info.speculative_num_steps 5",
        ),
    ):
        with pytest.raises(CalibrationError, match=match):
            read_engine_results(spec)
        _cli_refuses(tmp_path, capsys, *files, spec)
    assert read_engine_results(f"{tmp_path / 'sglang-serving.jsonl'}#k=5")[0].k == 5
    # beside vLLM's own record of the run, the selector may repeat it but not contradict it
    (tmp_path / "lat-b1.pytorch.json").write_text(
        json.dumps(
            [
                {
                    "benchmark": {
                        "extra_info": {
                            "args": {"batch_size": 1, "input_len": 32, "output_len": 128}
                        }
                    }
                }
            ]
        )
    )
    assert read_engine_results(f"{lat}#batch=1")[0].batch == 1
    with pytest.raises(
        CalibrationError, match="batch=4 contradicts the file's lat-b1.pytorch.json batch_size 1"
    ):
        read_engine_results(f"{lat}#batch=4&input=32&output=128")
