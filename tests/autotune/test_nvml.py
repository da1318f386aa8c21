import sys
import types
import warnings

import pytest

from spectune.autotune import nvml as nvml_mod
from spectune.autotune.nvml import NvmlReading, NvmlSampler, throttle_names
from spectune.runtime.table import Hardware


class NVMLError(Exception):
    pass


class FakeNvml:
    """Counters that advance on each read: energy +500 mJ, power cycling 300/350/400 W."""

    NVML_CLOCK_SM = 1

    def __init__(self, throttle=0x4):
        self.energy_mj = 1_000_000
        self.power_mw = iter([300_000, 350_000, 400_000] * 1000)
        self.throttle = throttle
        self.shutdowns = 0

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.energy_mj += 500
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle):
        return next(self.power_mw)

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self.throttle

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(total=150_120_980_480)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000


class NoEnergyNvml(FakeNvml):
    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        raise NVMLError("Not Supported")

    nvmlDeviceGetCurrentClocksEventReasons = None  # older bindings only have the throttle name

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return 0x40


class FailingInit:
    def nvmlInit(self):
        raise NVMLError("Driver Not Loaded")


def fake_clock(step=0.5):
    t = [0.0]

    def clock():
        t[0] += step
        return t[0]
    return clock


def test_energy_and_power_arithmetic():
    fake = FakeNvml()
    sampler = NvmlSampler(0, interval_s=3600, nvml=fake)  # no background sample within the test
    assert sampler.available
    with sampler.measure() as region:
        pass
    r = region.reading
    assert r.energy_j == pytest.approx(0.5)  # one counter step of 500 mJ between start and stop
    assert r.samples == 2 and r.mean_power_w == pytest.approx(325.0) and r.max_power_w == 350.0
    assert r.sm_clock_mhz == 1980
    assert r.throttle_reasons == 0x4 and r.throttle_names == ["sw_power_cap"]
    assert r.seconds > 0
    assert r.joules_per_step(10) == pytest.approx(0.05)
    assert region.energy_j == r.energy_j  # fields read through the region handle
    sampler.close()
    assert fake.shutdowns == 1 and not sampler.available


def test_background_thread_samples_power():
    sampler = NvmlSampler(0, interval_s=0.001, nvml=FakeNvml())
    sampler.start()
    import time
    deadline = time.monotonic() + 5
    while len(sampler._power) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    reading = sampler.stop()
    assert reading.samples >= 5
    assert 300.0 <= reading.mean_power_w <= 400.0 and reading.max_power_w == 400.0


def test_energy_falls_back_to_power_times_time_and_older_throttle_call():
    sampler = NvmlSampler(0, interval_s=3600, nvml=NoEnergyNvml(), clock=fake_clock(0.5))
    with sampler.measure() as region:
        pass
    r = region.reading
    assert r.seconds == pytest.approx(0.5)
    assert r.energy_j == pytest.approx(325.0 * 0.5)
    assert r.throttle_names == ["hw_thermal_slowdown"]


def test_init_failure_gives_none_fields_and_one_notice(monkeypatch):
    monkeypatch.setattr(nvml_mod, "_NOTICED", set())
    with pytest.warns(RuntimeWarning, match="NVML unavailable"):
        sampler = NvmlSampler(0, nvml=FailingInit())
    assert not sampler.available
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NvmlSampler(0, nvml=FailingInit())  # the notice is given once
        with sampler.measure() as region:
            pass
    r = region.reading
    assert isinstance(r, NvmlReading)
    assert (r.energy_j, r.mean_power_w, r.max_power_w, r.sm_clock_mhz, r.throttle_reasons) == (None,) * 5
    assert r.throttle_names == [] and r.joules_per_step(3) is None
    sampler.close()  # harmless


def test_missing_pynvml_module(monkeypatch):
    monkeypatch.setattr(nvml_mod, "_NOTICED", set())
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    with pytest.warns(RuntimeWarning, match="NVML unavailable"):
        sampler = NvmlSampler()
    assert not sampler.available


def test_monkeypatched_pynvml_init_raising(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(nvml_mod, "_NOTICED", set())

    def boom():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    with pytest.warns(RuntimeWarning):
        sampler = NvmlSampler()
    assert not sampler.available
    assert sampler.device_facts().driver is None


def test_device_facts_from_nvml(monkeypatch):
    monkeypatch.setattr(nvml_mod.torch.cuda, "is_available", lambda: False)
    facts = NvmlSampler(0, nvml=FakeNvml()).device_facts()
    assert facts == Hardware(gpu="NVIDIA H200", capability=None, driver="580.159.04",
                             memory_gib=139.8, power_limit_w=700.0, sm_count=None)


def test_device_facts_without_anything(monkeypatch):
    monkeypatch.setattr(nvml_mod, "_NOTICED", {"x"})
    monkeypatch.setattr(nvml_mod.torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        facts = NvmlSampler(0, nvml=FailingInit()).device_facts()
    assert facts == Hardware(gpu="cpu")


def test_throttle_names():
    assert throttle_names(0) == [] and throttle_names(None) == []
    assert throttle_names(0x1 | 0x20) == ["gpu_idle", "sw_thermal_slowdown"]
    assert throttle_names(0x1000) == ["other_0x1000"]
