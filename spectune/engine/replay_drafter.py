"""Drafting side of the engine: the proposer contract, CUDA graphs of proposals, the replay drafter.

A proposer answers ``propose(inp: DraftInput, k) -> (drafts [rows, k], confidences [rows, k] or
None)`` from the engine's per-row device state. ``DraftGraphs`` runs it on a padded row count and,
on CUDA, captures each (rows, K) once over the engine's static buffers.

Replay drafter: real verification and drafter cost with a chosen acceptance process. With random
weights a drafter's guesses are meaningless, so the drafts come from the target itself. Each
request's reference continuation (its plain greedy output) is loaded beforehand, with a table
``run[r, p]``: how many drafts in a row are right for a step of request r that starts at output
index p. Draft j (0-based) of that step is

    reference[r, p + j]            if j < run[r, p]     (right)
    (reference[r, p + j] + 1) % V  otherwise            (a different token)

and the target's greedy acceptance does the rest. ``offered[r, p]`` caps the drafts the step may
verify (the engine lowers its ``k_valid`` to it): a drafter that proposes fewer than K.

Two ways to fill the tables (either per engine run, the same captured graphs serve both):

- ``load(references, accept, coins)``, sampled rates: ``accept[r]`` is one sampled row of an
  acceptance model per request (its class), ``coins`` are uniforms keyed by (request, output
  index), and draft j of a step at p is right while ``coins[r, p + j] < accept[r, j]`` -- so draft
  position j is right with the conditional probability ``accept[r, j]`` given the ones before it,
  and arms that verify different K see the same hard and easy tokens. Every step offers K.
- ``load_tokens(references, tables)``, token-by-token replay of a real drafter's trace
  (``spectune.models.trace_steps.TokenTables``, built by ``spectune.engine.trace_replay``): run,
  offered and the drafter's own confidence per (request, output index, draft position).

Confidences handed to the verifier's allocation (``set_allocation``), never the right/wrong truth:

- ``confidence``: the trace's confidences of this step's drafts (token replay only);
- ``history``: what a runtime knows without confidences, each request's own acceptance history
  shrunk toward the population rates (``spectune.runtime.request_history``), from two device
  counters per request, accepted and expected-accepted drafts, which ``record_step`` updates from
  each step's grants and accepted counts (device ops on the step's outputs, no host sync).
  ``reset_history`` (at the start of every engine run) zeroes them and restores the rates to the
  prior, so a request starts at the population; ``set_rates`` takes the policy's live estimate
  (``Planner.rates``) when it has one;
- ``uniform``: one constant for every draft, so the budget is shared out equally (ties go to the
  lower position first, then the lower row).

The mode is a device vector of weights, so switching it between runs keeps captured graphs valid.
``load`` sets ``history``, ``load_tokens`` ``confidence``.

The replay is faithful only while a run's context is the reference's. When a request's emitted
tokens leave its reference (in bf16 a near tie can flip between plain and verification forwards),
later drafts are proposed for the wrong context and mostly rejected; the engine notices when the
tokens reach the host (``Engine.run(..., reference=...)``) and keeps those steps out of the clean
acceptance (``RunResult.mean_accept_len_clean``).

The drafter's time is real: ``cost_drafter.propose(hidden, last_ids, k, context_lens=...)`` (an
``EagleDrafter`` or ``BlockDrafter`` of the production shape) runs for every proposal on random
target features and its output is discarded. Everything here is device work on static buffers, so
a proposal can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from spectune.errors import SpectuneError
from spectune.runtime.request_history import expected_accepts, request_confidences


class DraftError(SpectuneError):
    """A proposer was given impossible sizes or inputs; names the argument."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"{name}: {reason}")


@dataclass(frozen=True)
class DraftInput:
    """What a proposer reads: views of the engine's static row buffers, ``rows`` >= batch (rows
    past the batch hold stale values; their drafts are ignored)."""

    last_token: Tensor  # [rows] int64, last emitted token (not yet in the KV cache)
    context_lens: Tensor  # [rows] int32, tokens in the KV cache
    produced: Tensor  # [rows] int32, output tokens emitted so far (the next one has this index)
    request: Tensor  # [rows] int64, index of the row's request in the run


