import pytest
import torch

from spectune.autotune.timing import (
    CudaGraphTimer,
    FakeTimer,
    InfeasiblePoint,
    Timing,
    WallClockTimer,
    default_timer,
    infeasible_on_oom,
    is_out_of_memory,
    summarize,
)
from spectune.errors import SpectuneError
from spectune.models.build import StepFn


class CountingStep:
    """A StepFn doing a tiny CPU matmul on static buffers; counts runs and refreshes."""

    def __init__(self, fail: BaseException | None = None):
        self.a = torch.randn(32, 32)
        self.runs = self.refreshes = 0
        self.fail = fail

    def step(self) -> StepFn:
        return StepFn(run=self.run, refresh=self.refresh, tokens=32, batch=1, label="matmul")

    def run(self):
        self.runs += 1
        if self.fail is not None:
            raise self.fail
        return self.a @ self.a

    def refresh(self):
        self.refreshes += 1
        self.a.normal_()


def test_wall_clock_timer_counts_reps_and_refreshes():
    counter = CountingStep()
    timing = WallClockTimer(warmup=2, reps=7, batches=3)(counter.step())
    assert timing.mode == "wall-clock" and timing.reps == 7
    assert counter.runs == 2 + 7
    assert counter.refreshes == 1 + 3  # before warm-up, then before each timing batch
    assert 0 < timing.p20_ms <= timing.median_ms <= timing.p80_ms
    assert timing.capture_s is None and timing.capture_mib is None


def test_wall_clock_timer_with_fake_clock():
    ticks = iter(range(100))
    timer = WallClockTimer(warmup=0, reps=4, clock=lambda: next(ticks) * 0.001, sync=lambda: None)
    timing = timer(CountingStep().step())
    assert timing.median_ms == pytest.approx(1.0)


def test_summarize_quantiles():
    t = summarize([5.0, 1.0, 2.0, 3.0, 4.0], "fake")
    assert (t.median_ms, t.p20_ms, t.p80_ms, t.reps) == (3.0, 1.8, 4.2, 5)


def test_fake_timer_never_runs_the_step():
    counter = CountingStep()
    timing = FakeTimer(lambda step: 0.25 * step.tokens)(counter.step())
    assert timing == Timing(8.0, 8.0, 8.0, 1, "fake")
    assert counter.runs == 0


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory"),
    RuntimeError("[enforce fail] DefaultCPUAllocator: not enough memory: you tried to allocate 1 GB; out of memory"),
])
def test_out_of_memory_becomes_infeasible_point(error):
    with pytest.raises(InfeasiblePoint, match="matmul") as info:
        WallClockTimer(warmup=1, reps=2)(CountingStep(fail=error).step())
    assert isinstance(info.value, SpectuneError)
    assert "\n" not in str(info.value)


def test_triton_out_of_resources_is_infeasible():
    errors = pytest.importorskip("triton.runtime.errors")
    exc = errors.OutOfResources(300000, 232448, "shared memory")
    assert is_out_of_memory(exc)
    with pytest.raises(InfeasiblePoint, match="capture"), infeasible_on_oom("capture"):
        raise exc


def test_other_errors_pass_through():
    with pytest.raises(ValueError, match="bad shape"):
        WallClockTimer()(CountingStep(fail=ValueError("bad shape")).step())
    with infeasible_on_oom():
        pass  # no error, nothing raised


def test_default_timer_on_cpu():
    assert isinstance(default_timer("cpu"), WallClockTimer)


@pytest.mark.gpu
def test_cuda_graph_timer_replays_a_captured_step():
    a = torch.randn(256, 256, device="cuda")
    out = torch.empty_like(a)
    runs = []

    def run():
        runs.append(1)
        torch.matmul(a, a, out=out)

    step = StepFn(run=run, refresh=lambda: a.normal_(), tokens=256, batch=1, label="matmul")
    timing = CudaGraphTimer(warmup=2, reps=20)(step)
    assert timing.mode == "cuda-graph" and timing.reps == 20
    assert len(runs) == 2 + 1  # eager warm-up + the capture; replays do not call run()
    assert timing.median_ms > 0 and timing.capture_s is not None and timing.capture_s >= 0
    assert timing.capture_mib is not None and timing.capture_mib >= 0
    torch.testing.assert_close(out, a @ a)  # last replay saw the refreshed input
