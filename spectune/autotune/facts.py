"""Where a profile was measured: hardware and software facts for the table's first sections."""

from __future__ import annotations

import platform

import torch

from spectune import __version__
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
