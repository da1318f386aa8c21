import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from spectune.autotune.export import (
    ExportError,
    engine_k,
    export_schedule,
    export_sglang,
    export_table,
    export_trtllm,
    export_vllm,
    import_sglang,
    import_trtllm,
    import_vllm,
    schedule_from_rows,
    schedule_from_table,
    validate_sglang,
    validate_trtllm,
    validate_vllm,
)
from spectune.autotune.export_sglang import cuda_graph_bs_for, default_cuda_graph_bs, route_sglang
from spectune.autotune.export_trtllm import draft_len_trtllm
from spectune.autotune.export_vllm import lookup_vllm
from spectune.cli import main
from spectune.runtime.planner import Planner
from spectune.runtime.table import read_table

DATA = Path(__file__).parent / "data"
POLICY = DATA / "policy_small.yaml"
SHIPPED = sorted((Path(__file__).parents[2] / "spectune" / "profiles").glob("*.policy.yaml"))
# (format, method, drafter model) as a user of each engine would export
ENGINE_ARGS = [("vllm", "ngram", None), ("vllm", "eagle3", "/models/eagle3"), ("sglang", "EAGLE3", "/models/eagle3"),
               ("trtllm", "eagle3", "/models/eagle3"), ("trtllm", "ngram", None)]


SCHEDULES = [
    [(1, 1, 3)],
    [(1, 8, 7), (9, 16, 4), (17, 32, 2), (33, 64, 0)],
    [(1, 2, 5), (3, 3, 4), (4, 100, 1), (101, 256, 0)],
    [(1, 24, 7), (25, 48, 0), (49, 64, 2)],  # K = 0 in the middle
]


def _k_at(schedule, b):
    return next((k for lo, hi, k in schedule if lo <= b <= hi), 0)  # past the policy: K = 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_round_trip_all_formats(schedule):
    top = schedule[-1][1]
    assert import_vllm(export_vllm(schedule, method="ngram", max_num_seqs=top)) == schedule
    assert import_sglang(export_sglang(schedule), max_batch=top) == schedule
    if schedule[0][2] == max(k for _, _, k in schedule):
        cfg = export_trtllm(schedule, method="ngram", max_batch_size=top)
        assert import_trtllm(cfg) == schedule
        low = export_trtllm(schedule, method="ngram", max_batch_size=top, keys="lower")
        assert import_trtllm(low, keys="lower") == schedule


@pytest.mark.parametrize("schedule", SCHEDULES[:3])
@pytest.mark.parametrize("fmt, method, model", ENGINE_ARGS)
def test_rendered_text_parses_back(schedule, fmt, method, model):
    exp = export_schedule(schedule, fmt, method=method, model=model)
    parsed = yaml.safe_load(exp.text) if fmt == "trtllm" else json.loads(exp.text)
    assert parsed == exp.config


@pytest.mark.parametrize("policy", SHIPPED, ids=lambda p: p.name)
@pytest.mark.parametrize("fmt, method, model", ENGINE_ARGS)
def test_shipped_tables_give_the_policy_k_at_every_batch(policy, fmt, method, model):
    schedule = schedule_from_table(read_table(policy))
    exp = export_schedule(schedule, fmt, method=method, model=model, max_batch=1024)
    got = [engine_k(exp, b) for b in range(1, 1025)]
    want = [_k_at(schedule, b) for b in range(1, 1025)]
    assert got == want


@pytest.mark.parametrize("policy", SHIPPED, ids=lambda p: p.name)
@pytest.mark.parametrize("fmt", ["vllm", "trtllm"])
def test_past_the_rows_the_export_runs_what_the_runtime_planner_runs(policy, fmt):
    # a table tuned to batch 256 exported for an engine that admits 1024: past the rows the engine
    # gets the runtime's own K there (the last row's while the cost model says it pays), not 0
    # while `spectune simulate` and the runtime draft, nor a K they would not run
    table = read_table(policy)
    planner = Planner(table)
    exp = export_table(table, fmt, method="eagle3", model="/models/eagle3", max_batch=1024)
    got = [engine_k(exp, b) for b in range(1, 1025)]
    assert got == [planner.uniform_k(b) for b in range(1, 1025)]
    last = table.workload.max_batch
    assert got[last] == planner.uniform_k(last + 1)