class Proposer(Protocol):
    def propose(self, inp: DraftInput, k: int) -> tuple[Tensor, Tensor | None]:
        """drafts [rows, k] int64 and confidences [rows, k] float32 (None: the verifier's prior)."""
        ...


# ---------------------------------------------------------------------------------------------
# Proposals in CUDA graphs


class DraftGraphs:
    """Runs the proposer on a padded row count (powers of two, then max_batch); with ``capture``
    each (rows, K) is a CUDA graph captured once over static row buffers (``inputs(rows)`` must
    return views of the same storage every time)."""

    def __init__(self, proposer: Proposer | None, inputs: Callable[[int], DraftInput], max_batch: int,
                 capture: bool):
        self.proposer, self.inputs, self.capture = proposer, inputs, capture
        self.ladder = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch}
                             | {max_batch})
        self.graphs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], tuple[Tensor, Tensor | None]] = {}
        self.calls = 0
        self.captures = 0
        self._pool: Any = None

    def rows_for(self, n: int) -> int:
        return next(r for r in self.ladder if r >= n)

    def prepare(self, k: int, max_rows: int) -> None:
        if not self.capture or self.proposer is None or k <= 0:
            return
        for rows in self.ladder:
            if rows > self.rows_for(max_rows):
                break
            if (rows, k) not in self.graphs:
                self._capture(rows, k)

    def __call__(self, n: int, k: int) -> tuple[Tensor, Tensor | None]:
        if self.proposer is None:
            raise DraftError("proposer", f"plan asks for K = {k} drafts but there is no proposer")
        self.calls += 1
        rows = self.rows_for(n)
        if not self.capture:
            return self.proposer.propose(self.inputs(rows), k)
        if (rows, k) not in self.graphs:
            self._capture(rows, k)
        self.graphs[(rows, k)].replay()
        return self.outputs[(rows, k)]

    def _capture(self, rows: int, k: int) -> None:
        assert self.proposer is not None
        inp = self.inputs(rows)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels compiled, allocator settled
            self.proposer.propose(inp, k)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.proposer.propose(inp, k)
        self.graphs[(rows, k)], self.outputs[(rows, k)] = graph, out
        self.captures += 1


# ---------------------------------------------------------------------------------------------
# Replay drafter


ALLOCATIONS = ("confidence", "history", "uniform")  # what the verifier's allocation ranks by
UNIFORM_CONF = 0.5  # the uniform allocation's constant (< 1, so survival falls along positions)


