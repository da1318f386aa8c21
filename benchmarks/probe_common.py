"""What the GPU probe scripts (targets_probe.py, fused_step.py, gemm_check.py) print with: a line
at once (the device tool returns only the tail of a call's output, so nothing waits in a buffer)
and an exception's first line, so one failed arm is reported and the next one runs."""

from __future__ import annotations


def say(*parts: object) -> None:
    print(*parts, flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