def test_vllm_default_export_covers_max_num_seqs_with_the_planners_k():
    table = read_table(SHIPPED[0])
    exp = export_table(table, "vllm", method="ngram")
    planner = Planner(table)
    assert exp.max_batch == 1024
    assert [engine_k(exp, b) for b in range(1, 1025)] == [planner.uniform_k(b) for b in range(1, 1025)]


def test_vllm_tail_stops_drafting_past_the_policy():
    exp = export_schedule([(1, 8, 7), (9, 256, 2)], "vllm", method="ngram")
    assert exp.config["num_speculative_tokens_per_batch_size"][-1] == [257, 1024, 0]
    assert exp.flags[-2:] == ("--max-num-seqs", "1024")
    # without the tail vLLM keeps the last K (2) up to max_num_seqs
    bare = {"num_speculative_tokens": 7, "num_speculative_tokens_per_batch_size": [[1, 8, 7], [9, 256, 2]]}
    assert lookup_vllm(bare, 1024)[300] == 2 and engine_k(exp, 300) == 0


def test_vllm_lookup_hand_cases_from_vllm_comments():
    # vLLM's own example: [(1, 16, 3), (32, 128, 2)] maps batch sizes 17-31 to K = 3
    cfg = {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 16, 3], [32, 128, 2]]}
    dense = lookup_vllm(cfg, 200)
    assert dense[17] == dense[31] == 3 and dense[32] == 2 and dense[200] == 2
    clamp = {"num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 5]]}
    assert lookup_vllm(clamp, 4)[1:] == [2, 2, 2, 2]


def test_vllm_needs_a_method_and_a_model_where_the_method_does():
    with pytest.raises(ExportError, match="--method is required"):
        export_vllm([(1, 8, 3)], method=None)
    with pytest.raises(ExportError, match="needs --drafter-model"):
        export_vllm([(1, 8, 3)], method="eagle3")
    cfg = export_vllm([(1, 8, 3)], method="eagle3", model="org/eagle3", max_num_seqs=8)
    assert cfg == {"method": "eagle3", "model": "org/eagle3", "num_speculative_tokens": 3,
                   "num_speculative_tokens_per_batch_size": [[1, 8, 3]]}
    assert "model" not in export_vllm([(1, 8, 3)], method="ngram", model="ignored")


def test_sglang_routing_needs_each_range_top_captured():
    # policy K 2 on 97-109, K 3 above: SGLang pads 106 to its captured 112 and routes to slot 110
    schedule = [(1, 96, 4), (97, 109, 2), (110, 256, 3)]
    cfg = export_sglang(schedule)
    default = default_cuda_graph_bs(256)
    assert route_sglang(cfg, default, 106) == 3  # the leak the extra graph sizes fix
    graphs = cuda_graph_bs_for(schedule, 256)
    assert 109 in graphs and set(default) <= set(graphs)
    assert [route_sglang(cfg, graphs, b) for b in (96, 97, 106, 109, 110, 256, 300)] == [4, 2, 2, 2, 3, 3, 0]


def test_sglang_flags_are_consistent_with_the_slots():
    exp = export_schedule([(1, 8, 5), (9, 32, 2)], "sglang", method="eagle3", model="/m/d", config_path="a.json")
    flags = list(exp.flags)
    assert flags[flags.index("--speculative-num-steps") + 1] == "5"
    assert flags[flags.index("--speculative-num-draft-tokens") + 1] == "6"
    assert flags[flags.index("--speculative-adaptive-config") + 1] == "a.json"
    assert exp.config["33"] == {"candidate_steps": [0]}  # past the policy
    with pytest.raises(ExportError, match="EAGLE or EAGLE3"):
        export_schedule([(1, 8, 5)], "sglang", method="ngram", model="/m/d")


def test_trtllm_hand_cases_from_its_docs():
    # the field's own description: {4: 4, 8: 2, 32: 1} -> 1-4: 4, 5-8: 2, 9-32: 1, 33+: 0
    cfg = {"speculative_config": {"decoding_type": "Eagle3", "max_draft_len": 4, "draft_len_schedule": {4: 4, 8: 2, 32: 1}}}
    assert [draft_len_trtllm(cfg, b) for b in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    low = {"speculative_config": {"decoding_type": "NGram", "max_draft_len": 4, "draft_len_schedule": {1: 4, 5: 2}}}
    assert [draft_len_trtllm(low, b, keys="lower") for b in (1, 4, 5, 500)] == [4, 4, 2, 2]


def test_trtllm_config_is_complete():
    cfg = export_trtllm([(1, 4, 4), (5, 8, 2), (9, 32, 1)], method="eagle3", model="/m/e3", max_batch_size=64)
    assert cfg == {"max_batch_size": 64, "speculative_config": {
        "decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model": "/m/e3",
        "draft_len_schedule": {4: 4, 8: 2, 32: 1}}}
    with pytest.raises(ExportError, match="smallest key must map to max_draft_len"):
        export_trtllm([(1, 4, 2), (5, 8, 5)], method="ngram", max_batch_size=8)
    with pytest.raises(ExportError, match="--method is required"):
        export_trtllm([(1, 4, 2)], method=None, max_batch_size=8)


def test_rows_are_merged_into_schedule():
    rows = [SimpleNamespace(batch=b, k=k) for b, k in [((1, 4), 7), ((5, 8), 7), ((9, 16), 4), ((17, 20), 0)]]
    assert schedule_from_rows(rows) == [(1, 8, 7), (9, 16, 4), (17, 20, 0)]
    gap = [SimpleNamespace(batch=(1, 4), k=3), SimpleNamespace(batch=(6, 8), k=1)]
    with pytest.raises(ExportError, match=r"policy.rows\[1\]: gap"):
        schedule_from_rows(gap)


def test_all_zero_k_is_refused():
    for fmt in ("vllm", "sglang", "trtllm"):
        with pytest.raises(ExportError, match="K is 0 everywhere"):
            export_schedule([(1, 64, 0)], fmt, method="ngram")


def test_unknown_engine_version_is_refused():
    with pytest.raises(ExportError, match="rules known for 0.33"):
        export_schedule([(1, 8, 3)], "vllm", method="ngram", engine_version="0.10")
    assert export_schedule([(1, 8, 3)], "vllm", method="ngram", engine_version="0.33.0").engine_version == "0.33"


def _vllm(entries, max_k=5):
    return {"method": "ngram", "num_speculative_tokens": max_k, "num_speculative_tokens_per_batch_size": entries}


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (_vllm([[2, 8, 3]]), "must start at 1"),
        (_vllm([[1, 8, 3], [8, 16, 1]]), "non-overlapping"),
        (_vllm([[1, 8, 3], [10, 16, 1]]), "gap"),
        (_vllm([[1, 8, 6]]), "exceeds num_speculative_tokens"),
        (_vllm([[1, 8, -1]]), "K must be >= 0"),
        (_vllm([[1, 0, 3]]), "must be positive"),
        (_vllm([[4, 2, 3]]), "start 4 > end 2"),
        (_vllm([[1, 8]]), "3-item"),
        (_vllm([[1, "8", 3]]), "integer"),
        (_vllm([]), "non-empty"),
        (_vllm([[1, 8, 0]], max_k=0), "must be > 0"),
        ({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 3]]}, "drafter `model`"),
        ({"method": "eagle3", "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 3]]},
         "drafter `model`"),
    ],
)
def test_vllm_rules(cfg, needle):
    with pytest.raises(ExportError, match=needle):
        validate_vllm(cfg)


