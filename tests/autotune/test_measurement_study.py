import zlib
from collections import Counter
from pathlib import Path
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

    def __init__(self, interrupt_after=None, infeasible_batch=None, infeasible_above=None, held_infeasible=False):
        self.calls = Counter()
        self.interrupt_after = interrupt_after
        self.infeasible_batch = infeasible_batch
        self.infeasible_above = infeasible_above  # batch * tokens past which a point is out of memory
        self.held_infeasible = held_infeasible

    def __call__(self, step: PointSpec):
        if self.interrupt_after is not None and sum(self.calls.values()) >= self.interrupt_after:
            raise KeyboardInterrupt
        if self.infeasible_batch is not None and step.batch > self.infeasible_batch:
            raise InfeasiblePoint(f"out of memory at batch {step.batch}")
        if self.infeasible_above is not None and step.batch * step.tokens > self.infeasible_above:
            raise InfeasiblePoint(f"out of memory at {step.batch} x {step.tokens}")
        if self.held_infeasible and step.held_out:
            raise InfeasiblePoint("out of memory")
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


# --- infeasible held-out points are replaced ----------------------------------------------------

CAP = 10_000  # batch * tokens: 6 of plan()'s 12 held-out points are past it, as on an H200 with qwen3-32b


def held_keys(res):
    return [r["key"] for r in res.records if r["held_out"]]


def test_infeasible_held_out_points_are_replaced(storage):
    p = plan()
    planned = held_out_points(p)
    assert sum(pt.batch * pt.tokens > CAP for pt in planned) == 6
    res = run(p, FakeRoofline(infeasible_above=CAP), storage)
    held = [r for r in res.records if r["held_out"]]
    assert [r["key"] for r in held[:12]] == [pt.key for pt in planned]  # the planned ones first, as planned
    new = held[12:]
    assert len(new) >= 6 and all(r["phase"] == "held_out" for r in new)
    assert res.error.held_out == sum(r["feasible"] for r in held) == 12
    # below the smallest infeasible batch of that model (at any token count) before the replacements
    first = [r for r in res.records if r["phase"] == "seed" or r["key"] in {pt.key for pt in planned}]
    for r in new:
        kinds = ("drafter",) if r["kind"] == "drafter" else ("target", "tier")
        assert r["batch"] < min(x["batch"] for x in first if not x["feasible"] and x["kind"] in kinds)
    fitted = {r["key"] for r in res.records if not r["held_out"]}
    assert not {r["key"].removesuffix(":held") for r in new} & fitted  # never a fitted point's shape
    assert len(set(held_keys(res))) == len(held)


def test_status_counts_the_replacements(tmp_path):
    from spectune.autotune.study_status import study_status

    journal = str(tmp_path / "s.journal")
    res = run(plan(), FakeRoofline(infeasible_above=CAP), journal)
    (st,) = study_status(journal)
    assert st.total == len(res.records) > plan().total_points and st.complete


def test_all_feasible_held_out_points_are_the_planned_ones():
    res = run(plan(), FakeRoofline(), None)
    assert held_keys(res) == [pt.key for pt in held_out_points(plan())]


def test_resumed_study_makes_the_same_replacements(tmp_path):
    whole = held_keys(run(plan(), FakeRoofline(infeasible_above=CAP), None))
    assert len(whole) > 12
    p = plan()
    before = sum(pt.batch * pt.tokens <= CAP for pt in seed_points(p) + held_out_points(p))
    for stop in (before - 1, before, before + 2):  # the last planned point, the first replacement, later
        journal = str(tmp_path / f"s{stop}.journal")
        with pytest.raises(KeyboardInterrupt):
            run(p, FakeRoofline(interrupt_after=stop, infeasible_above=CAP), journal)
        second = FakeRoofline(infeasible_above=CAP)
        res = run(p, second, journal)
        assert held_keys(res) == whole and max(second.calls.values()) == 1


