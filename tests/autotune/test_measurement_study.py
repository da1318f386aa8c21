import zlib
from collections import Counter
from types import SimpleNamespace

import optuna
import pytest

from spectune.autotune.measurement_study import (
    InfeasiblePoint,
    PointSpec,
    StudyPlan,
    grid_batches,
    held_out_points,
    run_study,
    seed_points,
)
from spectune.runtime.costs import drafter_ms, overhead_ms, target_ms
from spectune.runtime.table import DrafterCost, OverheadCost, TargetCost

CTX = 1024
TRUE_T = TargetCost(weight_ms=4.0, token_ms=0.002, knee_tokens=96, compute_ms=0.03, kv_ms_per_mtok=40.0)
TRUE_D = DrafterCost(fixed_ms=0.05, step_ms=0.4, token_ms=0.004)
TRUE_O = OverheadCost(base_ms=0.05, token_ms=0.0005)


def roofline_ms(p: PointSpec) -> float:
    if p.kind == "drafter":
        ms = drafter_ms(TRUE_D, "autoregressive", p.batch, p.k, CTX)
    elif p.kind == "overhead":
        ms = overhead_ms(TRUE_O, p.tokens)
    else:
        ms = target_ms(TRUE_T, p.tokens, p.batch, CTX)
    noise = (zlib.crc32(p.key.encode()) % 1001 - 500) / 500 * 0.005  # +-0.5%, fixed per point
    return ms * (1 + noise)


class FakeRoofline:
    """Timer over the synthetic roofline; counts completed measurements per point key."""

    def __init__(self, interrupt_after=None, infeasible_batch=None):
        self.calls = Counter()
        self.interrupt_after = interrupt_after
        self.infeasible_batch = infeasible_batch

    def __call__(self, step: PointSpec):
        if self.interrupt_after is not None and sum(self.calls.values()) >= self.interrupt_after:
            raise KeyboardInterrupt
        if self.infeasible_batch is not None and step.batch > self.infeasible_batch:
            raise InfeasiblePoint(f"out of memory at batch {step.batch}")
        self.calls[step.key] += 1
        ms = roofline_ms(step)
        cap = (0.01 * step.tokens, 2.0 + step.tokens / 64) if step.kind == "tier" else (None, None)
        return SimpleNamespace(median_ms=ms, p20_ms=ms * 0.99, p80_ms=ms * 1.01, reps=20, mode="fake",
                               capture_s=cap[0], capture_mib=cap[1])


def plan(**kw):
    base = dict(batch_sizes=tuple(range(1, 65)), max_k=7, drafter_kind="autoregressive", context_len=CTX,
                adaptive_trials=8, held_out=12, seed=3)
    return StudyPlan(**(base | kw))


@pytest.fixture(params=["memory", "journal"])
def storage(request, tmp_path):
    if request.param == "memory":
        return optuna.storages.InMemoryStorage()
    return str(tmp_path / "study.journal")


def run(p, timer, storage):
    return run_study(p, lambda spec: spec, timer, storage=storage, study_name="test", progress=False)


def test_plan_is_sparse_and_held_out_is_off_grid():
    p = plan()
    grid = set(grid_batches(p.batch_sizes))
    assert grid == {1, 2, 4, 8, 16, 32, 64}
    held = held_out_points(p)
    assert len(held) >= 10 and all(h.batch not in grid and h.held_out for h in held)
    assert len(seed_points(p)) < 0.2 * len(p.batch_sizes) * (p.max_k + 1)  # not a full grid


def test_study_completes_and_fits(storage):
    timer = FakeRoofline()
    res = run(plan(), timer, storage)
    t = res.params.target
    assert t.weight_ms == pytest.approx(TRUE_T.weight_ms, rel=0.03)
    assert t.kv_ms_per_mtok == pytest.approx(TRUE_T.kv_ms_per_mtok, rel=0.1)
    assert res.error.held_out >= 10
    assert res.error.median_rel < 0.01 and res.error.max_rel < 0.03
    adaptive = [r for r in res.records if r["phase"] == "adaptive"]
    assert len(adaptive) == 8 and all(r["key"] not in {s.key for s in seed_points(plan())} for r in adaptive)
    assert max(timer.calls.values()) == 1
    tiers = [r for r in res.records if r["kind"] == "tier"]
    assert tiers and all(r["capture_mib"] > 0 for r in tiers)


