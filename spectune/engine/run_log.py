"""Host bookkeeping of one ``Engine.run``: copies in flight, time marks, the run log and its result.

Words used here:
  margin     top-1 minus top-2 logit of the forward that chose an output token (greedy). A small
             margin is a near tie: another forward of the same context that rounds differently
             (another tier, another kernel) may pick the other token.
  reference  a request's expected output (the plain arm's greedy tokens, which the replay drafter
             proposes from). The first output index where a run's tokens differ is the request's
             divergence; steps that emitted only tokens before it are *clean*.
  decode     decode / verification steps, from after the iteration's admission (prefill) to the
             start of the next iteration: ``decode_ms`` leaves prefill and admission out.

Margins are recorded for forwards of one token per request (plain decoding, and the prefill's
last prompt token): ``MarginTap`` writes them on the device inside the captured decode graph, and
they travel to the host in the same non-blocking copy as the step's tokens. Verification steps
(K > 0) record none (NaN).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from spectune.kernels.attention_metadata import AttnMeta

NO_MARGIN = float("nan")  # margin of a token chosen by a verification step (not recorded)


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # [prompt_len] token ids
    max_new_tokens: int


def top2_margin(logits: Tensor) -> Tensor:
    """logits [T, V] -> [T, 2] float32: (top-1 minus top-2 logit, top-1 logit); no host sync."""
    top = logits.topk(2, dim=-1).values.float()  # [T, 2]
    return torch.stack((top[:, 0] - top[:, 1], top[:, 0]), dim=1)


class MarginTap:
    """The target forward, plus: for one-token-per-request forwards (``meta.max_q == 1``, the
    decode graphs) each token's ``top2_margin`` is written into the static buffer ``margins``
    [max_tokens, 2] (device work, captured with the graph). Other forwards leave it alone."""

    def __init__(self, target: Callable[[Tensor, Tensor, AttnMeta], Tensor], max_tokens: int,
                 device: torch.device):
        self.target = target
        self.margins = torch.full((max_tokens, 2), NO_MARGIN, dtype=torch.float32, device=device)

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttnMeta) -> Tensor:
        logits = self.target(input_ids, positions, meta)  # [T, V]
        if meta.max_q == 1:
            self.record(logits)
        return logits

    def record(self, logits: Tensor) -> None:
        """``logits`` [T, V] of a one-token-per-request forward -> ``margins[:T]``."""
        self.margins[: logits.shape[0]].copy_(top2_margin(logits))


@dataclass
class StepCopy:
    """Emitted tokens of one prefill or step on their way to the host."""

    tokens: Tensor  # [n, width] int64 (host; pinned on CUDA)
    counts: Tensor | None  # [n] int32 (host); None: one token per row (prefill)
    rids: list[int]  # request of each row when the step ran
    iteration: int
    event: Any  # torch.cuda.Event, None on CPU
    margins: Tensor | None = None  # [n, 2] float32 (host): top2_margin per row; None: not recorded

    def landed(self) -> bool:
        return self.event is None or self.event.query()


class Marks:
    """Time stamps on the device timeline (CUDA events) or the host clock (CPU, eager)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.items: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.items.append(ev)
        else:
            self.items.append(time.perf_counter())
        return len(self.items) - 1

    def landed(self, i: int) -> bool:
        """Mark i has been reached on the device (CUDA: ``Event.query``, no sync)."""
        return bool(self.items[i].query()) if self.cuda else True

    def ms(self, a: int, b: int) -> float:  # after the device is synchronised (or both landed)
        if self.cuda:
            return float(self.items[a].elapsed_time(self.items[b]))
        return (self.items[b] - self.items[a]) * 1e3


