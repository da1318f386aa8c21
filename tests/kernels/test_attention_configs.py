import json
import math

import pytest
import torch

from spectune.errors import SpectuneError
from spectune.kernels import attention_configs as ac
from spectune.kernels.attention_configs import (
    CAPPED_REGS,
    INTERPRETER_CONFIG,
    AttnConfig,
    ConfigTable,
    ConfigTableError,
    SweepTiming,
    TableEntry,
    candidate_configs,
    default_config,
    heuristic_config,
    load_table,
    pick_winners,
    rescale_splits,
    table_file_name,
    table_for_device,
    table_from_dict,
    time_candidates,
)

H200 = ac.CONFIG_DIR / "NVIDIA_H200.json"


def entry(rows, programs, **cfg):
    return TableEntry(128, rows, programs, AttnConfig(**cfg))


def table_dict(**over):
    d = {"format": ac.TABLE_FORMAT, "device_name": "Test GPU", "sm_count": 10,
         "configs": [{"head_dim": 64, "rows": 16, "programs": 8, "block_n": 32, "num_warps": 4,
                      "num_stages": 2}]}
    d.update(over)
    return d


@pytest.mark.parametrize("field,value", [("block_n", 48), ("block_n", 8), ("num_warps", 3),
                                         ("num_stages", 0), ("block_m", 24), ("num_splits", 65),
                                         ("lazy", 2), ("lazy", -1), ("max_regs", 16), ("max_regs", 256)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ConfigTableError, match=f"^config.{field}:"):
        AttnConfig(**{field: value})
    assert issubclass(ConfigTableError, SpectuneError)


def test_heuristic_follows_the_tile_layout_rules():
    assert heuristic_config(4, 128) == AttnConfig(64, 4, 2)  # one 16-row tile
    assert heuristic_config(32, 128, (9, 0)).block_m == 64  # padded to a wgmma tile on sm_90
    assert heuristic_config(32, 128, (8, 0)) == AttnConfig(32, 2, 3)  # two warps along M elsewhere
    assert heuristic_config(64, 128) == AttnConfig(32, 4, 2, block_m=64, max_regs=CAPPED_REGS)  # 4 CTAs on sm_90
    assert heuristic_config(64, 128, (8, 0)) == AttnConfig(64, 4, 2)  # the cap is measured on sm_90 only
    assert heuristic_config(256, 128) == AttnConfig(64, 8, 2, block_m=128)
    assert heuristic_config(16, 256).block_n == 32


@pytest.mark.parametrize("path", [H200, ac.CONFIG_DIR / "NVIDIA_H100_80GB_HBM3.json"], ids=lambda p: p.stem)
def test_packaged_tables_load_and_cover_the_buckets(path):
    table = load_table(str(path))
    assert table.device_name == path.stem.replace("_", " ") and table.sm_count == 132
    assert table_file_name(table.device_name) == path.name
    assert table_for_device(table.device_name) == table
    assert {e.rows for e in table.entries} >= {4, 8, 16, 32, 64, 128, 256}
    assert all(e.head_dim == 128 for e in table.entries)
    assert path.read_text() == table.to_json()  # the file is in the writer's own format
    for rows in (4, 12, 40, 64, 200):
        for programs in (8, 512, 4096):
            assert table.lookup(128, rows, programs, 132) is not None
    assert table.lookup(64, 16, 512, 132) is None  # another head_dim: no guessing from this table


def test_lookup_takes_the_smallest_bucket_that_holds_the_rows():
    # q = 5 with G = 4 is 20 query rows: the 16-row bucket would split them over two tiles
    # (two KV reads); the 32-row bucket holds them in one
    table = ConfigTable("X", 100, (entry(16, 128, block_n=32), entry(32, 128, block_n=64)))
    assert table.lookup(128, 20, 128, 100).block_n == 64
    assert table.lookup(128, 16, 128, 100).block_n == 32
    assert table.lookup(128, 40, 128, 100).block_n == 64  # beyond every bucket: the largest


def test_lookup_takes_nearest_rows_then_programs():
    table = ConfigTable("X", 100, (entry(16, 128, block_n=32), entry(32, 128, block_n=64),
                                   entry(32, 2048, block_n=128), entry(64, 512, block_n=16)))
    assert table.lookup(128, 24, 1000, 100).block_n == 128  # rows 24 -> 32 (log2), programs -> 2048
    assert table.lookup(128, 24, 100, 100).block_n == 64
    assert table.lookup(128, 4, 100, 100).block_n == 32
    assert table.lookup(128, 100, 100, 100).block_n == 16


def test_rescale_splits_keeps_the_winners_program_count():
    assert rescale_splits(0, 128, 8, 132) == 0  # automatic stays automatic
    assert rescale_splits(3, 128, 128, 132) == 3
    assert rescale_splits(3, 128, 64, 132) == 6  # half the requests: twice the splits
    assert rescale_splits(3, 128, 8, 132) == ac.MAX_SPLITS
    assert rescale_splits(2, 512, 2048, 132) == 1
    assert rescale_splits(1, 512, 1024, 132) == 1
    assert rescale_splits(1, 512, 64, 132) == 0  # an unsplit winner says nothing about a half-empty GPU
    table = ConfigTable("X", 132, (entry(16, 128, num_splits=3),))
    assert table.lookup(128, 16, 64, 132).num_splits == 6


def test_table_round_trip_and_errors_name_file_and_field(tmp_path):
    table = table_from_dict(table_dict(), "t.json")
    assert table.entries[0].config == AttnConfig(32, 4, 2)
    again = table_from_dict(json.loads(table.to_json()), "t2.json")
    assert again == table
    lazy = table_from_dict(table_dict(configs=[{**table_dict()["configs"][0], "lazy": 1}]), "t3.json")
    assert lazy.entries[0].config == AttnConfig(32, 4, 2, lazy=1)
    assert table_from_dict(json.loads(lazy.to_json()), "t4.json") == lazy
    assert lazy.entries[0].config.short().endswith("/lazy")
    cases = [
        (table_dict(extra=1), "t.json: extra: unknown key"),
        (table_dict(format="v0"), "t.json: format:"),
        (table_dict(sm_count=0), "t.json: sm_count:"),
        (table_dict(configs=[]), "t.json: configs:"),
        (table_dict(configs=[{"head_dim": 64, "rows": 16, "programs": 8, "block_n": 32,
                              "num_warps": 4, "num_stages": 2, "colour": 1}]), r"configs\[0\].colour"),
        (table_dict(configs=[{"head_dim": 64, "rows": 16, "programs": 8, "block_n": 33,
                              "num_warps": 4, "num_stages": 2}]), r"configs\[0\]: config.block_n"),
        (table_dict(configs=[{"head_dim": 64, "programs": 8, "block_n": 32, "num_warps": 4,
                              "num_stages": 2}]), r"configs\[0\].rows"),
        (table_dict(configs=[{"head_dim": 64, "rows": 16, "programs": 8, "block_n": 32,
                              "num_warps": 4, "num_stages": 2, "lazy": 3}]), r"configs\[0\]: config.lazy"),
    ]
    for data, message in cases:
        with pytest.raises(ConfigTableError, match=message):
            table_from_dict(data, "t.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigTableError, match="bad.json: cannot read JSON"):
        load_table(str(bad))
    with pytest.raises(ConfigTableError, match="missing.json: file not found"):
        load_table(str(tmp_path / "missing.json"))


def test_env_override_replaces_the_packaged_table(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(table_dict(device_name="NVIDIA H200")))
    monkeypatch.delenv(ac.TABLE_ENV, raising=False)
    table_for_device.cache_clear()
    try:
        assert table_for_device("NVIDIA H200") == load_table(str(H200))  # the packaged one
        assert table_for_device("Unknown GPU 9000") is None
        table_for_device.cache_clear()
        monkeypatch.setenv(ac.TABLE_ENV, str(path))
        assert table_for_device("NVIDIA H200").entries[0].head_dim == 64
    finally:
        table_for_device.cache_clear()


def test_default_config_without_cuda_and_for_named_devices():
    assert default_config(torch.device("cpu"), 64, 128, 512) == INTERPRETER_CONFIG
    # the CUDA path takes only host facts; an unknown GPU falls back to the heuristic
    ac._cuda_config.cache_clear()
    assert ac._cuda_config("Unknown GPU 9000", (8, 0), 108, 32, 128, 512) == heuristic_config(32, 128, (8, 0))
    assert ac._cuda_config("NVIDIA H200", (9, 0), 132, 32, 128, 512) == \
        load_table(str(H200)).lookup(128, 32, 512, 132)


def test_candidates_cover_the_sweep_axes():
    small = candidate_configs(4, 128, 128, 2064, 132)  # batch 16: splitting is on the table
    assert {c.block_n for c in small} == {32, 64, 128}
    assert {c.num_warps for c in small} == {4, 8}
    assert {c.num_stages for c in small} == {2, 3, 4}
    assert {c.num_splits for c in small} == {1, 2, 3, 6}
    assert {c.block_m for c in small} == {16}
    mid = candidate_configs(32, 128, 512, 2064, 132)
    assert {c.block_m for c in mid} == {32, 64} and 2 in {c.num_warps for c in mid}
    assert {c.num_splits for c in mid} == {1, 2}
    assert not any(c.num_warps == 8 and c.block_m < 64 and c.block_n == 32 for c in mid)
    big = candidate_configs(64, 128, 2048, 8208, 132)
    assert {c.block_m for c in big} == {64, 32} and {c.num_splits for c in big} == {1}
    assert len(set(big)) == len(big)
    # q = 16 at batch 64: the base loop's grid (60), and its 64-row tiles of 32 / 64 keys lazy too
    # and 64 x 32 tiles of 4 warps capped at CAPPED_REGS registers (4 CTAs an SM), exact and lazy
    q16 = candidate_configs(64, 128, 512, 2064, 132)
    assert len(q16) == 96 and len(set(q16)) == 96
    lazy = [c for c in q16 if c.lazy]
    assert len(lazy) == 30 and {c.block_m for c in lazy} == {64} and {c.block_n for c in lazy} == {32, 64}
    capped = [c for c in q16 if c.max_regs]
    assert len(capped) == 12 and {(c.block_m, c.block_n, c.num_warps, c.max_regs) for c in capped} == {
        (64, 32, 4, ac.CAPPED_REGS)}
    assert not any(c.lazy or c.max_regs for c in small)
    # the whole sweep grid stays small enough to time in a few minutes
    total = sum(len(candidate_configs(4 * q, 128, 8 * b, ctx + 16, 132))
                for ctx in (2048, 8192) for b in (16, 64, 256) for q in (1, 2, 4, 8, 16))
    assert total < 2500


def test_time_candidates_scores_failures_inf():
    cfgs = [AttnConfig(32), AttnConfig(64), AttnConfig(128)]
    failed = []

    def bench(cfg):
        if cfg.block_n == 128:
            raise RuntimeError("out of resources: shared memory")
        return cfg.block_n / 10

    times = time_candidates(cfgs, bench, on_error=lambda cfg, exc: failed.append((cfg, str(exc))))
    assert times == {cfgs[0]: 3.2, cfgs[1]: 6.4, cfgs[2]: math.inf}
    assert failed == [(cfgs[2], "out of resources: shared memory")]


def test_pick_winners_prefers_the_config_good_at_every_context():
    a, b, c = AttnConfig(32), AttnConfig(64), AttnConfig(128)
    fake = {  # (rows, ctx) -> {config: ms}
        (16, 2048): {a: 1.0, b: 1.05, c: 0.9},
        (16, 8192): {a: 4.0, b: 4.1, c: math.inf},  # c fails at the long context: disqualified
        (64, 2048): {a: 2.0, b: 1.0, c: 3.0},
        (64, 8192): {a: 7.0, b: 4.4, c: 4.0},  # b: 1.0 and 1.1x best; c: 3.0 and 1.0x
    }
    timings = [SweepTiming(128, rows, 512, ctx, cfg, ms)
               for (rows, ctx), times in fake.items() for cfg, ms in times.items()]
    timings.append(SweepTiming(128, 32, 512, 2048, a, math.inf))  # a bucket where everything failed
    winners = {e.rows: e.config for e in pick_winners(timings)}
    assert winners == {16: a, 64: b}


def test_a_register_cap_reads_back_and_a_table_of_one_loads(tmp_path):
    # the cap is back (4 CTAs an SM for 64 x 32 tiles); a table that names it runs it
    entry = {"head_dim": 128, "rows": 64, "programs": 512, "block_n": 32, "num_warps": 4, "num_stages": 2,
             "max_regs": 128, "lazy": 1}
    path = tmp_path / "capped.json"
    path.write_text(json.dumps(table_dict(configs=[entry])))
    cfg = load_table(str(path)).entries[0].config
    assert (cfg.max_regs, cfg.lazy) == (128, 1) and cfg.short().endswith("/lazy/r128")
    assert json.loads(load_table(str(path)).to_json())["configs"][0]["max_regs"] == 128
    plain = table_from_dict(table_dict(), "t.json")
    assert "max_regs" not in json.loads(plain.to_json())["configs"][0]  # only when set


@pytest.mark.parametrize("field,value", [("variant", "qk_ahead")])
def test_tables_naming_a_removed_loop_field_fail_naming_it(tmp_path, field, value):
    # the loop variants are gone; a table written while they existed (with one set on an entry)
    # is refused by the field, not read as the plain loop
    entry = {"head_dim": 128, "rows": 64, "programs": 512, "block_n": 32, "num_warps": 4, "num_stages": 2,
             field: value}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(table_dict(configs=[entry])))
    with pytest.raises(ConfigTableError, match=rf"^{path}: configs\[0\]\.{field}: unknown key \(.* removed\)$"):
        load_table(str(path))
    with pytest.raises(TypeError):
        AttnConfig(**{field: value})