def test_held_out_replacements_are_bounded():
    from spectune.autotune.measurement_plan import held_out_budget

    p = plan()
    res = run(p, FakeRoofline(held_infeasible=True), None)
    assert len(held_keys(res)) == held_out_budget(p) == 36 and res.error.held_out == 0
    assert sum(1 for r in res.records if r["phase"] == "adaptive") == p.adaptive_trials


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


def test_an_unreachable_database_is_not_taken_for_a_missing_driver(monkeypatch):
    import builtins

    from spectune.autotune.measurement_study import StudyError, open_storage

    pytest.importorskip("psycopg")
    url = "postgresql://u@nonexistent-host.invalid/db"
    with pytest.raises(StudyError, match="cannot open") as err:  # the driver is there: the host is not
        open_storage(url, heartbeat_s=60, grace_s=120)
    assert "pip install" not in str(err.value) and "\n" not in str(err.value)
    real = builtins.__import__

    def no_psycopg(name, *args, **kwargs):
        if name.split(".")[0] in ("psycopg", "psycopg2"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psycopg)
    with pytest.raises(StudyError, match=r'pip install "spectune\[postgres\]"'):
        open_storage(url, heartbeat_s=60, grace_s=120)


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


# --- storage you can trust: identity, torn journal lines, resume, budget -------------------------


def small(**kw):
    return plan(**({"batch_sizes": tuple(range(1, 9)), "max_k": 3, "adaptive_trials": 4, "held_out": 4} | kw))


@pytest.mark.parametrize(("change", "needle"), [
    ({"batch_sizes": (1, 2, 3, 4)}, "--batch-sizes '1-8' there, '1-4' here"),
    ({"seed": 9}, "--seed 3 there, 9 here"),
    ({"max_k": 2}, "--max-k 3 there, 2 here"),
    ({"adaptive_trials": 6}, "--trials 4 there, 6 here"),
])
def test_other_settings_on_the_same_study_are_refused(tmp_path, change, needle):
    from spectune.autotune.measurement_study import StudyError

    journal = str(tmp_path / "s.journal")
    run(small(), FakeRoofline(), journal)
    again = FakeRoofline()
    with pytest.raises(StudyError, match="measured with other settings") as err:
        run(small(**change), again, journal)
    assert needle in str(err.value) and "tier list" not in str(err.value)
    assert sum(again.calls.values()) == 0  # refused before anything was measured


def test_study_never_mixes_gpu_models(tmp_path):
    from spectune.autotune.measurement_study import StudyError

    journal = str(tmp_path / "s.journal")
    run_study(small(), lambda s: s, FakeRoofline(), storage=journal, study_name="t", progress=False,
              identity={"gpu": "NVIDIA H200"}, gpu="NVIDIA H200")
    with pytest.raises(StudyError, match="never mixes GPU models") as err:
        run_study(small(), lambda s: s, FakeRoofline(), storage=journal, study_name="t", progress=False,
                  identity={"gpu": "NVIDIA H100 80GB HBM3"}, gpu="NVIDIA H100 80GB HBM3")
    assert "NVIDIA H200" in str(err.value) and "\n" not in str(err.value)


def test_resume_reports_the_points_it_kept_and_keeps_the_budget(tmp_path):
    journal = str(tmp_path / "s.journal")
    p = small()
    total = 0
    for stop in (7, 5, 9):  # three interruptions, one in the adaptive phase
        timer = FakeRoofline(interrupt_after=stop)
        with pytest.raises(KeyboardInterrupt):
            run(p, timer, journal)
        total += stop
    res = run(p, FakeRoofline(), journal)
    assert res.kept == total and res.measured_now == p.total_points - total
    assert len(res.records) == p.total_points  # never more than the budget
    assert sum(1 for r in res.records if r["phase"] == "adaptive") == p.adaptive_trials
    study = optuna.load_study(study_name="test", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(journal)))
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 3 and all("KeyboardInterrupt" in t.user_attrs["interrupted"] for t in failed)


