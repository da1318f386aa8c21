"""Worker processes for the multi-worker study tests (spawned: everything here pickles by name).

Each worker runs one real ``run_study`` against a shared storage with a fixed-length fake timer
that appends every key it finished timing to its own log, so a test can count who measured what.
A worker given ``hang_key`` blocks on that point (after writing ``<log>.hang``) until killed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from spectune.autotune.measurement_study import PointSpec, StudyPlan, run_study

CTX = 256


def small_plan(**kw: Any) -> StudyPlan:
    base = dict(batch_sizes=tuple(range(1, 9)), max_k=3, drafter_kind="autoregressive", context_len=CTX,
                adaptive_trials=4, held_out=4, per_round=2, seed=5)
    return StudyPlan(**(base | kw))


def roofline(p: PointSpec) -> float:
    """A deterministic step time per point: weight-bound below 64 tokens, then linear."""
    ms = 2.0 + 0.01 * max(0, p.tokens - 64) + 0.0005 * p.batch * CTX / 256
    if p.kind == "drafter":
        ms = 0.1 + 0.3 * (p.k or 1) + 0.002 * p.tokens
    elif p.kind == "overhead":
        ms = 0.05 + 0.0005 * p.tokens
    return ms


class LoggingTimer:
    def __init__(self, log: str, sleep_s: float, hang_key: str | None = None):
        self.log, self.sleep_s, self.hang_key = log, sleep_s, hang_key

    def __call__(self, step: PointSpec) -> SimpleNamespace:
        if step.key == self.hang_key:
            Path(self.log + ".hang").write_text(step.key)
            time.sleep(600)  # until SIGKILL
        time.sleep(self.sleep_s)
        with open(self.log, "a") as f:
            f.write(step.key + "\n")
        ms = roofline(step)
        cap = (0.01 * step.tokens, 2.0 + step.tokens / 64) if step.kind == "tier" else (None, None)
        return SimpleNamespace(median_ms=ms, p20_ms=ms, p80_ms=ms, reps=1, mode="fake", capture_s=cap[0],
                               capture_mib=cap[1])


def same_step(spec: PointSpec) -> PointSpec:
    return spec


def worker(storage: str, name: str, log: str, plan_kw: dict[str, Any], *, sleep_s: float = 0.01,
           hang_key: str | None = None, barrier: Any = None, host: str | None = None,
           heartbeat_s: int = 1, grace_s: int = 2) -> None:
    if host is not None:
        os.environ["SPECTUNE_HOST"] = host
    Path(log).touch()
    if barrier is not None:
        barrier.wait()  # every worker opens the study at the same instant
    res = run_study(small_plan(**plan_kw), same_step, LoggingTimer(log, sleep_s, hang_key), storage=storage,
                    study_name=name, progress=False, heartbeat_s=heartbeat_s, grace_s=grace_s)
    Path(log + ".done").write_text(json.dumps({"measured": res.measured_now, "points": len(res.records),
                                               "given_up": list(res.given_up)}))


class IntervalTimer:
    """A phased fake timer: a short warm-up and a fixed-length timed stretch, each under the hold it
    is given, with an unheld "capture" sleep between them; appends one JSON line per stretch
    (``phase``, ``pid``, ``start``, ``end``: CLOCK_MONOTONIC, one clock for every process)."""

    phased = True

    def __init__(self, log: str, timed_s: float = 0.03, capture_s: float = 0.02):
        self.log, self.timed_s, self.capture_s = log, timed_s, capture_s

    def _stretch(self, phase: str, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        end = time.monotonic()
        with open(self.log, "a") as f:
            f.write(json.dumps({"phase": phase, "pid": os.getpid(), "start": start, "end": end}) + "\n")

    def __call__(self, step: PointSpec, hold: Any) -> SimpleNamespace:
        with hold("warmup"):
            self._stretch("warmup", self.timed_s / 4)
        self._stretch("capture", self.capture_s)
        with hold("timed"):
            self._stretch("timed", self.timed_s)
        ms = roofline(step)
        cap = (0.01 * step.tokens, 2.0 + step.tokens / 64) if step.kind == "tier" else (None, None)
        return SimpleNamespace(median_ms=ms, p20_ms=ms, p80_ms=ms, reps=1, mode="fake", capture_s=cap[0],
                               capture_mib=cap[1])


def timed_worker(storage: str, name: str, log: str, lock_dir: str | None, barrier: Any = None) -> None:
    """One worker timing with :class:`IntervalTimer`, under the timing lock in ``lock_dir`` (None:
    no lock)."""
    from spectune.autotune.timing_lock import TimingLock

    lock = TimingLock("GPU-test-0000", Path(lock_dir)) if lock_dir else None
    Path(log).touch()
    if barrier is not None:
        barrier.wait()
    run_study(small_plan(), same_step, IntervalTimer(log, timed_s=0.05), storage=storage, study_name=name,
              progress=False, gpu_lock=lock)
