"""A minimal continuous-batching engine: where a server calls ``plan``, ``step`` and ``observe``.

One iteration of ``Engine.run`` (a request is a prompt and ``max_new_tokens``; greedy only):
  collect   host copies of earlier steps' emitted tokens that have landed -> request outputs
  retire    requests the host knows are complete leave the batch (rows compacted on the device);
            their KV blocks go back to the free list
  admit     waiting requests take rows up to the concurrency: chunked prefill over the paged KV
            cache (one captured graph per token bucket, ``prefill.py``); the argmax at the last
            prompt token is the first output token. With ``mixed_prefill`` there is no separate
            forward: the prompts' pieces ride in the steps' forwards (``mixed.py``, <=
            ``prefill_budget`` tokens a step) and a row joins the batch after the step that
            ended its prompt; a burst (more than ``ride_limit`` prompt tokens admitted at once,
            none filling: a closed run's wave) takes separate forwards, where one large forward
            is cheaper than pieces on steps that already run at the compute knee. With
            ``admit_ahead`` a row that may be done after the coming step (``RunLog.may_end``:
            its tokens seen plus K + 1 for each step in flight and for the coming one reach its
            length) lends its slot now to a successor whose whole prompt rides in that step:
            the prompt is cached beside the row's last steps and the successor waits ready
            (first token known, no decoding) until a slot frees, then joins at once, so no step
            runs a row short while a prompt rides and a slot the host learns of late is filled
            the step it learns of it (at most ``admit_ahead`` requests beyond ``max_batch``
            rows, ready or filling; their KV blocks come from the same free list)
  observe   ``verifier.poll_stats()`` (counters of an earlier step) -> ``policy.observe``; the
            device time of each earlier step whose end mark has landed (``Event.query``, no
            sync; a step that captured a graph or carried prompt pieces is not reported) ->
            ``policy.observe_time``
  plan      ``policy.plan(batch)``: K, verify budget, tier (a host lookup); a step that carries
            P prompt tokens (mixed prefill) asks ``policy.plan_ride(batch, P)`` where the policy
            has it (the planner may run a smaller K there); the policy's live ``rates`` (if any)
            go to a proposer with ``set_rates``
  draft     if K > 0: the proposer's K drafts and confidences (one CUDA graph per (rows, K)); a
            proposer with an ``offered`` row buffer (the replay drafter) caps each row's drafts
            at what it proposed
  step      ``verifier.step(...)``: allocate, pack, target graph replay, greedy accept, stats
  advance   on the device: KV length and output count += emitted, last token = last emitted;
            a proposer with ``record_step`` (the replay drafter) adds the step's grants and
            accepted drafts to each request's history; one non-blocking copy of the emitted
            tokens into pinned host memory

Completion is by ``max_new_tokens`` (random-weight greedy decoding has no end-of-sequence token).
The device caps each request's drafts at ``remaining - 1`` so no request emits more than it asked
for, and every step emits >= 1 token per request; so the host knows a request is complete when
``tokens it has seen + steps in flight >= max_new_tokens``, without reading the device. That is
exact for plain decoding. A speculative request that finished with a long acceptance is learnt
when its copy lands: it rides along in one more step as a single row without drafts
(``RunResult.idle_rows``), its output ignored.

Host waits per iteration, all of them: before planning step s, the copy of step s - 2 must have
landed (``event.synchronize()``; it waits only when the host is more than one step ahead of the
GPU, counted in ``RunResult.waits``). So a request that ended on step s - 1 by emitting two or
more tokens is learnt a step late and rides step s as an idle row (``RunResult.idle_rows``; the
simulator's ``host_lag``). With ``await_ends`` the host also waits for step s - 1's copy when a
live row may have ended on it (its tokens seen plus K + 1 for each step in flight reach its
``max_new_tokens``) and a request is queued for the slot: a short stall of the device in place of
an idle row and a late admission (at batch 1 an idle row is a whole step). Admission copies
prompts and block tables from pinned memory without waiting. On CUDA, a (rows, K) drafter graph
or a prefill bucket not captured by ``prepare`` / ``warm_prefill`` is captured when first needed
(``RunResult.captures``), which synchronises once.

What a run records besides tokens (``engine_run``): per output token the top-1 minus top-2 logit
of the forward that chose it (plain decoding and prefill; written on the device and copied with
the tokens), each request's first divergence from an optional ``reference``, and the time spent in
decode/verify steps apart from prefill and admission.

A policy is the planner or any object with ``plan(batch)`` (``observe`` optional); the bench's
arms (plain, fixed:K, auto) are such policies. Imports only torch and spectune.runtime /
spectune.kernels; the target and the proposer (``replay_drafter.Proposer``) are duck-typed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from spectune.engine.mixed import Filling, MixedPrefill, ride_shapes
from spectune.engine.prefill import Piece, PrefillGraphs, schedule
from spectune.engine.replay_drafter import DraftGraphs, DraftInput, Proposer
from spectune.engine.run_log import (
    MarginTap,
    Marks,
    Request,
    RunLog,
    RunResult,
    StepCopy,
)
from spectune.errors import SpectuneError
from spectune.kernels.attention_metadata import AttnMeta
from spectune.runtime.planner import Plan
from spectune.runtime.prefill_plan import (
    PREFILL_CHUNK,
    PREFILL_TOKENS,
    RIDE_BUDGET,
    RIDE_PIECES,
    ends_next_forward,
)
from spectune.runtime.step import AdaptiveVerifier, GraphPool, StepOutput

TRASH_BLOCK = 0  # KV block no request owns: unused block-table entries (and overruns) point here
KV_SLACK = 8  # KV positions per request past prompt + max_new_tokens + max_k (ride-along rows)

# target forward: (input_ids [T] int64, positions [T] int64, meta) -> logits [T, V]
TargetFn = Callable[[Tensor, Tensor, AttnMeta], Tensor]


class EngineError(SpectuneError):
    """An engine was given an impossible request, plan or size; names the field."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"{name}: {reason}")