def test_torn_last_journal_line_is_cut_and_the_study_resumes(tmp_path):
    journal = tmp_path / "s.journal"
    with pytest.raises(KeyboardInterrupt):
        run(small(), FakeRoofline(interrupt_after=6), str(journal))
    with open(journal, "ab") as f:
        f.write(b'{"op_code": 5, "worker_id": "x", "trial_id": 3, "user_at')  # a write cut short by a full disk
    second = FakeRoofline()
    res = run(small(), second, str(journal))
    assert res.kept == 6 and len(res.records) == small().total_points
    assert journal.read_bytes().endswith(b"\n")


def test_bad_journal_line_inside_is_refused_with_the_recovery_command(tmp_path, capsys):
    from spectune.autotune.measurement_study import StudyError
    from spectune.cli import main

    journal = tmp_path / "s.journal"
    with pytest.raises(KeyboardInterrupt):
        run(small(), FakeRoofline(interrupt_after=6), str(journal))
    lines = journal.read_bytes().splitlines(keepends=True)
    cut = len(lines) - 4
    journal.write_bytes(b"".join(lines[:cut]) + lines[cut][:20] + b"".join(lines[cut:]))  # torn, then appended to
    with pytest.raises(StudyError, match=f"line {cut + 1} is not a journal record") as err:
        run(small(), FakeRoofline(), str(journal))
    assert f"spectune status --storage {journal} --repair" in str(err.value)
    assert main(["status", "--storage", str(journal), "--repair"]) == 0
    assert f"kept {cut} records" in capsys.readouterr().out
    assert list(tmp_path.glob("s.journal.bad-*"))  # the original is kept
    res = run(small(), FakeRoofline(), str(journal))  # the records before the bad line resume
    assert len(res.records) == small().total_points and res.kept >= 1


def test_failed_write_is_rolled_back(tmp_path, monkeypatch):
    from spectune.autotune.study_storage import SafeJournalFileBackend

    path = tmp_path / "s.journal"
    backend = SafeJournalFileBackend(str(path))
    backend.append_logs([{"op_code": 0, "worker_id": "a"}])
    size = path.stat().st_size
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return FullDisk(f) if mode == "ab" else f

    monkeypatch.setattr("builtins.open", fake_open)
    with pytest.raises(OSError, match="No space"):
        backend.append_logs([{"op_code": 1, "worker_id": "a", "payload": "x" * 100}])
    monkeypatch.undo()
    assert path.stat().st_size == size and path.read_bytes().endswith(b"\n")


def test_status_counts_points_and_workers(tmp_path):
    from spectune.autotune.study_status import study_status

    journal = str(tmp_path / "s.journal")
    p = small()
    with pytest.raises(KeyboardInterrupt):
        run(p, FakeRoofline(interrupt_after=10), journal)
    (st,) = study_status(journal)
    assert (st.done, st.claimed, st.total) == (10, 0, p.total_points) and st.remaining == p.total_points - 10
    assert st.waiting >= 1 and not st.complete and st.eta_s is None  # nobody measures now
    assert [w.done for w in st.workers] == [10]
    run(p, FakeRoofline(), journal)
    (st,) = study_status(journal, "test")
    assert st.complete and st.remaining == 0 and sum(w.done for w in st.workers) == p.total_points


