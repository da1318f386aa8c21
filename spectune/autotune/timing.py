"""Timing harness: what one measured point costs.

A timer is any callable ``timer(step) -> Timing`` over a ``StepFn`` (see ``spectune.models.build``).
The timers here also take ``hold`` (``timer(step, hold)``, :class:`~spectune.autotune.timing_lock.Hold`)
and run every stretch that puts the step on the device inside ``hold("warmup")`` or
``hold("timed")`` — graph capture (no kernels run) stays outside — so workers sharing a GPU take
turns at timing (``phased = True`` says a timer does):
- ``CudaGraphTimer``: eager warm-up on a side stream, capture of a FULL CUDA graph of ``step.run()``
  (capture seconds and the graph pool's memory recorded), warm-up replays, then timed replays with
  CUDA events in a few batches, inputs refreshed in place between batches; median and p20/p80.
- ``WallClockTimer``: the same shape of result from eager runs and ``perf_counter`` (CPU).
- ``FakeTimer``: returns what a function of the step says (tests, dry runs).

Out-of-memory / out-of-resources raise ``InfeasiblePoint`` after freeing cached device memory, so a
study records the point as infeasible and goes on.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from spectune.errors import SpectuneError
from spectune.models.build import StepFn

TimerMode = Literal["cuda-graph", "wall-clock", "fake"]
MIB = 1024 * 1024


class InfeasiblePoint(SpectuneError):
    """The point does not fit on this device (out of memory or out of kernel resources)."""


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int  # timed runs the quantiles are over
    mode: TimerMode
    capture_s: float | None = None  # seconds to capture the CUDA graph
    capture_mib: float | None = None  # memory the captured graph's private pool holds


class Timer(Protocol):
    def __call__(self, step: StepFn) -> Timing: ...


HoldFn = Callable[[str], contextlib.AbstractContextManager[None]]  # phase -> a stretch to run under


def _unheld(phase: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _quantile(sorted_ms: list[float], q: float) -> float:
    # linear interpolation between closest ranks
    pos = q * (len(sorted_ms) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def summarize(samples_ms: list[float], mode: TimerMode, capture_s: float | None = None,
              capture_mib: float | None = None) -> Timing:
    if not samples_ms:
        raise ValueError("no timing samples")
    ordered = sorted(samples_ms)
    return Timing(median_ms=statistics.median(ordered), p20_ms=_quantile(ordered, 0.2),
                  p80_ms=_quantile(ordered, 0.8), reps=len(ordered), mode=mode,
                  capture_s=capture_s, capture_mib=capture_mib)


def _out_of_resources_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [torch.cuda.OutOfMemoryError]
    try:
        from triton.runtime.errors import OutOfResources
        types.append(OutOfResources)
    except ImportError:  # triton missing or moved: the message check below still applies
        pass
    return tuple(types)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, _out_of_resources_types()):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "out of resource" in text)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def infeasible_on_oom(what: str = "point") -> Iterator[None]:
    """Turn out-of-memory / out-of-resources inside the block into ``InfeasiblePoint``."""
    reason = None
    try:
        yield
    except InfeasiblePoint:
        raise
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        text = str(exc).strip()
        reason = text.splitlines()[0][:200] if text else type(exc).__name__
    if reason is not None:
        # raised outside the except block so the failed frames (and their tensors) are gone first
        free_device_memory()
        raise InfeasiblePoint(f"{what}: {reason}")


def _batches(reps: int, n_batches: int) -> list[int]:
    n = max(1, min(n_batches, reps))
    base, extra = divmod(reps, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


class WallClockTimer:
    """Eager runs timed with ``perf_counter`` (synchronising CUDA around each run if present)."""

    def __init__(self, warmup: int = 2, reps: int = 10, batches: int = 2,
                 clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] | None = None):
        if reps < 1 or warmup < 0:
            raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
        self.warmup, self.reps, self.batches, self.clock = warmup, reps, batches, clock
        self.sync = sync or (torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))

    phased = True

    def __call__(self, step: StepFn, hold: HoldFn = _unheld) -> Timing:
        with infeasible_on_oom(step.label or "step"):
            step.refresh()
            with hold("warmup"):
                for _ in range(self.warmup):
                    step.run()
            samples: list[float] = []
            with hold("timed"):
                for n in _batches(self.reps, self.batches):
                    step.refresh()
                    for _ in range(n):
                        self.sync()
                        start = self.clock()
                        step.run()
                        self.sync()
                        samples.append((self.clock() - start) * 1e3)
        return summarize(samples, "wall-clock")


class CudaGraphTimer:
    """FULL CUDA-graph capture of ``step.run()`` and replays timed with CUDA events."""

    def __init__(self, warmup: int = 3, reps: int = 20, batches: int = 4, replay_warmup: int = 3,
                 device: torch.device | str | None = None):
        if reps < 1 or warmup < 1:
            raise ValueError(f"need reps >= 1 and warmup >= 1, got reps={reps}, warmup={warmup}")
        self.warmup, self.reps, self.batches = warmup, reps, batches
        self.replay_warmup, self.device = replay_warmup, device

    phased = True

    def __call__(self, step: StepFn, hold: HoldFn = _unheld) -> Timing:
        graph: torch.cuda.CUDAGraph | None = None
        try:
            with infeasible_on_oom(step.label or "step"), torch.cuda.device(self.device):
                graph, capture_s, capture_mib = self._capture(step, hold)
                with hold("timed"):
                    samples = self._replay(step, graph)
        finally:
            del graph
            free_device_memory()
        return summarize(samples, "cuda-graph", capture_s, capture_mib)

    def _capture(self, step: StepFn, hold: HoldFn) -> tuple[torch.cuda.CUDAGraph, float, float]:
        step.refresh()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with hold("warmup"):  # eager warm-up off the default stream (lazy inits, Triton autotuning)
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    step.run()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        # torch.cuda.graph() empties the cache on entry: empty it first so the warm-up's cached
        # blocks do not hide the graph pool's growth
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        with torch.cuda.graph(graph):
            step.run()
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - start
        capture_mib = max(0, torch.cuda.memory_reserved() - reserved) / MIB
        return graph, capture_s, capture_mib

    def _replay(self, step: StepFn, graph: torch.cuda.CUDAGraph) -> list[float]:
        for _ in range(self.replay_warmup):
            graph.replay()
        samples: list[float] = []
        for n in _batches(self.reps, self.batches):
            step.refresh()  # static input buffers: the graph reads the new values
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(n)]
            for begin, end in events:
                begin.record()
                graph.replay()
                end.record()
            torch.cuda.synchronize()
            samples.extend(begin.elapsed_time(end) for begin, end in events)
        return samples


class FakeTimer:
    """``FakeTimer(lambda step: 0.01 * step.tokens)``: never runs the step."""

    def __init__(self, fn: Callable[[StepFn], float]):
        self.fn = fn

    phased = True

    def __call__(self, step: StepFn, hold: HoldFn = _unheld) -> Timing:
        with hold("timed"):
            ms = float(self.fn(step))
        return Timing(median_ms=ms, p20_ms=ms, p80_ms=ms, reps=1, mode="fake")


def default_timer(device: torch.device | str | None = None) -> Timer:
    """CUDA-graph replays on a CUDA device, wall-clock eager runs elsewhere."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda":
        return CudaGraphTimer(device=dev)
    return WallClockTimer()