class Policy(Protocol):
    """``spectune.runtime.planner.Planner`` or any object with ``plan``; ``observe``,
    ``observe_time`` and ``plan_ride`` (a riding step's shape) optional."""

    def plan(self, batch_size: int) -> Plan: ...


# ---------------------------------------------------------------------------------------------
# Device state of the live rows


@dataclass(frozen=True)
class EngineState:
    last_token: Tensor  # [max_batch] int64
    context_lens: Tensor  # [max_batch] int32
    produced: Tensor  # [max_batch] int32
    max_new: Tensor  # [max_batch] int32
    request: Tensor  # [max_batch] int64
    k_valid: Tensor  # [max_batch] int32, drafts a request may still use (<= remaining - 1)
    block_tables: Tensor  # [max_batch, max_blocks] int32, TRASH_BLOCK where unused

    @classmethod
    def make(cls, max_batch: int, max_blocks: int, device: torch.device) -> EngineState:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros(max_batch, dtype=torch.int64), zeros(max_batch), zeros(max_batch),
                   zeros(max_batch), zeros(max_batch, dtype=torch.int64), zeros(max_batch),
                   torch.full((max_batch, max_blocks), TRASH_BLOCK, dtype=torch.int32, device=device))

    def draft_input(self, rows: int) -> DraftInput:
        return DraftInput(self.last_token[:rows], self.context_lens[:rows], self.produced[:rows],
                          self.request[:rows])

    def reorder(self, keep: Tensor) -> None:
        """Rows ``keep`` [m] int64 (device) become rows 0..m-1, in that order."""
        m = keep.shape[0]
        for t in (self.last_token, self.context_lens, self.produced, self.max_new, self.request,
                  self.block_tables):
            t[:m].copy_(t.index_select(0, keep))


def _to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":  # pinned + non_blocking: the host does not wait for the stream
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _to_host(t: Tensor) -> Tensor:
    if t.device.type != "cuda":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


# ---------------------------------------------------------------------------------------------
# Engine