def test_status_line_names_every_planned_point(tmp_path, capsys):
    from spectune.autotune.study_status import study_status
    from spectune.cli import main

    journal = str(tmp_path / "s.journal")
    p = plan(batch_sizes=(1, 2, 3, 4), max_k=2, adaptive_trials=12, held_out=3)
    run(p, FakeRoofline(infeasible_batch=3), journal)  # batch 4 does not fit; the small grid leaves no point to pick
    (st,) = study_status(journal)
    assert st.complete and st.not_needed > 0 and st.infeasible > 0
    assert st.done + st.remaining + len(st.given_up) + st.not_needed == st.total == p.total_points
    assert main(["status", "--storage", journal]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert (f"{st.done} done ({st.infeasible} infeasible), 0 claimed, 0 waiting, 0 remaining of {st.total}, "
            f"{st.not_needed} not needed (the adaptive phase ended early); complete") in line


SHIPPED_PROFILE = Path(__file__).resolve().parents[2] / "spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.yaml"


@pytest.mark.parametrize("content", [SHIPPED_PROFILE.read_bytes(), b"schema: x\nfoo: 1", b"1\n", b"notes"],
                         ids=["profile", "unterminated", "json-not-a-record", "one-word"])
def test_a_file_that_is_no_journal_is_refused_and_left_as_it_is(tmp_path, capsys, content):
    from spectune.autotune.measurement_study import StudyError
    from spectune.cli import main

    path = tmp_path / "p.yaml"
    path.write_bytes(content)
    for argv in (["status", "--storage", str(path)], ["status", "--storage", str(path), "--repair"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"spectune status: error: storage {path}: not an Optuna journal file (line 1 is not a journal record)\n"
    with pytest.raises(StudyError, match="not an Optuna journal file"):  # a writer never cuts its last line
        run(small(), FakeRoofline(), str(path))
    assert path.read_bytes() == content
    assert [f.name for f in tmp_path.iterdir()] == ["p.yaml"]  # no backup, no lock file


def test_status_writes_nothing_and_needs_an_existing_storage(tmp_path, capsys):
    from spectune.cli import main

    missing = tmp_path / "nodir" / "x.journal"
    for argv in (["status", "--storage", str(missing)], ["status", "--storage", str(missing), "--repair"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"spectune status: error: storage {missing}: no such journal file\n"
    url = f"sqlite:///{tmp_path / 'none.db'}"
    assert main(["status", "--storage", url]) == 2
    assert capsys.readouterr().err == f"spectune status: error: storage {url}: no such database file\n"
    assert list(tmp_path.iterdir()) == []  # no folder, no file, no lock file
    journal = tmp_path / "s.journal"
    run(small(), FakeRoofline(), str(journal))
    with open(journal, "ab") as f:
        f.write(b'{"op_code": 5, "worker_id": "x", "trial_id": 3, "user_at')  # a writer's line under way
    (journal.parent / "s.journal.flock").unlink()  # the writers' lock files: a reader makes none
    (journal.parent / "s.journal.claim.lock").unlink()
    files = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    assert main(["status", "--storage", str(journal)]) == 0
    assert "complete" in capsys.readouterr().out
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == files  # the torn tail is its writer's to cut


def test_sqlite_storage_opens_without_optuna_experimental_warning(tmp_path):
    import warnings

    from spectune.autotune.study_storage import open_storage

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    assert not [w for w in caught if issubclass(w.category, optuna.exceptions.ExperimentalWarning)]


def test_seed_has_odd_token_counts_never_held_out():
    from spectune.autotune.measurement_plan import off_tile_targets

    p = StudyPlan(batch_sizes=tuple(range(1, 65)), max_k=15, drafter_kind="parallel", context_len=2048)
    odd = off_tile_targets(p)
    assert odd and all(pt.tokens % 2 == 1 for pt in odd)
    assert {pt.key for pt in odd} <= {pt.key for pt in seed_points(p)}
    shapes = {(pt.batch, pt.q) for pt in odd}
    assert not shapes & {(pt.batch, pt.q) for pt in held_out_points(p) if pt.kind == "target"}
    # only powers of two allowed: no odd size to seed with
    assert off_tile_targets(StudyPlan(batch_sizes=(1, 2, 4, 8, 16), max_k=3, drafter_kind="parallel",
                                      context_len=2048)) == []
