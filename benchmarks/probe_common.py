"""What the GPU probe scripts (targets_probe.py, fused_step.py, gemm_check.py) share: printing a
line at once (the device tool returns only the tail of a call's output, so nothing waits in a
buffer), an exception's first line (one failed arm is reported and the next one runs), and
reading a comma list of sizes from the command line."""

from __future__ import annotations


def say(*parts: object) -> None:
    print(*parts, flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def sizes(text: str, flag: str, example: str, what: str) -> list[int]:
    """Sorted distinct integers >= 1 of a comma list; a bad one exits naming ``flag``."""
    try:
        out = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"{flag}: cannot read {text!r} (e.g. {example})") from None
    if not out or out[0] < 1:
        raise SystemExit(f"{flag}: {what} must be >= 1")
    return out