def test_resume_does_not_remeasure(storage):
    first = FakeRoofline(interrupt_after=25)
    with pytest.raises(KeyboardInterrupt):
        run(plan(), first, storage)
    second = FakeRoofline()
    res = run(plan(), second, storage)
    assert not set(first.calls) & set(second.calls)  # nothing measured twice
    assert sum(first.calls.values()) == 25
    assert len(res.records) == sum(first.calls.values()) + sum(second.calls.values())
    again = FakeRoofline()
    run(plan(), again, storage)  # finished study: nothing left to measure
    assert sum(again.calls.values()) == 0


def test_infeasible_points_recorded_and_excluded():
    timer = FakeRoofline(infeasible_batch=40)
    res = run(plan(), timer, None)
    bad = [r for r in res.records if not r["feasible"]]
    assert bad and all(r["batch"] > 40 and r["ms"] is None and "out of memory" in r["error"] for r in bad)
    assert res.params.target.weight_ms == pytest.approx(TRUE_T.weight_ms, rel=0.05)
    assert res.error.held_out == sum(1 for r in res.records if r["held_out"] and r["feasible"] and r["kind"] != "overhead")


def test_held_out_error_matches_records():
    res = run(plan(adaptive_trials=0), FakeRoofline(), None)
    from spectune.autotune.fit import relative_errors
    from spectune.runtime.costs import CostModel

    held = [r for r in res.records if r["held_out"]]
    errs = relative_errors(CostModel(res.params, "autoregressive", CTX), held)
    assert res.error.held_out == len(held) >= 10
    assert res.error.max_rel == pytest.approx(max(errs))


def test_sqlite_storage_resumes(tmp_path):
    # RDB storage is slow on a small disk (a commit per write): a small plan only
    small = plan(batch_sizes=(1, 2, 3, 4), max_k=2, adaptive_trials=2, held_out=3)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = FakeRoofline(interrupt_after=6)
    with pytest.raises(KeyboardInterrupt):
        run(small, first, url)
    second = FakeRoofline()
    res = run(small, second, url)
    assert not set(first.calls) & set(second.calls)
    assert res.error.held_out == 3


def test_bad_storage_url_names_storage():
    from spectune.autotune.measurement_study import StudyError, open_storage

    with pytest.raises(StudyError, match="storage"):
        open_storage("redis://localhost/0")


class FakePower:
    """NVML stand-in: power rises with the step's tokens, saturating at 256."""

    available = True

    def __init__(self):
        self.tokens = 0

    def measure(self):
        import contextlib

        @contextlib.contextmanager
        def region():
            reading = SimpleNamespace()
            yield reading
            watts = 100.0 + 500.0 * min(1.0, self.tokens / 256)
            reading.__dict__.update(energy_j=watts * 0.01, mean_power_w=watts, max_power_w=watts + 5,
                                    sm_clock_mhz=1980, throttle_reasons=4, throttle_names=["sw_power_cap"])
        return region()


def test_nvml_readings_and_build_time_oom():
    import torch

    power = FakePower()

    def measure_point(spec):
        if spec.kind == "target" and spec.batch == 64 and spec.q == 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        power.tokens = spec.tokens
        return spec

    res = run_study(plan(adaptive_trials=0), measure_point, FakeRoofline(), power=power, progress=False)
    rec = next(r for r in res.records if r["key"] == "target:b=4:q=2")
    assert rec["power_w"] == pytest.approx(100 + 500 * 8 / 256) and rec["throttle_names"] == ["sw_power_cap"]
    oom = next(r for r in res.records if r["key"] == "target:b=64:q=8")
    assert not oom["feasible"] and "out of memory" in oom["error"]
    assert res.params.power.busy_w == pytest.approx(600.0, rel=0.02)
    assert res.params.power.idle_w == pytest.approx(100.0, rel=0.05)
