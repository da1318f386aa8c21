import pytest
import yaml

from spectune.errors import TableError
from spectune.runtime.schema import to_dict
from spectune.runtime.table import (
    CapturePoint,
    CostError,
    CostModelParams,
    DrafterCost,
    Hardware,
    Online,
    OverheadCost,
    Point,
    Policy,
    PowerModel,
    Row,
    Software,
    TargetCost,
    read_table,
    table_from_dict,
    table_to_yaml,
    write_table,
)
from tests.tables import make_profile, make_workload


def full_table():
    return make_profile(
        CostModelParams(
            target=TargetCost(5.1, 0.002, 142.0, 0.023, 32.3, kv_verify_ms_per_mtok=1.5),
            drafter=DrafterCost(0.01, 0.42, 0.003),
            overhead=OverheadCost(0.05, 0.0004, source="pack-kernel"),
            power=PowerModel(idle_w=120.0, busy_w=650.0, saturate_tokens=512.0),
        ),
        make_workload(max_k=15, max_batch=256),  # qwen3-8b, eagle-1l autoregressive, bfloat16, 2048 context
        hardware=Hardware(gpu="NVIDIA H200", capability="9.0", driver="580.159.04", memory_gib=139.8,
                          power_limit_w=700.0, sm_count=132),
        software=Software(spectune="0.1.0", torch="2.11.0", triton="3.6.0", python="3.11.7", cuda="13.0"),
        error=CostError(held_out=12, median_rel=0.021, max_rel=0.07),
        capture=[CapturePoint(tokens=16, seconds=0.4, mib=12.0), CapturePoint(tokens=512, seconds=0.9, mib=80.0)],
        points=[Point(kind="target", batch=4, tokens=8, ms=5.9, q=2, joules=0.1, power_w=300.0,
                      sm_clock_mhz=1980, throttle=0),
                Point(kind="drafter", batch=256, tokens=3840, ms=None, k=15, held_out=True)],
        measurements="h200.csv",
        acceptance={"source": "curve:0.8,0.6", "max_k": 2, "components": [{"weight": 1.0, "accept": [0.8, 0.75]}]},
        policy=Policy(
            tiers=[16, 64, 512],
            rows=[Row(batch=(1, 8), k=7, verify_budget=56, tier=64, gain=1.8),
                  Row(batch=(9, 64), k=3, verify_budget=192, tier=512),
                  Row(batch=(65, 256), k=0, verify_budget=0)],
            online=Online(window=1000.0, margin=0.02),
        ),
        created="2026-01-01T00:00:00+00:00",
    )


def as_dict():
    return yaml.safe_load(table_to_yaml(full_table()))


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "t.yaml"
    write_table(full_table(), path)
    assert read_table(path) == full_table()
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed away


def test_profile_without_policy_round_trips(tmp_path):
    from dataclasses import replace

    profile = replace(full_table(), policy=None, acceptance=None)
    write_table(profile, tmp_path / "p.yaml")
    text = (tmp_path / "p.yaml").read_text()
    assert "policy" not in yaml.safe_load(text)
    assert read_table(tmp_path / "p.yaml") == profile and not profile.is_policy


def test_older_file_without_new_optional_fields_reads():
    d = as_dict()
    del d["costs"]["model"]["target"]["kv_verify_ms_per_mtok"]
    del d["costs"]["model"]["overhead"]["source"]
    t = table_from_dict(d)
    assert t.costs.model.target.kv_verify_ms_per_mtok == 0.0 and t.costs.model.overhead.source is None


def edit(fn):
    d = as_dict()
    fn(d)
    return d


@pytest.mark.parametrize("mutate,field,reason", [
    (lambda d: d["hardware"].update(gpus=1), "hardware.gpus", "unknown key"),
    (lambda d: d["workload"].update(max_k="many"), "workload.max_k", "integer"),
    (lambda d: d["costs"]["model"]["target"].update(weight_ms="x"), "costs.model.target.weight_ms", "number"),
    (lambda d: d["costs"]["model"]["target"].update(compute_ms=-1.0), "costs.model.target.compute_ms", ">= 0"),
    (lambda d: d["costs"]["error"].pop("max_rel"), "costs.error.max_rel", "missing"),
    (lambda d: d.pop("workload"), "workload", "missing"),
    (lambda d: d.update(schema="spectune/0"), "schema", "unsupported version"),
    (lambda d: d["workload"].update(dtype="int4"), "workload.dtype", "must be one of"),
    (lambda d: d["costs"]["points"][0].update(kind="bogus"), "costs.points[0].kind", "must be one of"),
    (lambda d: d["policy"]["rows"][1].update(batch=[10, 64]), "policy.rows[1].batch", "gap"),
    (lambda d: d["policy"]["rows"][1].update(batch=[8, 64]), "policy.rows[1].batch", "overlap"),
    (lambda d: d["policy"]["rows"][0].update(k=16, verify_budget=16), "policy.rows[0].k", "max_k"),
    (lambda d: d["policy"]["rows"][2].update(batch=[65, 200]), "policy.rows", "max_batch"),
    (lambda d: d["policy"].update(tiers=[64, 16, 512]), "policy.tiers", "increasing"),
    (lambda d: d["policy"]["rows"][0].update(tier=128), "policy.rows[0].tier", "not a captured tier"),
    (lambda d: d["policy"]["online"].update(window=0.0), "policy.online.window", "> 1"),
    (lambda d: d["policy"]["online"].update(ema=0.05), "policy.online.ema", "re-run `spectune tune`"),
    (lambda d: d["policy"]["online"].update(adapt_range=[1.2, 1.3]), "policy.online.adapt_range", "0 < lo <= 1 <= hi"),
])
def test_validation_names_the_field(mutate, field, reason):
    with pytest.raises(TableError) as info:
        table_from_dict(edit(mutate), "t.yaml")
    assert info.value.field == field
    assert reason in info.value.reason
    assert str(info.value).startswith("t.yaml: ") and "\n" not in str(info.value)


def test_unreadable_and_bad_yaml_files(tmp_path):
    with pytest.raises(TableError, match="cannot read"):
        read_table(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: [unclosed\n")
    with pytest.raises(TableError, match="not valid YAML"):
        read_table(bad)
    bad.write_text("- a list\n")
    with pytest.raises(TableError, match="must be a mapping"):
        read_table(bad)


def test_to_dict_is_plain_yaml():
    d = to_dict(full_table())
    assert d["policy"]["rows"][0]["batch"] == [1, 8]
    assert yaml.safe_load(yaml.safe_dump(d)) == d
