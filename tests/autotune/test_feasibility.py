"""Out-of-memory points in a profile: the tuned table never schedules a step that did not fit."""

import pytest

from spectune.autotune.feasibility import Feasibility
from spectune.autotune.tune_pipeline import tune
from spectune.cli import main
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Planner
from spectune.runtime.table import CapturePoint, Point, read_table, write_table
from tests.tables import make_params, make_profile, make_workload

SMALL = make_params((2.0, 0.01, 64, 0.05, 5.0), (0.02, 0.2, 0.002), (0.05, 0.0))
CAPTURE = [CapturePoint(1, 0.1, 10.0), CapturePoint(64, 0.2, 30.0), CapturePoint(512, 0.6, 120.0)]
ACC = "curve:0.95,0.9,0.85,0.8,0.75,0.7,0.65"


def profile(infeasible=()):
    """Target points at batch 1..64 x q 1..8 timed by SMALL's model; ``infeasible`` (batch, q) have
    no time (out of memory)."""
    cost = CostModel(SMALL, "autoregressive", 256)
    points = [
        Point(
            kind="target",
            batch=b,
            tokens=b * q,
            q=q,
            ms=None if (b, q) in infeasible else cost.target_ms(b * q, b),
        )
        for b in (1, 2, 4, 8, 16, 32, 64)
        for q in (1, 2, 4, 8)
    ]
    w = make_workload(7, 64, target="tiny", dtype="float32", context_len=256, device="cpu")
    return make_profile(SMALL, w, timer="wall-clock", capture=CAPTURE, points=points)


def test_limits_by_hand():
    f = Feasibility(infeasible=((16, 128), (64, 64)), feasible_batches=(1, 2, 4, 8, 16, 32))
    assert f.batch_cap(256) == 32  # plain is out from 64; 32 is the largest batch measured to fit
    assert f.batch_cap(20) == 20
    assert f.fits(15, 1000) and f.fits(64, 63) and not f.fits(16, 128) and not f.fits(100, 100)
    assert f.tiers([8, 64, 120, 128, 256], 32) == [8, 64, 120]
    assert f.tiers([8, 64, 120, 128, 256], 8) == [8, 64, 120, 128, 256]  # (16, 128) is past batch 8
    assert Feasibility((), (1, 2)).batch_cap(64) == 64
    with pytest.raises(SpectuneError, match="did not fit at any measured batch"):
        Feasibility(((1, 1),), ()).batch_cap(8)


def test_limits_scale_with_the_served_context():
    f = Feasibility(infeasible=((16, 128), (64, 64)), feasible_batches=(1, 2, 4, 8, 16, 32))
    assert f.at_context(2048, None) is f and f.at_context(2048, 2048) is f
    short = f.at_context(2048, 320)  # 6.4x the requests in the same KV memory
    assert short.infeasible == ((103, 128), (410, 64)) and short.feasible_batches == (6, 12, 25, 51, 102, 204)
    assert short.batch_cap(256) == 102  # plain at 128 requests (128 tokens) is past (103, 128)
    assert short.fits(102, 1000) and not short.fits(103, 128) and short.fits(409, 63)
    long = f.at_context(2048, 4096)  # half
    assert long.infeasible == ((8, 128), (32, 64)) and long.batch_cap(256) == 16
    assert Feasibility((), (1, 2)).at_context(2048, 320).batch_cap(64) == 64


def test_tune_at_a_shorter_context_serves_the_batches_the_memory_holds():
    # out of memory from batch 64 at the profile's context 256: at 64 the same memory holds 4x the
    # requests, so the table serves the whole requested range; at 1024 a quarter
    oom = profile(infeasible={(64, 1), (64, 2), (64, 4), (64, 8), (16, 8), (32, 8)})
    at_profile = tune(oom, ACC, trials=6)
    short = tune(oom, ACC, trials=6, context_len=64)
    long = tune(oom, ACC, trials=6, context_len=1024)
    assert at_profile.batch_cap == 32
    assert short.batch_cap is None and short.table.workload.max_batch == 64
    assert short.table.policy.rows[-1].batch[1] == 64
    assert long.batch_cap is not None and long.table.workload.max_batch < 32
    feas = Feasibility.of(oom.costs.points)
    for res, ctx in ((short, 64), (long, 1024)):
        scaled = feas.at_context(256, ctx)
        assert all(scaled.fits(b, t) for b, t in shapes(res.table))


def shapes(table):
    """Every (batch, tier) the table's planner can run: rows, and each batch's candidates."""
    planner = Planner(table)
    out = set()
    for b in range(1, table.workload.max_batch + 1):
        out.add((b, planner.plan(b).tier))
        out.update((b, p.tier) for p, _ in planner._cands[b])
    return out


def test_tuned_table_never_schedules_a_step_that_did_not_fit():
    free = tune(profile(), ACC, trials=6)
    assert free.batch_cap is None and free.table.workload.max_batch == 64
    assert max(free.table.policy.tiers) >= 128  # without the points, shapes past them are scheduled
    res = tune(
        profile(infeasible={(64, 1), (64, 2), (64, 4), (64, 8), (16, 8), (32, 8)}), ACC, trials=6
    )
    table = res.table
    assert (
        res.batch_cap == 32
        and table.workload.max_batch == 32
        and table.policy.rows[-1].batch[1] == 32
    )
    assert max(table.policy.tiers) < 128 and res.dropped_tiers and min(res.dropped_tiers) >= 128
    feas = Feasibility.of(table.costs.points)
    assert all(feas.fits(b, t) for b, t in shapes(table))


def test_cli_tune_says_what_the_out_of_memory_points_cut(tmp_path, capsys):
    prof = tmp_path / "oom.yaml"
    write_table(profile(infeasible={(64, 1), (64, 2), (64, 4), (64, 8)}), prof)
    out = tmp_path / "policy.yaml"
    assert (
        main(
            [
                "tune",
                str(prof),
                "--acceptance",
                ACC,
                "--out",
                str(out),
                "--trials",
                "4",
                "--no-progress",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "rows end at batch 32" in err
    assert read_table(out).policy.rows[-1].batch[1] == 32