class ReplayDrafter:
    def __init__(self, *, max_requests: int, max_len: int, max_k: int, vocab_size: int,
                 device: torch.device | str, cost_drafter: Any = None, hidden: Tensor | None = None,
                 prior: Sequence[float] | None = None, max_rows: int | None = None):
        if min(max_requests, max_len, max_k, vocab_size) < 1:
            raise DraftError("replay", "max_requests, max_len, max_k and vocab_size must be >= 1")
        if cost_drafter is not None and hidden is None:
            raise DraftError("hidden", "the cost drafter needs target features [max_batch, dim]")
        dev = torch.device(device)
        self.vocab_size, self.max_len, self.max_k = vocab_size, max_len, max_k
        self.cost_drafter, self.hidden = cost_drafter, hidden  # hidden: [max_batch, dim]
        self.reference = torch.zeros(max_requests, max_len, dtype=torch.int64, device=dev)  # [R, L]
        self.accept = torch.zeros(max_requests, max_k, dtype=torch.float32, device=dev)  # [R, max_k]
        self.run = torch.zeros(max_requests, max_len, dtype=torch.int64, device=dev)  # [R, L] right drafts in a row
        self.step_offered = torch.full((max_requests, max_len), max_k, dtype=torch.int32, device=dev)  # [R, L]
        self.step_conf = torch.zeros(max_requests, max_len, max_k, dtype=torch.float32, device=dev)  # [R, L, max_k]
        self.offered = torch.full((max(max_rows or 0, max_requests),), max_k, dtype=torch.int32, device=dev)
        # ^ [rows] drafts offered by the last proposal's rows (the engine caps k_valid by it)
        self.weights = torch.zeros(len(ALLOCATIONS), dtype=torch.float32, device=dev)  # [3] allocation mode
        self.allocation = ""
        self.offsets = torch.arange(max_k, dtype=torch.int64, device=dev)  # [max_k]
        self.cost_calls = 0
        base = list(prior) if prior else [0.7]
        self.prior = [float(min(1.0, max(0.0, a))) for a in (base + [base[-1]] * max_k)[:max_k]]
        self.rates = torch.tensor(self.prior, dtype=torch.float32, device=dev)  # [max_k] population rates
        self.rates_cum = torch.zeros(max_k + 1, dtype=torch.float32, device=dev)  # [max_k + 1] 0, cumsum
        self.hist_acc = torch.zeros(max_requests, dtype=torch.float32, device=dev)  # [R] accepted drafts
        self.hist_exp = torch.zeros(max_requests, dtype=torch.float32, device=dev)  # [R] expected accepts
        self._host_rates: list[float] | None = None
        self.reset_history()
        self.set_allocation("history")

    def set_allocation(self, mode: str) -> None:
        """What the allocation ranks by: ``confidence``, ``history`` or ``uniform`` (module doc)."""
        if mode not in ALLOCATIONS:
            raise DraftError("allocation", f"must be one of {', '.join(ALLOCATIONS)}, got {mode!r}")
        self.weights.copy_(torch.tensor([float(m == mode) for m in ALLOCATIONS]))
        self.allocation = mode

    # -- per-request history (what the allocation ranks by) -------------------------------------

    def reset_history(self) -> None:
        """A new run: every request starts at the population, rates back to the prior."""
        self.hist_acc.zero_()
        self.hist_exp.zero_()
        self._host_rates = None
        self.set_rates(self.prior)

    def set_rates(self, rates: Sequence[float]) -> None:
        """The population rates [<= max_k] (the policy's live estimate); copied only when changed."""
        values = [float(min(1.0, max(0.0, a))) for a in list(rates)[: self.max_k]]
        values += self.prior[len(values):]
        if values == self._host_rates:
            return
        self._host_rates = values
        host = torch.tensor(values, dtype=torch.float32)
        if self.rates.device.type == "cuda":
            host = host.pin_memory()
        self.rates.copy_(host, non_blocking=self.rates.device.type == "cuda")
        torch.cumsum(self.rates, 0, out=self.rates_cum[1:])

    def record_step(self, request: Tensor, granted: Tensor, accepted: Tensor) -> None:
        """After a verify step: request [n] int64, granted [n] and accepted [n] drafts (device)."""
        acc = accepted.long()
        self.hist_acc.index_add_(0, request, acc.float())
        self.hist_exp.index_add_(0, request, expected_accepts(self.rates_cum, granted.long(), acc))

    def load(self, references: Sequence[Sequence[int]], accept: Tensor, coins: Tensor) -> None:
        """Write a run's references [R][<= L], conditional rates [R, >= max_k] and coins
        [R, >= L] into the static buffers (in place: captured graphs keep reading them)."""
        n = len(references)
        if n > self.reference.shape[0]:
            raise DraftError("references", f"{n} requests, the drafter holds {self.reference.shape[0]}")
        if accept.shape[0] < n or accept.shape[1] < self.max_k:
            raise DraftError("accept", f"must be [>= {n}, >= {self.max_k}], got {list(accept.shape)}")
        if coins.shape[0] < n or coins.shape[1] < self.max_len:
            raise DraftError("coins", f"must be [>= {n}, >= {self.max_len}], got {list(coins.shape)}")
        self._load_references(references)
        self.accept[:n].copy_(accept[:n, : self.max_k])
        # run[r, p]: drafts j = 0.. in a row with coins[r, p + j] < accept[r, j] (indices past the
        # end read the last coin, as the drafts read the last reference token)
        pos = (torch.arange(self.max_len)[:, None] + torch.arange(self.max_k)[None, :]).clamp_(max=self.max_len - 1)
        kept = coins[:n, : self.max_len].cpu()[:, pos] < accept[:n, None, : self.max_k].cpu()  # [n, L, max_k]
        self.run[:n].copy_(kept.to(torch.int64).cumprod(dim=2).sum(dim=2))
        self.step_offered[:n].fill_(self.max_k)
        self.step_conf[:n].zero_()
        self.set_allocation("history")

    def load_tokens(self, references: Sequence[Sequence[int]], tables: Any,
                    prior: Sequence[float] | None = None) -> None:
        """Token-by-token replay: references [R][<= L] and ``TokenTables`` (run, offered [>= R, >= L],
        conf [>= R, >= L, K]); positions past the tables' K offer nothing. ``prior`` [<= max_k]:
        new population rates for the history allocation (e.g. the trace's)."""
        n = len(references)
        run, offered, conf = (torch.as_tensor(np.asarray(x)) for x in (tables.run, tables.offered, tables.conf))
        if run.shape[0] < n or run.shape[1] < self.max_len or offered.shape != run.shape or conf.shape[:2] != run.shape:
            raise DraftError("tables", f"must cover [{n}, {self.max_len}], got run {list(run.shape)}, "
                             f"offered {list(offered.shape)}, conf {list(conf.shape)}")
        self._load_references(references)
        k = min(self.max_k, conf.shape[2])
        self.run[:n].copy_(run[:n, : self.max_len].clamp(0, k))
        self.step_offered[:n].copy_(offered[:n, : self.max_len].clamp(0, k).to(torch.int32))
        self.step_conf[:n].zero_()
        self.step_conf[:n, :, :k].copy_(conf[:n, : self.max_len, :k].float())
        if prior is not None:
            base = list(prior) or [0.7]
            self.prior = [float(min(1.0, max(0.0, a))) for a in (base + [base[-1]] * self.max_k)[: self.max_k]]
            self.reset_history()
        self.set_allocation("confidence")

    def _load_references(self, references: Sequence[Sequence[int]]) -> None:
        n = len(references)
        if n > self.reference.shape[0]:
            raise DraftError("references", f"{n} requests, the drafter holds {self.reference.shape[0]}")
        rows = torch.zeros(n, self.max_len, dtype=torch.int64)
        for i, ref in enumerate(references):
            toks = list(ref)[: self.max_len]
            rows[i, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        self.reference[:n].copy_(rows)

    def propose(self, inp: DraftInput, k: int) -> tuple[Tensor, Tensor]:
        rows = inp.last_token.shape[0]
        if self.cost_drafter is not None:
            assert self.hidden is not None
            self.cost_calls += 1
            self.cost_drafter.propose(self.hidden[:rows], inp.last_token, k, context_lens=inp.context_lens)
        if rows > self.offered.shape[0]:
            raise DraftError("rows", f"{rows} rows, the drafter holds {self.offered.shape[0]} (max_rows)")
        req = inp.request  # [rows] int64
        at = inp.produced.long().clamp(0, self.max_len - 1)  # [rows] output index the step starts at
        pos = (at[:, None] + self.offsets[None, :k]).clamp_(max=self.max_len - 1)  # [rows, k]
        truth = self.reference[req[:, None], pos]  # [rows, k]
        kept = self.offsets[None, :k] < self.run[req, at][:, None]  # the replayed truth decides drafts...
        drafts = torch.where(kept, truth, (truth + 1) % self.vocab_size)
        self.offered[:rows].copy_(self.step_offered[req, at])
        # ... the allocation sees the drafter's confidences, the request's history or a constant: [rows, k]
        w = self.weights
        conf = (w[0] * self.step_conf[req, at, :k]
                + w[1] * request_confidences(self.rates[:k], self.hist_acc[req], self.hist_exp[req])
                + w[2] * UNIFORM_CONF)
        return drafts, conf