@pytest.mark.parametrize(
    "cfg, needle",
    [
        ({"2": {"candidate_steps": [3]}}, "smallest batch-size key must be 1"),
        ({"1": {"candidate_steps": []}}, "non-negative ints"),
        ({"1": {"candidate_steps": [-1]}}, "non-negative ints"),
        ({"1": {"steps": [3]}}, "candidate_steps"),
        ({"ema_alpha": 0.2}, "at least one integer-string"),
    ],
)
def test_sglang_rules(cfg, needle):
    with pytest.raises(ExportError, match=needle):
        validate_sglang(cfg)


def test_sglang_import_multi_candidate_takes_largest():
    cfg = {"1": {"candidate_steps": [1, 3, 7]}, "8": {"candidate_steps": [0, 1]}}
    assert import_sglang(cfg, max_batch=64) == [(1, 7, 7), (8, 64, 1)]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"max_draft_len": 4, "draft_len_schedule": {4: 3, 8: 2}}, "smallest key must map"),
        ({"max_draft_len": 4, "draft_len_schedule": {4: 4, 8: 5}}, "exceeds max_draft_len"),
        ({"max_draft_len": 4, "draft_len_schedule": {0: 4}}, ">= 1"),
        ({"max_draft_len": 4, "draft_len_schedule": {4: 4, 8: -1}}, ">= 0"),
        ({"max_draft_len": 4, "draft_len_schedule": {}}, "non-empty"),
        ({"draft_len_schedule": {4: 4}}, "max_draft_len: missing"),
        ({"max_draft_len": 4, "draft_len_schedule": {4: 4}, "max_concurrency": 8}, "mutually exclusive"),
    ],
)
def test_trtllm_rules(spec, needle):
    with pytest.raises(ExportError, match=needle):
        validate_trtllm({"speculative_config": {"decoding_type": "Eagle3", **spec}})


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_export_stdout(capsys):
    assert main(["export", str(POLICY), "--format", "vllm", "--method", "ngram"]) == 0
    out = capsys.readouterr()
    cfg = json.loads(out.out)
    assert cfg["num_speculative_tokens_per_batch_size"] == [[1, 8, 7], [9, 16, 4], [17, 32, 2], [33, 1024, 0]]
    assert "server flags: --speculative-config" in out.err and "--max-num-seqs 1024" in out.err