@dataclass(frozen=True)
class RunResult:
    outputs: list[list[int]]  # [requests] output token ids (<= max_new_tokens each)
    done: list[bool]  # request emitted all its max_new_tokens
    ttft_ms: list[float | None]  # admission -> first token (end of its prefill)
    itl_ms: list[float]  # per (row, step) with output: iteration time / tokens the row emitted
    itl_tokens: list[int]  # tokens each itl_ms entry stands for
    k_hist: dict[int, int]  # steps per K
    tier_hist: dict[int, int]  # steps per tier
    steps: int
    seconds: float  # wall time of the run (device synchronised at both ends)
    tokens: int  # output tokens over all requests
    idle_rows: int  # rows of requests already complete, learnt one step late
    waits: int  # times the host had to wait for a step's copy
    drafter_calls: int
    observed: int  # policy.observe calls
    captures: int  # drafter and prefill graphs captured during the run (0 when prepared)
    timed_out: bool
    margins: list[list[float]] = field(default_factory=list)  # [requests][outputs] top-1 - top-2 logit
    top1: list[list[float]] = field(default_factory=list)  # [requests][outputs] top-1 logit
    diverged_at: list[int | None] = field(default_factory=list)  # [requests] first index != reference
    itl_clean: list[bool] = field(default_factory=list)  # per itl entry: all its tokens before divergence
    decode_ms: float = 0.0  # time in decode/verify steps (prefill and admission left out)
    step_shapes: list[tuple[int, int, int]] = field(default_factory=list)  # per step (batch, K, tier)
    ride_tokens: list[int] = field(default_factory=list)  # per step: prompt tokens that rode (its bucket)
    full_ms: float = 0.0  # decode time of the steps that ran a full batch (rows == concurrency)
    full_tokens: int = 0  # tokens those steps emitted
    prefill_forwards: int = 0  # separate prefill forwards (none with mixed prefill)
    mixed_prefill_tokens: int = 0  # prompt tokens that rode in steps' forwards (mixed prefill)
    prefill_steps: int = 0  # mixed-prefill steps with no live row (the prompt pieces alone)
    timed_steps: int = 0  # steps whose device time went to the policy's ``observe_time``

    @property
    def mean_accept_len(self) -> float | None:
        """Output tokens per request per decode step (bonus included)."""
        return sum(self.itl_tokens) / len(self.itl_tokens) if self.itl_tokens else None

    @property
    def mean_accept_len_clean(self) -> float | None:
        """``mean_accept_len`` over the steps before each request's divergence from its reference."""
        clean = [n for n, ok in zip(self.itl_tokens, self.itl_clean, strict=True) if ok]
        return sum(clean) / len(clean) if clean else None

    @property
    def diverged_requests(self) -> int:
        return sum(d is not None for d in self.diverged_at)

    @property
    def decode_tokens(self) -> int:
        """Tokens emitted by decode/verify steps (the first token of each request is the prefill's)."""
        return sum(self.itl_tokens)

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_ms * 1e3 if self.decode_ms > 0 and self.itl_tokens else None

    @property
    def full_tok_s(self) -> float | None:
        """Decode tok/s over the steps that ran at full concurrency: the server's throughput
        under load, without the ramp and the drain of a closed run (where the batch shrinks to
        the slowest requests and a K chosen for a full batch no longer applies)."""
        return self.full_tokens / self.full_ms * 1e3 if self.full_ms > 0 and self.full_tokens else None


