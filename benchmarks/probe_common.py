"""What the GPU probe scripts (targets_probe.py, fused_step.py, gemm_check.py) share: printing a
line at once (the device tool returns only the tail of a call's output, so nothing waits in a
buffer), an exception's first line (one failed arm is reported and the next one runs), and
reading a comma list of integers from the command line (also used by bench_verify_attention.py
and targets_tables.py)."""

from __future__ import annotations

from collections.abc import Callable


def say(*parts: object) -> None:
    print(*parts, flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def int_list(text: str, flag: str, *, lo: int = 1, hi: int | None = None, example: str = "1,2,4",
             error: Callable[[str], BaseException] = SystemExit) -> list[int]:
    """Sorted distinct integers of a comma list, each in ``lo..hi`` (no upper bound when ``hi`` is
    None); a bad list raises ``error`` with one line naming ``flag``."""
    try:
        out = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise error(f"{flag}: cannot read {text!r} (e.g. {example})") from None
    if not out:
        raise error(f"{flag}: empty list (e.g. {example})")
    bad = [v for v in out if v < lo or (hi is not None and v > hi)]
    if bad:
        raise error(f"{flag}: values must be {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, got {bad[0]}")
    return out