def test_cli_export_notes_what_the_table_did_not_measure(tmp_path, capsys):
    assert main(["export", str(POLICY), "--format", "vllm", "--method", "eagle3", "--drafter-model", "/m/e"]) == 0
    assert "note:" not in capsys.readouterr().err  # an EAGLE-3 drafter for an eagle-1l table
    assert main(["export", str(POLICY), "--format", "vllm", "--method", "suffix"]) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "--method suffix runs a n-gram drafter, but the table was tuned for eagle-1l" in err
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text(POLICY.read_text().replace("gpu: NVIDIA H200", "gpu: cpu").replace("target: qwen3-8b", "target: tiny"))
    assert main(["export", str(cpu), "--format", "trtllm", "--method", "mtp"]) == 0
    err = capsys.readouterr().err
    assert "measured on cpu with target tiny: its K are not a GPU's" in err
    assert "runs a mtp drafter, but the table was tuned for eagle-1l" in err


def test_cli_export_without_method_is_one_line(capsys):
    assert main(["export", str(POLICY), "--format", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--method is required" in err


def test_cli_export_out_file(tmp_path, capsys):
    out = tmp_path / "sub" / "trt.yaml"
    assert main(["export", str(POLICY), "--format", "trtllm", "--out", str(out), "--method", "eagle",
                 "--drafter-model", "/m/eagle"]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["speculative_config"]["decoding_type"] == "Eagle"
    assert cfg["max_batch_size"] == 64
    assert import_trtllm(cfg) == [(1, 8, 7), (9, 16, 4), (17, 32, 2), (33, 64, 0)]
    assert [p.name for p in out.parent.iterdir()] == ["trt.yaml"]  # no temporary left behind
    assert f"--extra_llm_api_options {out}" in capsys.readouterr().err


def test_cli_export_bad_policy(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(POLICY.read_text().replace("batch: [9, 16]", "batch: [10, 16]"))
    assert main(["export", str(bad), "--format", "sglang", "--method", "EAGLE3", "--drafter-model", "d"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "bad.yaml" in err and "policy" in err and "gap: starts at 10, expected 9" in err


def test_cli_export_profile_without_policy(tmp_path, capsys):
    data = yaml.safe_load(POLICY.read_text())
    del data["policy"]
    prof = tmp_path / "profile.yaml"
    prof.write_text(yaml.safe_dump(data))
    assert main(["export", str(prof), "--format", "vllm", "--method", "ngram"]) == 2
    assert "has no policy section" in capsys.readouterr().err
