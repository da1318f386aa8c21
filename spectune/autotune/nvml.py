"""NVML sampler: energy, power, SM clock and throttle reasons around a measured region.

``with sampler.measure() as region: ...`` reads the cumulative energy counter (mJ), power (mW), SM
clock and the clock-event (throttle) reasons before and after the region, and samples power every
``interval_s`` in a background thread during it; ``region.reading`` is an ``NvmlReading``.

Without NVML (CPU, no driver, pynvml missing, any error at init) the sampler says so once with a
warning, reports ``available=False`` and returns readings whose NVML fields are None. Never a crash.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from spectune.runtime.table import Hardware

NVML_CLOCK_SM = 1  # nvmlClockType_t value of the SM clock
MIB = 1024 * 1024

# nvmlClocksEventReason* bits -> short names
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

_NOTICED: set[str] = set()


def _notice(message: str) -> None:
    if message not in _NOTICED:
        _NOTICED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def throttle_names(bits: int | None) -> list[str]:
    if not bits:
        return []
    names = [name for bit, name in THROTTLE_BITS.items() if bits & bit]
    unknown = bits & ~sum(THROTTLE_BITS)
    if unknown:
        names.append(f"other_0x{unknown:x}")
    return names


@dataclass(frozen=True)
class NvmlReading:
    energy_j: float | None  # energy over the region (counter difference, else mean power x time)
    mean_power_w: float | None
    max_power_w: float | None
    sm_clock_mhz: int | None  # median SM clock while sampling
    throttle_reasons: int | None  # OR of the reason bits seen during the region
    throttle_names: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the region
    samples: int = 0  # power samples taken

    def joules_per_step(self, steps: int) -> float | None:
        if self.energy_j is None or steps <= 0:
            return None
        return self.energy_j / steps


class Region:
    """Handle yielded by ``NvmlSampler.measure()``; ``reading`` is set when the block ends, and
    its fields read through (``region.energy_j``) once it is."""

    reading: NvmlReading | None = None

    def __getattr__(self, name: str) -> Any:
        reading = self.__dict__.get("reading")
        if reading is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(reading, name)


class NvmlSampler:
    def __init__(self, device_index: int = 0, *, interval_s: float = 0.02, nvml: Any = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.device_index, self.interval_s, self.clock = device_index, interval_s, clock
        self.available = False
        self._nvml: Any = None
        self._handle: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._power: list[float] = []  # W
        self._clocks: list[int] = []
        self._reasons: list[int] = []
        self._start: dict[str, Any] = {}
        self._open(nvml)

    # --- setup -------------------------------------------------------------------------------

    def _open(self, nvml: Any) -> None:
        try:
            if nvml is None:
                nvml = importlib.import_module("pynvml")  # nvidia-ml-py
            nvml.nvmlInit()
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            _notice(f"NVML unavailable ({type(exc).__name__}: {exc}); power, energy and clocks "
                    f"will not be recorded")
            return
        self._nvml = nvml
        self.available = True

    def close(self) -> None:
        if self.available:
            self._query("nvmlShutdown", with_handle=False)
            self.available = False

    def __enter__(self) -> NvmlSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _query(self, name: str, *args: Any, with_handle: bool = True) -> Any:
        """One NVML call; None when unavailable or unsupported on this device."""
        if not self.available:
            return None
        fn = getattr(self._nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(self._handle, *args) if with_handle else fn(*args)
        except Exception:
            return None

    def _power_w(self) -> float | None:
        mw = self._query("nvmlDeviceGetPowerUsage")
        return None if mw is None else mw / 1000.0

    def _energy_mj(self) -> float | None:
        return self._query("nvmlDeviceGetTotalEnergyConsumption")

    def _sm_clock(self) -> int | None:
        sm = getattr(self._nvml, "NVML_CLOCK_SM", NVML_CLOCK_SM)
        return self._query("nvmlDeviceGetClockInfo", sm)

    def _throttle(self) -> int | None:
        bits = self._query("nvmlDeviceGetCurrentClocksEventReasons")
        if bits is None:
            bits = self._query("nvmlDeviceGetCurrentClocksThrottleReasons")
        return bits

    # --- sampling ----------------------------------------------------------------------------

    def _sample(self, reasons_too: bool = True) -> None:
        power, clock = self._power_w(), self._sm_clock()
        reasons = self._throttle() if reasons_too else None
        if power is not None:
            self._power.append(power)
        if clock is not None:
            self._clocks.append(clock)
        if reasons is not None:
            self._reasons.append(reasons)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._power, self._clocks, self._reasons = [], [], []
        self._start = {"t": self.clock(), "energy": self._energy_mj()}
        if not self.available:
            return
        self._sample(reasons_too=False)  # the GPU may still be idle here: reasons count from now on
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="spectune-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> NvmlReading:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        seconds = self.clock() - self._start.get("t", self.clock())
        if not self.available:
            return NvmlReading(None, None, None, None, None, [], seconds, 0)
        energy_end = self._energy_mj()
        self._sample()
        mean_w = statistics.fmean(self._power) if self._power else None
        energy0 = self._start.get("energy")
        if energy0 is not None and energy_end is not None:
            energy_j: float | None = (energy_end - energy0) / 1000.0
        else:
            energy_j = mean_w * seconds if mean_w is not None else None
        bits = None
        for r in self._reasons:
            bits = r if bits is None else bits | r
        return NvmlReading(
            energy_j=energy_j,
            mean_power_w=mean_w,
            max_power_w=max(self._power) if self._power else None,
            sm_clock_mhz=int(statistics.median(self._clocks)) if self._clocks else None,
            throttle_reasons=bits,
            throttle_names=throttle_names(bits),
            seconds=seconds,
            samples=len(self._power),
        )

    @contextlib.contextmanager
    def measure(self) -> Iterator[Region]:
        region = Region()
        self.start()
        try:
            yield region
        finally:
            region.reading = self.stop()

    # --- static facts ------------------------------------------------------------------------

    def device_facts(self) -> Hardware:
        """GPU name, driver, memory, enforced power limit, capability and SM count (None where
        unknown); ``Hardware(gpu="cpu")`` without CUDA and NVML."""
        props = None
        if torch.cuda.is_available() and self.device_index < torch.cuda.device_count():
            props = torch.cuda.get_device_properties(self.device_index)
        name = _text(self._query("nvmlDeviceGetName"))
        driver = _text(self._query("nvmlSystemGetDriverVersion", with_handle=False))
        mem = self._query("nvmlDeviceGetMemoryInfo")
        limit_mw = self._query("nvmlDeviceGetEnforcedPowerLimit")
        memory_gib = getattr(mem, "total", None)
        if memory_gib is None and props is not None:
            memory_gib = props.total_memory
        return Hardware(
            gpu=name or (props.name if props is not None else "cpu"),
            capability=f"{props.major}.{props.minor}" if props is not None else None,
            driver=driver,
            memory_gib=round(memory_gib / (1024 * MIB), 1) if memory_gib is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            sm_count=props.multi_processor_count if props is not None else None,
        )


    def identity(self) -> dict[str, Any]:
        """What a trial records about the GPU it ran on: name, UUID, driver, PCI bus, SM and memory
        clocks (current and max), enforced power limit; ``{"name": "cpu"}`` without NVML."""
        if not self.available:
            return {"name": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0)}
        sm = getattr(self._nvml, "NVML_CLOCK_SM", NVML_CLOCK_SM)
        mem = getattr(self._nvml, "NVML_CLOCK_MEM", 2)
        pci = self._query("nvmlDeviceGetPciInfo")
        limit_mw = self._query("nvmlDeviceGetEnforcedPowerLimit")
        return {
            "name": _text(self._query("nvmlDeviceGetName")), "uuid": _text(self._query("nvmlDeviceGetUUID")),
            "driver": _text(self._query("nvmlSystemGetDriverVersion", with_handle=False)),
            "index": self.device_index, "pci_bus_id": _text(getattr(pci, "busId", None)),
            "sm_clock_mhz": self._sm_clock(), "max_sm_clock_mhz": self._query("nvmlDeviceGetMaxClockInfo", sm),
            "mem_clock_mhz": self._query("nvmlDeviceGetClockInfo", mem),
            "power_limit_w": limit_mw / 1000.0 if limit_mw is not None else None,
        }


def nvml_index(torch_index: int, visible: str | None = None) -> int:
    """NVML counts every GPU; torch counts the ``CUDA_VISIBLE_DEVICES`` ones: torch's index ->
    NVML's (entries given as indices; UUID entries are looked up)."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not text:
        return torch_index
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if torch_index >= len(entries):
        return torch_index
    entry = entries[torch_index]
    if entry.isdigit():
        return int(entry)
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
        for i in range(nvml.nvmlDeviceGetCount()):
            uuid = _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) or ""
            if uuid.startswith(entry) or entry.startswith(uuid):
                return i
    except Exception:  # no NVML: readings are off anyway
        pass
    return torch_index


def gpu_identity(device_index: int = 0) -> dict[str, Any]:
    with NvmlSampler(device_index) as sampler:
        return sampler.identity()


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return None if value is None else str(value)


def device_facts(device_index: int = 0) -> Hardware:
    with NvmlSampler(device_index) as sampler:
        return sampler.device_facts()
