"""What the GPU probe scripts (targets_probe.py, fused_step.py, gemm_check.py) share: printing a
line at once (the device tool returns only the tail of a call's output, so nothing waits in a
buffer), an exception's first line (one failed arm is reported and the next one runs), and
reading a comma list of integers from the command line (also used by bench_verify_attention.py
and targets_tables.py), and timing a call by CUDA-graph replay (attention_parts.py,
attention_q16.py)."""

from __future__ import annotations

import statistics
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


def graph_replay_us(fn: Callable[[], object], reps: int, calls: int = 1) -> float:
    """Median us of one call of ``fn`` (CUDA): a graph of ``calls`` back-to-back calls, captured
    after warm-up calls, replayed ``reps`` times between device events."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
