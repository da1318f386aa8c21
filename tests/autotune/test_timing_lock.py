"""The per-GPU timing lock: workers on one GPU never build, capture or time a point at once.

Two real worker processes on one study, each timing with a fake timer that records the
[start, end] of every stretch (CLOCK_MONOTONIC, one clock for all processes). Assertions are on
which intervals overlap, never on how long anything took.
"""

import json
import multiprocessing
import warnings
from pathlib import Path

import filelock
import pytest

from spectune.autotune.measurement_plan import PointSpec
from spectune.autotune.measurement_study import measure
from spectune.autotune.profiler import ProfileConfig, run_profile
from spectune.autotune.timing import FakeTimer, WallClockTimer
from spectune.autotune.timing_lock import Hold, TimingLock, gpu_key, open_timing_lock
from tests.autotune import study_workers
from tests.autotune.study_workers import IntervalTimer, same_step

SPAWN = multiprocessing.get_context("spawn")


def stretches(logs):
    return [json.loads(line) for log in logs for line in Path(log).read_text().splitlines()]


def cross_overlaps(rows, phases_a, phases_b):
    """Pairs (a, b) from different processes, a's phase in phases_a, b's in phases_b, overlapping."""
    return [
        (a, b)
        for a in rows
        for b in rows
        if a["pid"] != b["pid"]
        and a["phase"] in phases_a
        and b["phase"] in phases_b
        and a["start"] < b["end"]
        and b["start"] < a["end"]
    ]


def run_two(tmp_path, lock_dir):
    storage = str(tmp_path / "study.journal")
    barrier = SPAWN.Barrier(2)
    logs = [str(tmp_path / f"w{i}.log") for i in range(2)]
    procs = [
        SPAWN.Process(
            target=study_workers.timed_worker, args=(storage, "shared", log, lock_dir, barrier)
        )
        for log in logs
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        assert p.exitcode == 0, f"worker exit code {p.exitcode}"
    rows = stretches(logs)
    assert len({r["pid"] for r in rows}) == 2  # both workers measured points
    return rows


HELD = ("warmup", "timed")
DEVICE = ("capture", "warmup", "timed")  # every stretch that runs kernels


def test_no_device_stretch_of_one_gpu_overlaps_another_under_the_lock(tmp_path):
    rows = run_two(tmp_path, str(tmp_path / "locks"))
    assert {r["phase"] for r in rows} >= set(DEVICE)
    # capture runs kernels too (its warm-up): held with the rest of the point
    assert not cross_overlaps(rows, DEVICE, DEVICE)


def test_without_the_lock_the_same_workers_time_at_once(tmp_path):
    rows = run_two(tmp_path, None)
    assert cross_overlaps(rows, HELD, HELD)  # the check above can see an overlap
    assert cross_overlaps(rows, ("capture",), HELD)


def test_lock_is_exclusive_per_key_and_independent_across_keys(tmp_path):
    a, b = TimingLock("GPU-aaaa", tmp_path), TimingLock("GPU-aaaa", tmp_path)
    other = TimingLock("GPU-bbbb", tmp_path)
    assert a.path == b.path != other.path
    with a.held(), pytest.raises(filelock.Timeout):
        b._lock.acquire(timeout=0.05, poll_interval=0.001)  # another holder waits, in-process too
    with other.held(), a.held():
        pass
    assert TimingLock("GPU/../x", tmp_path).path.parent == tmp_path  # a key never leaves the folder


def test_gpu_key_prefers_the_uuid():
    assert gpu_key({"name": "NVIDIA H200", "uuid": "GPU-5e9d", "pci_bus_id": "00:1"}) == "GPU-5e9d"
    assert gpu_key({"name": "NVIDIA H200", "pci_bus_id": "00000000:18:00.0"}) == "00000000:18:00.0"
    assert gpu_key({"name": "cpu"}) == "cpu"


def test_auto_is_off_on_cpu_and_a_bad_folder_warns_once(tmp_path, monkeypatch):
    assert open_timing_lock("auto", {"name": "cpu"}, None, on_cuda=False) is None
    assert open_timing_lock("off", {"uuid": "GPU-1"}, 0, on_cuda=True) is None
    monkeypatch.setenv("SPECTUNE_LOCK_DIR", str(tmp_path / "locks"))
    lock = open_timing_lock("on", {"name": "cpu"}, None, on_cuda=False)
    assert lock is not None and lock.path.parent == tmp_path / "locks" and lock.path.exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECTUNE_LOCK_DIR", str(blocker / "locks"))  # a folder under a file
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert open_timing_lock("on", {"uuid": "GPU-1"}, 0, on_cuda=True) is None
    assert len(seen) == 1 and "timing lock" in str(seen[0].message)


class OrderLog:
    """Records the order of lock and meter events (a lock/meter stand-in)."""

    def __init__(self):
        self.events = []
        self.available = True

    def held(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.events.append("lock")
            yield 0.0
            self.events.append("unlock")

        return cm()

    def measure(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.events.append("meter")
            yield type("R", (), {"mean_power_w": 300.0})()
            self.events.append("meter-end")

        return cm()


def test_the_whole_point_is_held_and_the_meter_runs_around_the_timed_stretch():
    log = OrderLog()

    class Step:
        label, tokens, batch = "s", 4, 1

        def refresh(self):
            log.events.append("refresh")

        def run(self):
            log.events.append("run")

    def build(spec):
        log.events.append("build")
        return Step()

    res = measure(
        PointSpec("target", 1, 1),
        build,
        WallClockTimer(warmup=1, reps=2, batches=1),
        power=log,
        gpu_lock=log,
    )
    ev = log.events
    assert ev.count("lock") == 1 and ev[0] == "lock" and ev[-1] == "unlock"  # one hold, building inside
    assert ev[1:4] == ["build", "refresh", "run"]  # inputs built and warmed up under the lock
    assert ev[4:6] == ["meter", "refresh"] and ev[-3:-1] == ["run", "meter-end"]  # meter: timed stretch only
    assert res["power_w"] == 300.0 and res["lock_wait_s"] == 0.0


def test_a_timer_without_phases_is_held_whole():
    log = OrderLog()
    res = measure(
        PointSpec("target", 1, 1),
        same_step,
        lambda step: FakeTimer(lambda s: 1.0)(step),
        power=log,
        gpu_lock=log,
    )
    assert log.events == ["lock", "meter", "meter-end", "unlock"] and res["ms"] == 1.0


def test_hold_refuses_a_second_timed_stretch():
    hold = Hold()
    with hold("timed"):
        pass
    with pytest.raises(RuntimeError, match="one timed stretch"), hold("timed"):
        pass


def test_profile_records_lock_waits_only_with_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_LOCK_DIR", str(tmp_path / "locks"))
    log = str(tmp_path / "t.log")
    frames = {}
    for mode in ("on", "off"):
        config = ProfileConfig(
            device="cpu",
            batch_sizes="1-4",
            max_k=2,
            trials=0,
            out=str(tmp_path / f"{mode}.yaml"),
            progress=False,
            timing_lock=mode,
        )
        _, frames[mode] = run_profile(
            config,
            timer=IntervalTimer(log, timed_s=0.0, capture_s=0.0),
            measure_point=same_step,
            write=False,
        )
    assert frames["on"]["lock_wait_s"].notna().all() and frames["off"]["lock_wait_s"].isna().all()
    assert (tmp_path / "locks" / "gpu-cpu.lock").exists()
    assert list(frames["on"]["key"]) == list(frames["off"]["key"])
