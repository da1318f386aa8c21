"""Helpers of the ``spectune`` command (``spectune.cli``): the one-line argument parser, argument
types with their ranges, and the text of ``spectune show``. Nothing here prints; cli.py does."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn


class BadArgument(Exception):
    """argparse refused the command line; the message is the whole line to print."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (``spectune tune: error: ...``) and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise BadArgument(f"{self.prog}: error: {message} (see {self.prog} --help)")


SEED_MAX = 2**32 - 1  # numpy and Optuna seeds
TRIALS_MAX = 100_000
BENCH_MAX_TOKENS = 32_768  # prompt + new tokens per request: the bench allocates each request's KV up front
INTERRUPTED = {  # what a Ctrl-C leaves behind, per command
    "profile": "the measurement study resumes where it stopped: run the same command again",
    "autotune": "the measurement study resumes where it stopped: run the same command again",
    "tune": "the policy search runs in memory: nothing was written, run it again",
    "bench": "the rows measured so far are in --out",
}


def number(kind: type, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False):
    """argparse type: an int or a finite float within [lo, hi] ((lo, hi] with ``lo_open``)."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo:g}, got {text}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def nonempty(text: str) -> str:
    """argparse type: a name that is not empty (an empty value is not the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


POSITIVE = number(float, 0.0, lo_open=True)
SEED = number(int, 0, SEED_MAX)


def one_line(text: str) -> str:
    # a file name or value with a line break stays on the error's one line
    return text.replace("\r", "\\r").replace("\n", "\\n")


def show_lines(t) -> list[str]:
    from spectune.runtime.costs import CostModel
    from spectune.runtime.schema import to_dict

    hw, wl, costs = t.hardware, t.workload, t.costs
    lines = [f"{'policy table' if t.is_policy else 'profile'} ({t.schema}, created {t.created or '?'})"]
    facts = {k: v for k, v in to_dict(hw).items() if v is not None}
    lines.append("hardware: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    lines.append(f"software: spectune {t.software.spectune}, torch {t.software.torch}, triton {t.software.triton}")
    lines.append(f"workload: {wl.target} + {wl.drafter} ({wl.drafter_kind}, {wl.drafter_layers} layers), {wl.dtype}, "
                 f"context {wl.context_len}, K <= {wl.max_k}, batch 1..{wl.max_batch}, {wl.device}")
    m = costs.model
    lines.append(f"cost model ({costs.timer} timer):")
    for part in (m.target, m.drafter, m.overhead, m.power):
        if part is not None:
            body = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in to_dict(part).items())
            lines.append(f"  {type(part).__name__}: {body}")
    e = costs.error
    lines.append(f"  error on {e.held_out} held-out points: median {e.median_rel:.1%}, max {e.max_rel:.1%}")
    model = CostModel(m, wl.drafter_kind, wl.context_len)
    measured = {(p.batch, p.q): p.ms for p in costs.points if p.kind == "target" and not p.held_out}
    batches = sorted({b for b, _ in measured}) or [1, wl.max_batch]
    qs = sorted({q for _, q in measured if q is not None}) or [1, wl.max_k + 1]
    lines.append("target step ms, predicted / measured (rows: batch, columns: tokens per request q)")
    lines.append(f"{'batch':>6} " + " ".join(f"{'q=' + str(q):>15}" for q in qs))
    for b in batches:
        cells = []
        for q in qs:
            pred = model.target_ms(b * q, b)
            meas = measured.get((b, q))
            cells.append(f"{pred:7.3f}/{meas:<7.3f}" if meas is not None else f"{pred:7.3f}/{'-':<7}")
        lines.append(f"{b:>6} " + " ".join(f"{c:>15}" for c in cells))
    if costs.capture:
        lines.append("graph capture per tier: " + ", ".join(f"{c.tokens}: {c.seconds:.2f}s {c.mib:.0f}MiB"
                                                           for c in costs.capture))
    bad = [p for p in costs.points if p.ms is None]
    if bad:
        lines.append(f"infeasible points: {len(bad)} (largest batch {max(p.batch for p in bad)})")
    if t.policy is not None:
        pol = t.policy
        lines.append(f"policy ({pol.objective}): tiers {pol.tiers}, online window={pol.online.window:g} "
                     f"steps, margin={pol.online.margin:g}, z={pol.online.z:g}")
        for r in pol.rows:
            gain = f"{r.gain:.3f}x" if r.gain is not None else "-"
            tier = r.tier if r.tier is not None else "-"
            lines.append(f"  batch {r.batch[0]:>4}-{r.batch[1]:<4}  K={r.k:<2}  budget={r.verify_budget:<5}  "
                         f"tier={tier:<6}  gain={gain}")
    return lines
