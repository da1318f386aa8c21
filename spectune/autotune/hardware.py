"""Where a profile was measured: hardware and software facts for the table's first sections."""

from __future__ import annotations

import platform

import torch

from spectune import __version__
from spectune.errors import SpectuneError
from spectune.runtime.table import Hardware, Software


def hardware_facts(device: torch.device | str) -> Hardware:
    """GPU name, capability, driver, memory, power limit and SM count; ``Hardware(gpu="cpu")`` on CPU."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return Hardware(gpu="cpu")
    from spectune.autotune.nvml import device_facts

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return device_facts(index)


def software_facts() -> Software:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return Software(
        spectune=__version__,
        torch=str(torch.__version__),
        triton=triton_version,
        python=platform.python_version(),
        cuda=torch.version.cuda,
    )


def gpu_slug(hardware: Hardware) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200`` (file and study names)."""
    return "".join(c if c.isalnum() else "-" for c in hardware.gpu.lower()).strip("-") or "gpu"


def parse_device(text: str | None, error: type[SpectuneError]) -> torch.device:
    """``--device``: None -> cuda if present else cpu; bad or absent devices raise ``error``."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise error(f"--device: unknown device {text!r} (cuda, cuda:N or cpu)") from None
    if dev.type not in ("cuda", "cpu"):
        raise error(f"--device: {text!r} is not supported (cuda, cuda:N or cpu)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise error(f"--device: {text!r} asked for but no CUDA device is present")
    return dev