class Engine:
    """One target (with a paged KV backend), its graph pool and verifier, and an optional proposer."""

    def __init__(self, target: TargetFn, *, tiers: Sequence[int], max_batch: int, max_k: int,
                 max_len: int, num_blocks: int, device: torch.device | str, block_size: int = 16,
                 proposer: Proposer | None = None, prior: Sequence[float] | None = None,
                 capture: bool | None = None, kernels: bool | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 prefill_tokens: int = PREFILL_TOKENS, mixed_prefill: bool = False, prefill_budget: int = RIDE_BUDGET,
                 ride_limit: int | None = None, ride_pieces: int = RIDE_PIECES, admit_ahead: int = 0,
                 await_ends: bool = False):
        self.device = torch.device(device)
        if admit_ahead < 0:
            raise EngineError("admit_ahead", f"must be >= 0 (rows), got {admit_ahead}")
        if admit_ahead and not mixed_prefill:
            raise EngineError("admit_ahead", "needs mixed_prefill (an admission ahead rides beside the row it replaces)")
        self.admit_ahead = admit_ahead
        self.await_ends = await_ends  # wait for the last step's tokens where a row may have ended
        # engine rows: the live ones, then the prompts filling (admitted ahead: up to admit_ahead
        # more while the rows they replace run their last step)
        self.state_rows = max_batch + admit_ahead
        self.max_blocks = -(-max_len // block_size)
        # mixed prefill: an admission of more prompt tokens than this (nothing else filling) is a
        # burst, prefilled by separate forwards; smaller ones ride in the steps (``_rides``)
        self.ride_limit = prefill_budget if ride_limit is None else ride_limit
        for name, value, lo in (("max_batch", max_batch, 1), ("max_len", max_len, 1),
                                ("prefill_chunk", prefill_chunk, 1), ("prefill_tokens", prefill_tokens, 1),
                                ("prefill_budget", prefill_budget, 1), ("ride_limit", self.ride_limit, 1),
                                ("ride_pieces", ride_pieces, 1),
                                ("num_blocks", num_blocks, 1 + self.max_blocks)):
            if value < lo:
                raise EngineError(name, f"must be >= {lo}, got {value}")
        self.target, self.block_size, self.max_len = target, block_size, max_len
        self.max_batch, self.max_k, self.num_blocks = max_batch, max_k, num_blocks
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        # the decode graphs also write each token's top-1 minus top-2 logit (engine_run.MarginTap)
        self.tap = MarginTap(target, max(int(t) for t in tiers), self.device)
        self.state = EngineState.make(self.state_rows, self.max_blocks, self.device)
        # mixed prefill: prompt pieces ride in the steps' forwards (mixed.py)
        self.mixed = (MixedPrefill(self.tap, self.state.block_tables, max_rows=self.state_rows, chunk=prefill_chunk,
                                   budget=prefill_budget, block_size=block_size, device=self.device,
                                   max_pieces=ride_pieces)
                      if mixed_prefill else None)
        self.pool = GraphPool(self.tap, tiers, max_batch=max_batch, max_k=max_k, device=self.device,
                              block_size=block_size, max_blocks=self.max_blocks, capture=capture,
                              kernels=kernels, rider=self.mixed)
        self.verifier = AdaptiveVerifier(self.pool, prior=prior)
        self.drafts = DraftGraphs(proposer, self.state.draft_input, max_batch, self.pool.capture)
        self.prefill = PrefillGraphs(target, self.state.block_tables, max_rows=max_batch,
                                     chunk=prefill_chunk, max_tokens=prefill_tokens, device=self.device,
                                     capture=self.pool.capture)
        self.cuda = self.device.type == "cuda"
        self._reset()

    @property
    def tiers(self) -> tuple[int, ...]:
        return tuple(self.pool.tiers)

    def _reset(self) -> None:
        self.rows: list[int] = []  # request of each live row
        self.ready: list[int] = []  # admitted ahead, prompt cached, waiting for a slot (rows after self.rows)
        self.concurrency = self.max_batch  # of the run (``run``)
        self.last_width = 1  # K + 1 of the last step run: what a step may emit per row
        self.free_blocks = deque(b for b in range(self.num_blocks) if b != TRASH_BLOCK)
        self.blocks: dict[int, list[int]] = {}  # request -> its KV blocks
        self.pending: deque[StepCopy] = deque()
        self.filling = Filling()  # mixed prefill: admitted, prompt not yet cached (rows after the ready ones)

    def blocks_for(self, request: Request) -> int:
        return -(-(len(request.prompt) + request.max_new_tokens + self.max_k + KV_SLACK) // self.block_size)

    def prepare(self, ks: Sequence[int], concurrency: int, draft_shapes: Mapping[int, int] | None = None) -> None:
        """Capture the drafter graphs a run at ``concurrency`` with these K values will replay (and
        those of ``draft_shapes``, K -> the largest batch it may draft at: what an adaptive policy
        may move to, ``Planner.draft_shapes``) and, with mixed prefill on CUDA, the riding step
        graphs of every tier up to the one a full batch drafting max(ks) each needs, or a batch of
        ``draft_shapes`` drafting its K (``mixed.ride_shapes``; any other is captured when first
        used)."""
        rows = {k: min(concurrency, self.max_batch) for k in ks}
        for k, b in (draft_shapes or {}).items():
            rows[k] = max(rows.get(k, 0), min(b, concurrency, self.max_batch))
        for k in sorted(rows):
            self.drafts.prepare(k, rows[k])
        if self.mixed is not None and self.pool.capture:
            for tier, verify, ride in ride_shapes(self.tiers, ks, min(concurrency, self.max_batch),
                                                  self.mixed.buckets, draft_shapes):
                self.pool.prepare_ride(tier, verify, ride)

    def warm_prefill(self, prompt_lens: Sequence[int], max_group: int) -> None:
        """Capture (CUDA) or run once (elsewhere) the prefill forwards that admitting 1..max_group
        prompts of these lengths at once will use: graphs and kernels specialised on the
        forward's shapes are built here, not inside a timed run. With mixed prefill only the
        bursts' forwards (more than ``ride_limit`` prompt tokens at once; ``prepare`` captures the
        riding step graphs)."""
        groups: dict[int, tuple[int, int]] = {}  # bucket -> one (prompts, length) admission that uses it
        for g in range(1, min(max_group, self.max_batch) + 1):
            for n in set(prompt_lens):
                if self._rides(g * n):
                    continue  # rides in the steps
                for pieces in schedule([n] * g, self.prefill_chunk, self.prefill_tokens):
                    groups.setdefault(self.prefill.bucket(sum(p.length for p in pieces)), (g, n))
        if not groups:
            return
        if self.prefill.capture:
            self.prefill.prepare(sorted(groups))
            return
        for g, n in groups.values():  # eager: compile the kernels once per shape
            # the admission itself (g prompts of n tokens in rows 0..g-1, KV into the trash block):
            # one prompt of the bucket's length would overrun a request's block table
            self.state.block_tables[:g].fill_(TRASH_BLOCK)
            self.prefill.run([(1,) * n] * g, 0)

    def check(self, requests: Sequence[Request], concurrency: int) -> None:
        if not 1 <= concurrency <= min(self.max_batch, self.tiers[-1]):
            raise EngineError("concurrency", f"{concurrency} is outside 1..{min(self.max_batch, self.tiers[-1])}")
        for i, r in enumerate(requests):
            if not r.prompt or r.max_new_tokens < 1:
                raise EngineError(f"requests[{i}]", "needs a prompt and max_new_tokens >= 1")
            if self.blocks_for(r) > self.max_blocks:
                raise EngineError(f"requests[{i}]", f"{len(r.prompt)} + {r.max_new_tokens} tokens "
                                  f"exceed max_len {self.max_len - self.max_k - KV_SLACK}")

    # -- the loop -------------------------------------------------------------------------------

    def run(self, requests: Sequence[Request], policy: Policy, *, concurrency: int,
            time_limit_s: float | None = None,
            reference: Sequence[Sequence[int]] | None = None) -> RunResult:
        """Serve ``requests`` with at most ``concurrency`` live. ``reference`` [requests][tokens]:
        the outputs expected (the replay drafter's continuations); each request's first
        differing index is learnt when its copy lands (``RunResult.diverged_at``)."""
        self.check(requests, concurrency)
        if reference is not None and len(reference) < len(requests):
            raise EngineError("reference", f"{len(reference)} outputs for {len(requests)} requests")
        self._synchronize()
        self.verifier.poll_stats()  # drop counts of earlier runs
        self._reset()
        observe = getattr(policy, "observe", None)
        observe_time = getattr(policy, "observe_time", None)
        plan_ride = getattr(policy, "plan_ride", None)
        timing: deque[tuple[int, int, int, Plan]] = deque()  # steps whose device time is not reported yet
        proposer = self.drafts.proposer
        reset_history = getattr(proposer, "reset_history", None)
        if reset_history is not None:
            reset_history()  # per-request acceptance history starts empty (replay_drafter)
        run, marks = RunLog(requests, reference), Marks(self.cuda)
        queue = deque(range(len(requests)))
        k_hist: dict[int, int] = {}
        tier_hist: dict[int, int] = {}
        calls0, captures0, observed, it, timed_out = self.drafts.calls, self._captures(), 0, 0, False
        forwards0 = self.prefill.forwards
        iter_marks: list[int] = []
        t0 = time.perf_counter()
        self.concurrency = concurrency
        while queue or self.rows or self.ready or self.filling:
            self._collect(run, must_before=it if self.await_ends and queue and self._may_have_ended(run) else it - 1)
            self._retire(run)
            self._promote()
            if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                timed_out = True
                break
            iter_marks.append(marks.mark())
            self._admit(run, queue, concurrency, it, marks, iter_marks[-1])
            self._retire(run)  # max_new_tokens == 1: done at its prefill
            self._promote()
            n = len(self.rows)
            if n == 0:  # every admitted request was done at its prefill, or its prompt is being cached
                if self.filling:
                    self._prefill_step(run, it, marks)
                it += 1
                continue
            step_mark = marks.mark()  # decode time runs from here to the next iteration's mark
            if observe is not None:
                stats = self.verifier.poll_stats()
                if stats is not None:
                    observe(stats.accepted_per_pos, stats.offered_per_pos)
                    observed += 1
            if observe_time is not None:
                run.timed_steps += _report_times(timing, marks, iter_marks, observe_time)
            pieces, ride = self._next_ride(run)
            # a step that carries prompt tokens may run another shape (``Planner.plan_ride``)
            plan = self._checked(plan_ride(n, ride) if ride and plan_ride is not None else policy.plan(n), n)
            captures_before = self._captures()
            self._share_rates(policy)
            assert plan.tier is not None
            self._load_ride(run, pieces, ride, plan.tier, plan.k > 0, n + len(self.ready))
            drafts = conf = k_valid = None
            if plan.k > 0:
                drafts, conf = self.drafts(n, plan.k)
                k_valid = self._k_valid(n, plan.k)
            out = self.verifier.step(self.state.last_token, drafts, conf, n, plan,
                                     context_lens=self.state.context_lens,
                                     block_tables=self.state.block_tables, k_valid=k_valid, ride=ride,
                                     copy_stats=False)
            if plan.k > 0:
                self._count_declined(out, n, plan.k)
            self.verifier.copy_stats()  # (after the declined drafts: they read with this step's counts)
            self._advance(run, out, n, it)
            self.last_width = plan.k + 1
            if pieces:
                self._join(run, pieces, n, it, marks)
            run.decode_spans.append((step_mark, len(iter_marks)))
            # a step that captured a graph, or carried prompt pieces, is not the plan's cost
            if observe_time is not None and not ride and self._captures() == captures_before:
                timing.append((step_mark, len(iter_marks), n, plan))
            if n == concurrency:
                run.full_spans.append(run.decode_spans[-1])
                run.full_iterations.add(it)
            run.step_shapes.append((n, plan.k, out.tier))
            run.ride_tokens.append(ride)
            k_hist[plan.k] = k_hist.get(plan.k, 0) + 1
            tier_hist[out.tier] = tier_hist.get(out.tier, 0) + 1
            it += 1
        end = marks.mark()
        iter_marks.append(end)
        self._synchronize()
        seconds = time.perf_counter() - t0
        self._collect(run, must_before=it + 1)
        return run.result(marks, iter_marks, k_hist, tier_hist, seconds, observed,
                          self.drafts.calls - calls0, self._captures() - captures0, timed_out,
                          self.prefill.forwards - forwards0)

    def _share_rates(self, policy: Policy) -> None:
        """The policy's live population rates (``Planner.rates``) to a proposer that ranks by them."""
        rates, set_rates = getattr(policy, "rates", None), getattr(self.drafts.proposer, "set_rates", None)
        if rates is not None and set_rates is not None:
            set_rates(rates)

    def _captures(self) -> int:
        return self.drafts.captures + self.prefill.captures + self.pool.ride_captures

    def _checked(self, plan: Plan, n: int) -> Plan:
        if plan.tier is None or plan.tier not in self.pool.tiers:
            raise EngineError("plan.tier", f"{plan.tier} for batch {n} is not a captured tier {self.tiers}")
        if plan.k > self.max_k:
            raise EngineError("plan.k", f"{plan.k} exceeds the engine's max_k {self.max_k}")
        return plan

    def _k_valid(self, n: int, k: int) -> Tensor:
        kv = self._room(n, k, out=self.state.k_valid[:n])
        offered = getattr(self.drafts.proposer, "offered", None)  # [>= n] int32: drafts it proposed
        return kv if offered is None else torch.minimum(kv, offered[:n], out=kv)

    def _room(self, n: int, k: int, out: Tensor | None = None) -> Tensor:
        """Drafts each row's remaining tokens leave room for: max_new - produced - 1, in 0..k."""
        s = self.state
        return torch.sub(s.max_new[:n], s.produced[:n], out=out).sub_(1).clamp_(0, k)

    def _count_declined(self, out: StepOutput, n: int, k: int) -> None:
        """A draft the proposer declined (it offered fewer than the step could verify, and every
        draft it did offer was accepted) counts as tested and rejected at that position: the
        step paid for the slot, and the controller must see the yield per planned draft, not
        only per offered one (an n-gram drafter without a match offers nothing). On the device,
        into the verifier's cumulative counters before this step's copy of them (so a step's
        counts are whole: the controller reads per step at batch 1), no sync."""
        offered = getattr(self.drafts.proposer, "offered", None)
        if offered is None:
            return
        room = self._room(n, k)  # before _advance
        grant = out.grant.to(torch.int64)
        declined = ((out.num_out[:n].to(torch.int64) - 1 == grant) & (grant == offered[:n].to(torch.int64))
                    & (grant < room.to(torch.int64)))
        tested = self.pool.buf.stats.offered_per_pos  # a view into the counters
        tested.scatter_add_(0, grant.clamp(max=tested.shape[0] - 1), declined.to(torch.int64))

    def _advance(self, run: RunLog, out: StepOutput, n: int, it: int) -> None:
        s = self.state
        num = out.num_out  # [n] int32, accepted + 1
        record = getattr(self.drafts.proposer, "record_step", None)
        if out.k > 0 and record is not None:  # device ops on the step's outputs: no host sync
            record(s.request[:n], out.grant, num - 1)
        s.produced[:n] += num
        s.context_lens[:n] += num  # the last real token and the accepted drafts are now cached
        last = out.out_tokens.gather(1, (num.long() - 1).clamp_(min=0)[:, None])  # [n, 1]
        s.last_token[:n].copy_(last[:, 0])
        tokens, counts = _to_host(out.out_tokens[:, : out.k + 1]), _to_host(num)
        margins = _to_host(self.tap.margins[:n]) if out.k == 0 else None  # written by the decode graph
        self._send(run, StepCopy(tokens, counts, list(self.rows), it, None, margins))

    def _send(self, run: RunLog, copy: StepCopy) -> None:
        if self.cuda:
            copy.event = torch.cuda.Event()
            copy.event.record()
        for rid in copy.rids:
            run.inflight[rid] += 1
        self.pending.append(copy)

    def _collect(self, run: RunLog, must_before: int) -> None:
        """Read every landed copy in order; wait for those of iterations < ``must_before``."""
        while self.pending:
            copy = self.pending[0]
            if not copy.landed():
                if copy.iteration >= must_before:
                    return
                run.waits += 1
                copy.event.synchronize()
            self.pending.popleft()
            run.take(copy)

    def _may_have_ended(self, run: RunLog) -> bool:
        """A live row may be done on the device though the host does not know it yet: its tokens
        seen plus K + 1 for each step in flight reach its max_new_tokens."""
        return any(run.may_end(rid, self.max_k + 1, steps=0) for rid in self.rows)

    def _promote(self) -> None:
        """Ready requests (admitted ahead, prompt cached) take the free slots: their rows follow
        the live ones, so they join in place."""
        if self.ready:
            k = min(len(self.ready), self.concurrency - len(self.rows))
            if k > 0:
                self.rows += self.ready[:k]
                self.ready = self.ready[k:]

    def _retire(self, run: RunLog) -> None:
        keep = [i for i, rid in enumerate(self.rows) if not run.surely_done(rid)]
        if len(keep) == len(self.rows):
            return
        for rid in self.rows:
            if run.surely_done(rid):
                self.free_blocks.extend(self.blocks.pop(rid))
        n, f = len(self.rows), len(self.ready) + len(self.filling)
        order = keep + list(range(n, n + f))  # ready rows and those still filling follow the live ones
        if order and order != list(range(len(order))):
            self.state.reorder(_to_device(order, torch.int64, self.device))
        self.rows = [self.rows[i] for i in keep]

    # -- admission and prefill --------------------------------------------------------------------

    def _admit(self, run: RunLog, queue: deque[int], concurrency: int, it: int, marks: Marks,
               admit_mark: int) -> None:
        new: list[int] = []
        held = len(self.rows) + len(self.ready) + len(self.filling)  # slots held, ready ones too
        while queue and held + len(new) < concurrency and self._take(run, queue, new):
            pass
        if self.admit_ahead and queue and (self.filling or not new or self._rides(self._prompt_tokens(run, new))):
            # the rows that may be done after the coming step lend their slots to successors whose
            # prompts ride beside it (never a burst: one that would not ride waits for a free slot;
            # live + ready + filling <= concurrency + those rows)
            ending = sum(run.may_end(rid, self.last_width) for rid in self.rows)
            room = min(ending, concurrency + ending - held - len(new), self.state_rows - held - len(new))
            while room > 0 and queue and (self.filling or self._rides(
                    self._prompt_tokens(run, new) + len(run.requests[queue[0]].prompt))) \
                    and self._ends_next_step(run, new, queue[0]) and self._take(run, queue, new):
                room -= 1
        if not new:
            return
        lo = len(self.rows) + len(self.ready) + len(self.filling)
        s, hi = self.state, lo + len(new)
        reqs = [run.requests[rid] for rid in new]
        tables = [self.blocks[rid] + [TRASH_BLOCK] * (self.max_blocks - len(self.blocks[rid])) for rid in new]
        s.block_tables[lo:hi].copy_(_to_device(tables, torch.int32, self.device))
        s.context_lens[lo:hi].copy_(_to_device([len(r.prompt) for r in reqs], torch.int32, self.device))
        s.max_new[lo:hi].copy_(_to_device([r.max_new_tokens for r in reqs], torch.int32, self.device))
        s.request[lo:hi].copy_(_to_device(new, torch.int64, self.device))
        s.produced[lo:hi].fill_(1)
        if self.filling or self._rides(sum(len(r.prompt) for r in reqs)):
            for rid in new:  # the prompts ride in the next steps (``_load_ride``)
                self.filling.add(rid, admit_mark)
            return
        assert not self.ready  # (ready requests only wait while every slot is live: no free one to burst into)
        first, margins = self._prefill(reqs, lo)  # [m] int64, [m, 2] float32
        s.last_token[lo:hi].copy_(first)
        first_mark = marks.mark()
        for rid in new:
            run.ttft_marks[rid] = (admit_mark, first_mark)
        self.rows += new
        self._send(run, StepCopy(_to_host(first[:, None]), None, new, it, None, _to_host(margins)))

    def _take(self, run: RunLog, queue: deque[int], new: list[int]) -> bool:
        """The queue's next request into ``new`` with its KV blocks, if enough are free."""
        need = self.blocks_for(run.requests[queue[0]])
        if need > len(self.free_blocks):
            return False
        rid = queue.popleft()
        self.blocks[rid] = [self.free_blocks.popleft() for _ in range(need)]
        new.append(rid)
        return True

    def _ends_next_step(self, run: RunLog, new: Sequence[int], rid: int) -> bool:
        """Whether request ``rid``'s whole prompt, admitted after the filling ones and ``new``,
        rides in the next step (``ends_next_forward``): a successor admitted ahead joins as the
        row it replaces leaves; one that would fill over several steps waits for the free slot."""
        assert self.mixed is not None
        m = self.mixed
        rids = [*self.filling.rids, *new, rid]
        done = [*self.filling.done, *([0] * (len(new) + 1))]
        return ends_next_forward([len(run.requests[r].prompt) for r in rids], done, m.chunk, m.budget, m.max_pieces)

    @staticmethod
    def _prompt_tokens(run: RunLog, rids: Sequence[int]) -> int:
        return sum(len(run.requests[rid].prompt) for rid in rids)

    def _rides(self, prompt_tokens: int) -> bool:
        """Whether an admission of this many prompt tokens, with no prompt still filling, rides in
        the steps (mixed prefill, not a burst) rather than taking separate prefill forwards."""
        return self.mixed is not None and prompt_tokens <= self.ride_limit

    def _prefill(self, reqs: list[Request], row0: int) -> tuple[Tensor, Tensor]:
        """Prompts of rows row0.. into the KV cache (``prefill.PrefillGraphs``: pieces of <=
        prefill_chunk tokens per request, <= prefill_tokens per forward, one graph per token
        bucket); returns the argmax after each prompt [m] int64 and its ``top2_margin`` [m, 2]."""
        return self.prefill.run([r.prompt for r in reqs], row0)

    # -- mixed prefill: prompt pieces in the steps' forwards (mixed.py) ----------------------------

    def _next_ride(self, run: RunLog) -> tuple[list[Piece], int]:
        """This step's prompt pieces and their bucket P (0: none ride)."""
        if self.mixed is None or not self.filling:
            return [], 0
        return self.mixed.plan(self.filling, [run.requests[rid].prompt for rid in self.filling.rids])

    def _load_ride(self, run: RunLog, pieces: list[Piece], ride: int, tier: int, verify: bool, n: int) -> None:
        """The pieces into the rider (rows n.. are the filling requests'), after the step's
        (tier, verify, P) graph is captured."""
        if not pieces:
            return
        assert self.mixed is not None
        self.pool.prepare_ride(tier, verify, ride)  # before the loads: a capture's warm-up clears them
        self.mixed.load(pieces, [run.requests[rid].prompt for rid in self.filling.rids], n, ride)

    def _prefill_step(self, run: RunLog, it: int, marks: Marks) -> None:
        """No live row: the prompt pieces alone, in the smallest tier's step with no request."""
        tier = self.tiers[0]
        pieces, ride = self._next_ride(run)
        self._load_ride(run, pieces, ride, tier, False, len(self.ready))
        self.verifier.step(self.state.last_token, None, None, 0, Plan(0, 0, tier),
                           context_lens=self.state.context_lens, block_tables=self.state.block_tables, ride=ride)
        run.prefill_steps += 1
        self._join(run, pieces, 0, it, marks)

    def _join(self, run: RunLog, pieces: list[Piece], n: int, it: int, marks: Marks) -> None:
        """After a step whose forward carried ``pieces``: each request whose prompt ended takes
        its first token (the row's ``last_token``; a copy to the host, its TTFT mark) and its row
        moves right after the ``n`` live ones and the ready ones; it joins the live ones where a
        slot is free (admitted ahead: else it waits ready, ``_promote``)."""
        assert self.mixed is not None
        run.mixed_tokens += sum(p.length for p in pieces)
        ended, stay = self.filling.advance(pieces)
        if not ended:
            return
        s, region = self.state, self.mixed.region
        n += len(self.ready)  # the filling rows follow the live and the ready ones
        rows = _to_device([n + j for j, _, _ in ended], torch.int64, self.device)
        first, margins = region.first.index_select(0, rows), region.margins.index_select(0, rows)
        s.last_token.index_copy_(0, rows, first)
        first_mark = marks.mark()
        for _, rid, admit_mark in ended:
            run.ttft_marks[rid] = (admit_mark, first_mark)
        rids = [rid for _, rid, _ in ended]
        self._send(run, StepCopy(_to_host(first[:, None]), None, rids, it, None, _to_host(margins)))
        order = list(range(n)) + [n + j for j, _, _ in ended] + [n + j for j in stay]
        if order != list(range(len(order))):
            s.reorder(_to_device(order, torch.int64, self.device))
        if self.admit_ahead:  # ready ones first, in row order, while slots are free
            self.ready += rids
            self._promote()
        else:
            self.rows += rids

    # -- results --------------------------------------------------------------------------------

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _report_times(timing: deque[tuple[int, int, int, Plan]], marks: Marks, iter_marks: list[int],
                  observe_time: Callable[[int, Plan, float], None]) -> int:
    """Steps whose span (the step's mark to the next iteration's) has landed on the device, in
    order, to ``observe_time(batch, plan, ms)``; a span not landed yet waits for a later call
    (``Event.query``: no host sync). Returns how many were reported."""
    done = 0
    while timing:
        start, end, n, plan = timing[0]
        if end >= len(iter_marks) or not marks.landed(iter_marks[end]):
            break
        timing.popleft()
        observe_time(n, plan, marks.ms(start, iter_marks[end]))
        done += 1
    return done
