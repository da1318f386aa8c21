"""The per-GPU timing lock: workers that share one GPU take turns at the timed part of a point.

Two processes on one GPU time-slice it: while one replays its CUDA graph, the other's kernels
land between its events and its NVML power readings are the sum of both (measured on one H200:
two workers on one GPU gave common points a median 6 % apart and a 16 % different fitted model).
So every worker holds an exclusive lock keyed by its GPU's UUID around each whole point (building
its inputs, capturing its graph, the eager and replay warm-ups and the timed replays with the NVML
sampling around them) and around building its models; claims and storage writes overlap. A first
version held only the warm-up and timed stretches and let building and capture overlap (host work,
it seemed): on one H200 two workers under it still fitted a model 4.9 % off a lone worker's (29 %
without any lock), because random fills and the capture's warm-up run kernels too.

- The lock is an ``flock`` (the ``filelock`` package) on ``<folder>/gpu-<uuid>.lock``; the kernel
  releases it when a worker dies, so a killed worker never blocks the GPU. ``<folder>`` is
  ``$SPECTUNE_LOCK_DIR`` or ``<tempdir>/spectune-gpu-locks``: one per host, which is where a
  physical GPU is. Containers sharing a GPU but not ``/tmp`` must share ``SPECTUNE_LOCK_DIR``.
- It is keyed by the GPU, not by the study: two different studies measured on one GPU take turns
  too. Alone on a GPU the lock is never contended and costs two system calls per point.
- ``Hold`` is what a timer receives: ``hold("warmup")`` and ``hold("timed")`` are context managers
  that take the lock if given one (the study takes it around the whole point and gives none); the
  "timed" one also runs the NVML meter, so power and energy are read while this worker alone uses
  the GPU. A timer that does not take a ``hold`` is metered whole.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

Phase = Literal["warmup", "timed"]
LOCK_DIR_ENV = "SPECTUNE_LOCK_DIR"
POLL_S = 0.001  # how often a waiting worker tries the lock again (a timed stretch lasts ~0.1-1 s)


def lock_folder() -> Path:
    env = os.environ.get(LOCK_DIR_ENV)
    return Path(env) if env else Path(tempfile.gettempdir()) / "spectune-gpu-locks"


def gpu_key(gpu_info: dict[str, Any] | None, device_index: int | None = None) -> str:
    """What names one physical GPU: NVML's UUID, else torch's UUID of the device, else its PCI
    bus id; ``cpu`` for the host's CPU."""
    info = gpu_info or {}
    for name in ("uuid", "pci_bus_id"):
        if info.get(name):
            return str(info[name])
    if device_index is not None:
        import torch

        if torch.cuda.is_available():
            uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
            if uuid is not None:
                return f"GPU-{uuid}"
    return (
        "cpu" if info.get("name") in (None, "cpu") else f"device-{info['name']}-{device_index or 0}"
    )


class TimingLock:
    """Exclusive per-GPU lock across processes of one host (see the module docstring)."""

    def __init__(self, key: str, folder: Path | None = None) -> None:
        from filelock import FileLock

        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)
        self.key = key
        self.folder = folder or lock_folder()
        self.path = self.folder / f"gpu-{safe}.lock"
        self.folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another user's folder: theirs to keep open
            if self.folder.stat().st_uid == os.getuid():
                self.folder.chmod(0o1777)  # any user's workers on this GPU can take turns
        self._lock = FileLock(str(self.path), mode=0o666)
        self.waited_s = 0.0  # seconds spent waiting for the lock, over this object's life

    @contextlib.contextmanager
    def held(self) -> Iterator[float]:
        """Hold the lock for the block; yields the seconds waited for it."""
        start = time.perf_counter()
        self._lock.acquire(poll_interval=POLL_S)
        waited = time.perf_counter() - start
        self.waited_s += waited
        try:
            yield waited
        finally:
            self._lock.release()


def open_timing_lock(
    mode: str, gpu_info: dict[str, Any] | None, device_index: int | None, on_cuda: bool
) -> TimingLock | None:
    """``auto``: a lock on CUDA (uncontended when alone), none on CPU; ``on`` / ``off``. A folder
    that cannot hold the lock gives one warning and no lock (the timings may then be disturbed
    by another worker on the same GPU)."""
    if mode == "off" or (mode == "auto" and not on_cuda):
        return None
    key = gpu_key(gpu_info, device_index if on_cuda else None)
    try:
        lock = TimingLock(key)
        with lock.held():  # fail here, not in the middle of a point
            pass
    except OSError as exc:
        warnings.warn(
            f"timing lock: cannot use {lock_folder()} ({exc.strerror or exc}); workers sharing "
            f"this GPU will disturb each other's timings (set {LOCK_DIR_ENV} to a writable folder)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return lock


class Hold:
    """What a timer's device stretches run under: the timing lock (if any) and, around the timed
    stretch, the NVML meter (if any). ``reading`` is the meter's region after the timed stretch;
    ``waited_s`` the seconds this point waited for the lock."""

    def __init__(self, lock: TimingLock | None = None, power: Any = None) -> None:
        self.lock = lock
        self.power = power if power is not None and getattr(power, "available", False) else None
        self.reading: Any = None
        self.waited_s = 0.0
        self.timed_stretches = 0

    @contextlib.contextmanager
    def __call__(self, phase: Phase) -> Iterator[None]:
        if phase not in ("warmup", "timed"):
            raise ValueError(f"phase must be 'warmup' or 'timed', got {phase!r}")
        with contextlib.ExitStack() as stack:
            if self.lock is not None:
                self.waited_s += stack.enter_context(self.lock.held())
            if phase == "timed":
                self.timed_stretches += 1
                if self.timed_stretches > 1:
                    raise RuntimeError("a timer runs one timed stretch per point")
                if self.power is not None:
                    self.reading = stack.enter_context(self.power.measure())
            yield