@dataclass
class RunLog:
    requests: Sequence[Request]
    reference: Sequence[Sequence[int]] | None = None  # [requests][<= max_new] expected outputs
    outputs: list[list[int]] = field(default_factory=list)
    margins: list[list[float]] = field(default_factory=list)
    top1: list[list[float]] = field(default_factory=list)
    diverged_at: list[int | None] = field(default_factory=list)
    inflight: list[int] = field(default_factory=list)  # prefills/steps launched, copy not read
    ttft_marks: dict[int, tuple[int, int]] = field(default_factory=dict)  # rid -> (admit, first)
    itl: list[tuple[int, int]] = field(default_factory=list)  # (iteration, tokens)
    itl_clean: list[bool] = field(default_factory=list)
    decode_spans: list[tuple[int, int]] = field(default_factory=list)  # (step mark, next iteration mark)
    full_iterations: set[int] = field(default_factory=set)  # iterations whose step ran a full batch
    full_spans: list[tuple[int, int]] = field(default_factory=list)  # decode_spans of those steps
    step_shapes: list[tuple[int, int, int]] = field(default_factory=list)
    ride_tokens: list[int] = field(default_factory=list)
    idle_rows: int = 0
    waits: int = 0
    mixed_tokens: int = 0  # prompt tokens that rode in steps' forwards
    prefill_steps: int = 0  # steps with no live row, only prompt pieces
    timed_steps: int = 0  # steps reported to ``observe_time``

    def __post_init__(self) -> None:
        n = len(self.requests)
        if self.reference is not None and len(self.reference) < n:
            raise ValueError(f"reference: {len(self.reference)} outputs for {n} requests")
        self.outputs, self.margins, self.top1 = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        self.diverged_at = [None] * n
        self.inflight = [0] * n

    def surely_done(self, rid: int) -> bool:
        return len(self.outputs[rid]) + self.inflight[rid] >= self.requests[rid].max_new_tokens

    def may_end(self, rid: int, width: int, steps: int = 1) -> bool:
        """Not known to be done, and done after ``steps`` more steps (0: already, on the device)
        if each step in flight and each of those emit ``width`` (K + 1) of its tokens."""
        return not self.surely_done(rid) and (len(self.outputs[rid]) + (self.inflight[rid] + steps) * width
                                              >= self.requests[rid].max_new_tokens)

    def take(self, copy: StepCopy) -> None:
        """Append a landed copy's tokens (and margins) to the outputs; check them against the
        reference (the divergence is learnt here, one step late)."""
        tokens = copy.tokens.tolist()
        counts = copy.counts.tolist() if copy.counts is not None else [1] * len(copy.rids)
        margins = copy.margins.tolist() if copy.margins is not None else None
        for row, rid in enumerate(copy.rids):
            self.inflight[rid] -= 1
            out = self.outputs[rid]
            start = len(out)
            take = max(0, min(counts[row], self.requests[rid].max_new_tokens - start))
            new = tokens[row][:take]
            out.extend(new)
            gap, top = margins[row] if margins is not None else (NO_MARGIN, NO_MARGIN)
            self.margins[rid].extend([gap] + [NO_MARGIN] * (take - 1) if take else [])
            self.top1[rid].extend([top] + [NO_MARGIN] * (take - 1) if take else [])
            clean = self._check(rid, start, new)
            if copy.counts is None:
                continue
            if take > 0:
                self.itl.append((copy.iteration, take))
                self.itl_clean.append(clean)
            else:
                self.idle_rows += 1

    def _check(self, rid: int, start: int, new: list[int]) -> bool:
        """Record the request's divergence; True when ``new`` lies wholly before it."""
        if self.reference is None:
            return True
        ref = self.reference[rid]
        at = self.diverged_at[rid]
        if at is None:
            at = next((start + j for j, t in enumerate(new) if start + j < len(ref) and t != ref[start + j]), None)
            self.diverged_at[rid] = at
        return start + len(new) <= min(len(ref), at if at is not None else len(ref))

    def result(self, marks: Marks, iter_marks: list[int], k_hist: dict[int, int], tier_hist: dict[int, int],
               seconds: float, observed: int, drafter_calls: int, captures: int, timed_out: bool,
               prefill_forwards: int = 0) -> RunResult:
        spans = [marks.ms(iter_marks[i], iter_marks[i + 1]) for i in range(len(iter_marks) - 1)]
        itl_ms = [spans[i] / n for i, n in self.itl]
        ttft: list[float | None] = [None] * len(self.requests)
        for rid, (a, b) in self.ttft_marks.items():
            ttft[rid] = marks.ms(a, b)
        done = [len(o) >= r.max_new_tokens for o, r in zip(self.outputs, self.requests, strict=True)]
        return RunResult(
            outputs=self.outputs, done=done, ttft_ms=ttft, itl_ms=itl_ms,
            itl_tokens=[n for _, n in self.itl], k_hist=dict(sorted(k_hist.items())),
            tier_hist=dict(sorted(tier_hist.items())), steps=sum(k_hist.values()), seconds=seconds,
            tokens=sum(len(o) for o in self.outputs), idle_rows=self.idle_rows, waits=self.waits,
            drafter_calls=drafter_calls, observed=observed, captures=captures, timed_out=timed_out,
            margins=self.margins, top1=self.top1, diverged_at=self.diverged_at, itl_clean=self.itl_clean,
            decode_ms=sum(marks.ms(a, iter_marks[b]) for a, b in self.decode_spans),
            step_shapes=self.step_shapes, ride_tokens=self.ride_tokens,
            full_ms=sum(marks.ms(a, iter_marks[b]) for a, b in self.full_spans),
            full_tokens=sum(n for i, n in self.itl if i in self.full_iterations),
            prefill_forwards=prefill_forwards, mixed_prefill_tokens=self.mixed_tokens,
            prefill_steps=self.prefill_steps, timed_steps=self.timed_steps,
        )
