import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from spectune.autotune.export import (
    ExportError,
    export_schedule,
    export_sglang,
    export_trtllm,
    export_vllm,
    import_sglang,
    import_trtllm,
    import_vllm,
    render,
    schedule_from_rows,
    validate_sglang,
    validate_trtllm,
    validate_vllm,
)
from spectune.cli import main

DATA = Path(__file__).parent / "data"
POLICY = DATA / "policy_small.yaml"

SCHEDULES = [
    [(1, 1, 3)],
    [(1, 8, 7), (9, 16, 4), (17, 32, 2), (33, 64, 0)],
    [(1, 2, 5), (3, 3, 5 - 1), (4, 100, 1), (101, 256, 0)],
    [(1, 24, 7), (25, 48, 0), (49, 64, 2)],  # K = 0 in the middle
]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_round_trip_all_formats(schedule):
    assert import_vllm(export_vllm(schedule)) == schedule
    assert import_sglang(export_sglang(schedule), max_batch=schedule[-1][1]) == schedule
    assert import_trtllm(export_trtllm(schedule)) == schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("fmt", ["vllm", "sglang", "trtllm"])
def test_rendered_text_parses_back(schedule, fmt):
    cfg = export_schedule(schedule, fmt)
    text = render(fmt, cfg)
    parsed = yaml.safe_load(text) if fmt == "trtllm" else json.loads(text)
    assert parsed == cfg


def test_rows_are_merged_into_schedule():
    rows = [SimpleNamespace(batch=b, k=k) for b, k in [((1, 4), 7), ((5, 8), 7), ((9, 16), 4), ((17, 20), 0)]]
    assert schedule_from_rows(rows) == [(1, 8, 7), (9, 16, 4), (17, 20, 0)]
    gap = [SimpleNamespace(batch=(1, 4), k=3), SimpleNamespace(batch=(6, 8), k=1)]
    with pytest.raises(ExportError, match=r"policy.rows\[1\]: gap"):
        schedule_from_rows(gap)


def test_vllm_config_shape_and_placeholders():
    cfg = export_vllm([(1, 8, 7), (9, 64, 0)], method="eagle3", model="org/drafter")
    assert cfg == {
        "method": "eagle3",
        "model": "org/drafter",
        "num_speculative_tokens": 7,
        "num_speculative_tokens_per_batch_size": [[1, 8, 7], [9, 64, 0]],
    }
    assert "method" not in export_vllm([(1, 8, 7)])


def test_trtllm_keys_are_upper_bounds():
    cfg = export_trtllm([(1, 4, 4), (5, 8, 2), (9, 32, 1)])
    assert cfg["speculative_config"] == {"max_draft_len": 4, "draft_len_schedule": {4: 4, 8: 2, 32: 1}}


def test_trtllm_needs_largest_k_first():
    with pytest.raises(ExportError, match="smallest key must map to max_draft_len"):
        export_trtllm([(1, 4, 2), (5, 8, 5)])


def test_all_zero_k_is_refused():
    for fmt in ("vllm", "sglang", "trtllm"):
        with pytest.raises(ExportError, match="K is 0 everywhere"):
            export_schedule([(1, 64, 0)], fmt)


def _vllm(entries, max_k=5):
    return {"num_speculative_tokens": max_k, "num_speculative_tokens_per_batch_size": entries}


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
        ({"strategy": "ema"}, "at least one integer-string"),
        ({"strategy": "fast", "1": {"candidate_steps": [3]}}, "strategy"),
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
    ],
)
def test_trtllm_rules(spec, needle):
    with pytest.raises(ExportError, match=needle):
        validate_trtllm({"speculative_config": spec})


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_export_stdout(capsys):
    assert main(["export", str(POLICY), "--format", "vllm"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["num_speculative_tokens_per_batch_size"] == [[1, 8, 7], [9, 16, 4], [17, 32, 2], [33, 64, 0]]


def test_cli_export_out_file(tmp_path):
    out = tmp_path / "sub" / "trt.yaml"
    assert main(["export", str(POLICY), "--format", "trtllm", "--out", str(out), "--method", "Eagle"]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["speculative_config"]["decoding_type"] == "Eagle"
    assert import_trtllm(cfg) == [(1, 8, 7), (9, 16, 4), (17, 32, 2), (33, 64, 0)]
    assert [p.name for p in out.parent.iterdir()] == ["trt.yaml"]  # no temporary left behind


def test_cli_export_bad_policy(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(POLICY.read_text().replace("batch: [9, 16]", "batch: [10, 16]"))
    assert main(["export", str(bad), "--format", "sglang"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "bad.yaml" in err and "policy" in err and "gap: starts at 10, expected 9" in err


def test_cli_export_profile_without_policy(tmp_path, capsys):
    data = yaml.safe_load(POLICY.read_text())
    del data["policy"]
    prof = tmp_path / "profile.yaml"
    prof.write_text(yaml.safe_dump(data))
    assert main(["export", str(prof), "--format", "vllm"]) == 2
    assert "has no policy section" in capsys.readouterr().err
