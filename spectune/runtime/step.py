"""Graph-captured adaptive verification step: allocate -> pack -> target -> accept -> stats.

``GraphPool`` owns the static buffers and, per captured tier, two graphs of the same phases:
  verify  allocate the verify budget over (request, position) pairs, pack the real tokens and the
          granted drafts, run the target, accept, count
  decode  plain decoding (K = 0): pack the real tokens only, run the target, take its token
A tier graph serves every batch up to ``min(max_batch, tier)``: the batch size, the budget and
the inputs are device values written before the replay, never read back by the host.

A pool built with a ``rider`` (the engine's mixed prefill) also runs steps whose target forward
carries ``ride`` more tokens after the tier's (a bucket of the rider's): the rider appends them to
the forward's inputs and metadata, runs the forward and keeps their logits; the step's phases are
unchanged. Those graphs are captured per (tier, verify, ride) when first asked for
(``prepare_ride``), eager without CUDA. A riding step may have no live request (batch 0).

``AdaptiveVerifier.step`` only copies inputs into the static buffers, fills two device scalars,
replays and starts a non-blocking copy of the acceptance counters into pinned memory;
``poll_stats`` hands the counters to the planner once that copy has finished (one step late),
without waiting for the GPU.

Without CUDA the same phases run eagerly, with the Triton kernels when Triton can run
(``TRITON_INTERPRET=1`` on CPU) and with their torch references otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from spectune.errors import SpectuneError
from spectune.kernels.accept import (
    AcceptOutput,
    accept_greedy,
    accept_greedy_ref,
    accept_sampling,
    accept_sampling_ref,
    make_sample_noise,
)
from spectune.kernels.allocate import allocate, allocate_ref
from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.pack import PackedBatch, pack, pack_ref
from spectune.kernels.stats import StatsCounters, StatsSnapshot
from spectune.runtime.table import DEFAULT_ACCEPTANCE

# target forward: (input_ids [T] int64, positions [T] int64, meta) -> logits [T, V]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttnMeta], torch.Tensor]




class StepError(SpectuneError):
    """A step or graph pool was given an impossible shape or plan; names the argument."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"{name}: {reason}")


def _require(cond: bool, name: str, reason: str) -> None:
    if not cond:
        raise StepError(name, reason)


class Rider(Protocol):
    """Tokens that ride in a step's target forward after the tier's packed tokens."""

    @property
    def buckets(self) -> Sequence[int]:
        """Token counts a step may carry (one graph per (tier, verify, bucket))."""
        ...

    def clear(self) -> None:
        """No riding token writes anything (a capture's warm-up runs on this)."""

    def __call__(self, ride: int, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttnMeta) -> torch.Tensor:
        """The forward of the tier's tokens (``input_ids`` [T], ``meta``) with ``ride`` tokens after
        them; returns the logits of the tier's tokens [T, V]."""
        ...


class PlanLike(Protocol):
    """What a step reads of the planner's ``Plan``."""

    @property
    def k(self) -> int: ...
    @property
    def verify_budget(self) -> int: ...
    @property
    def tier(self) -> int | None: ...


@dataclass(frozen=True)
class StepOutput:
    """Views into the pool's static buffers: valid until the next step (copy to keep)."""

    out_tokens: torch.Tensor  # [batch, max_k + 1] int64, emitted tokens then PLACEHOLDER_TOKEN_ID
    num_out: torch.Tensor  # [batch] int32, tokens emitted per request (accepted + 1)
    grant: torch.Tensor  # [batch] int32, drafts verified per request
    k: int
    tier: int


def kernels_available(device: torch.device) -> bool:
    """The one decision point: Triton kernels on CUDA or under Triton's CPU interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------
# Static buffers


@dataclass(frozen=True)
class StepBuffers:
    last_token: torch.Tensor  # [max_batch] int64
    drafts: torch.Tensor  # [max_batch, max_k] int64
    conf: torch.Tensor  # [max_batch, max_k] float32
    k_valid: torch.Tensor  # [max_batch] int32
    context_lens: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    budget: torch.Tensor  # [1] int32
    num_reqs: torch.Tensor  # [1] int32
    grant: torch.Tensor  # [max_batch] int32, allocation result
    no_grant: torch.Tensor  # [max_batch] int32, zeros (plain decoding)
    uniform: torch.Tensor | None  # [max_batch, max_k] float32 (sampling)
    sample_noise: torch.Tensor | None  # [max_batch, V] float32 (sampling)
    draft_probs: torch.Tensor | None  # [max_batch, max_k, V] float32 (sampling with drafter probs)
    out: AcceptOutput  # [max_batch, ...]
    stats: StatsCounters  # [3 * max_k + 3]

    @classmethod
    def make(cls, *, max_batch: int, max_k: int, max_blocks: int, device: torch.device,
             sampling: bool, draft_probs: bool, vocab_size: int | None) -> StepBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        v = vocab_size or 0
        return cls(
            last_token=zeros(max_batch, dtype=torch.int64),
            drafts=zeros(max_batch, max_k, dtype=torch.int64),
            conf=zeros(max_batch, max_k, dtype=torch.float32),
            k_valid=zeros(max_batch),
            context_lens=zeros(max_batch),
            block_tables=zeros(max_batch, max_blocks),
            budget=zeros(1),
            num_reqs=zeros(1),
            grant=zeros(max_batch),
            no_grant=zeros(max_batch),
            uniform=zeros(max_batch, max_k, dtype=torch.float32) if sampling else None,
            sample_noise=zeros(max_batch, v, dtype=torch.float32) if sampling else None,
            draft_probs=zeros(max_batch, max_k, v, dtype=torch.float32) if draft_probs else None,
            out=AcceptOutput.empty(max_batch, max_k, device),
            stats=StatsCounters.zeros(max_k, device),
        )


def _rows(out: AcceptOutput, n: int) -> AcceptOutput:
    return AcceptOutput(out.out_tokens[:n], out.num_out[:n], out.accepted[:n])


# ---------------------------------------------------------------------------------------------
# Graph pool


class GraphPool:
    """Static buffers plus, per tier, a captured verify graph and a captured decode graph."""

    def __init__(
        self,
        forward_fn: ForwardFn,
        tiers: Sequence[int],
        *,
        max_batch: int,
        max_k: int,
        device: torch.device | str,
        block_size: int = 16,
        max_blocks: int = 1,
        sampling: bool = False,
        temperature: float = 1.0,
        draft_probs: bool = False,
        vocab_size: int | None = None,
        capture: bool | None = None,
        kernels: bool | None = None,
        generator: torch.Generator | None = None,
        warmup: int = 2,
        rider: Rider | None = None,
    ):
        self.device = torch.device(device)
        tiers = sorted({int(t) for t in tiers})
        _require(len(tiers) > 0 and tiers[0] >= 1, "tiers", f"must be >= 1 and not empty, got {tiers}")
        _require(max_batch >= 1, "max_batch", f"must be >= 1, got {max_batch}")
        _require(0 <= max_k <= 64, "max_k", f"must be in 0..64, got {max_k}")
        _require(block_size >= 1 and max_blocks >= 1, "block_size",
                 f"block_size and max_blocks must be >= 1, got {block_size}, {max_blocks}")
        _require(not sampling or temperature > 0, "temperature", f"must be > 0, got {temperature}")
        _require(not sampling or (vocab_size or 0) >= 1, "vocab_size", "needed (>= 1) for sampling")
        _require(not draft_probs or sampling, "draft_probs", "only used with sampling=True")
        self.forward_fn = forward_fn
        self.tiers = tiers
        self.max_batch, self.max_k = max_batch, max_k
        self.block_size = block_size
        self.sampling, self.temperature = sampling, temperature
        self.generator = generator
        self.capture = self.device.type == "cuda" if capture is None else capture
        _require(not self.capture or self.device.type == "cuda", "capture", "CUDA graphs need a CUDA device")
        _require(not (generator is not None and self.capture), "generator",
                 "captured graphs draw from the device's default generator (seed it instead)")
        self.use_kernels = kernels_available(self.device) if kernels is None else kernels
        _require(self.use_kernels or not self.capture, "kernels", "captured graphs need the Triton kernels")
        self.buf = StepBuffers.make(max_batch=max_batch, max_k=max_k, max_blocks=max_blocks,
                                    device=self.device, sampling=sampling, draft_probs=draft_probs,
                                    vocab_size=vocab_size)
        self.packed = {t: PackedBatch.empty(self.rows(t), t, self.device) for t in tiers}
        self.graphs: dict[tuple[int, bool], Any] = {}
        self.rider = rider
        self.ride_graphs: dict[tuple[int, bool, int], Any] = {}  # (tier, verify, ride) -> graph
        self.ride_captures = 0
        self._mempool: Any = None
        self.warmup = warmup
        if self.capture:
            self._capture_all(warmup)

    def rows(self, tier: int) -> int:
        """Static request count of a tier's graphs."""
        return min(self.max_batch, tier)

    # -- phases (the body of each graph) ------------------------------------------------------

    def _allocate_phase(self, n: int) -> torch.Tensor:
        b = self.buf
        if self.use_kernels:
            return allocate(b.conf[:n], b.k_valid[:n], b.budget, out=b.grant[:n])
        return b.grant[:n].copy_(allocate_ref(b.conf[:n], b.k_valid[:n], b.budget))

    def _pack_phase(self, tier: int, grant: torch.Tensor) -> PackedBatch:
        b, n, out = self.buf, self.rows(tier), self.packed[tier]
        args = (b.last_token[:n], b.drafts[:n], grant, b.context_lens[:n], b.block_tables[:n],
                self.block_size, tier)
        if self.use_kernels:
            return pack(*args, num_reqs=b.num_reqs, out=out)
        ref = pack_ref(*args, num_reqs=b.num_reqs)
        for name in ("input_ids", "positions", "slot_mapping", "token_req", "cu_seqlens_q", "grant_used"):
            getattr(out, name).copy_(getattr(ref, name))
        return out

    def _target_phase(self, tier: int, packed: PackedBatch, max_q: int, ride: int = 0) -> torch.Tensor:
        b, n = self.buf, self.rows(tier)
        meta = AttnMeta(cu_seqlens_q=packed.cu_seqlens_q, context_lens=b.context_lens[:n], max_q=max_q,
                        block_tables=b.block_tables[:n], slot_mapping=packed.slot_mapping)
        if ride:
            assert self.rider is not None
            return self.rider(ride, packed.input_ids, packed.positions, meta)  # [T, V]
        return self.forward_fn(packed.input_ids, packed.positions, meta)  # [T, V]

    def _accept_phase(self, tier: int, logits: torch.Tensor, packed: PackedBatch) -> None:
        b, n = self.buf, self.rows(tier)
        out = _rows(b.out, n)
        if not self.sampling:
            target_ids = logits.argmax(dim=-1)  # [T] int64
            if self.use_kernels:
                accept_greedy(target_ids, b.drafts[:n], packed.cu_seqlens_q, stats=b.stats, out=out)
            else:
                _copy_out(out, accept_greedy_ref(target_ids, b.drafts[:n], packed.cu_seqlens_q, b.stats))
            return
        assert b.uniform is not None and b.sample_noise is not None
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # [T, V]
        uniform, noise = b.uniform[:n], b.sample_noise[:n]
        uniform.uniform_(generator=self.generator)
        make_sample_noise(tuple(noise.shape), generator=self.generator, out=noise)
        q = b.draft_probs[:n] if b.draft_probs is not None else None
        args = (probs, q, b.drafts[:n], packed.cu_seqlens_q, uniform, noise)
        if self.use_kernels:
            accept_sampling(*args, stats=b.stats, out=out)
        else:
            _copy_out(out, accept_sampling_ref(*args, stats=b.stats))

    def _run_phases(self, tier: int, verify: bool, ride: int = 0) -> None:
        n = self.rows(tier)
        grant = self._allocate_phase(n) if verify and self.max_k > 0 else self.buf.no_grant[:n]
        packed = self._pack_phase(tier, grant)
        logits = self._target_phase(tier, packed, self.max_k + 1 if verify else 1, ride)
        self._accept_phase(tier, logits, packed)

    # -- capture and replay -------------------------------------------------------------------

    def _capture_all(self, warmup: int) -> None:
        b = self.buf
        b.num_reqs.zero_()  # warm-up steps pack padding only: no KV slot is written
        b.budget.zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for tier in self.tiers:
                for verify in (True, False):
                    for _ in range(warmup):  # compiles the kernels, settles the allocator
                        self._run_phases(tier, verify)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        b.stats.counters.zero_()
        self._mempool = torch.cuda.graph_pool_handle()
        for tier in reversed(self.tiers):  # largest first: smaller graphs reuse its memory
            for verify in (True, False):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._mempool):
                    self._run_phases(tier, verify)
                self.graphs[(tier, verify)] = graph
        torch.cuda.synchronize(self.device)

    def prepare_ride(self, tier: int, verify: bool, ride: int) -> bool:
        """Capture the (tier, verify, ride) graph if it is missing (CUDA only); True when it was
        captured now. Its warm-up runs on padding only (no live request, no riding piece; the
        acceptance counters are put back), so call it before a step's inputs are loaded."""
        _require(self.rider is not None and ride in self.rider.buckets, "ride",
                 f"{ride} is not a bucket of the pool's rider")
        if not self.capture or (tier, verify, ride) in self.ride_graphs:
            return False
        assert self.rider is not None
        b = self.buf
        counters = b.stats.counters.clone()
        b.num_reqs.zero_()
        b.budget.zero_()
        self.rider.clear()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._run_phases(tier, verify, ride)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        b.stats.counters.copy_(counters)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self._run_phases(tier, verify, ride)
        self.ride_graphs[(tier, verify, ride)] = graph
        self.ride_captures += 1
        torch.cuda.synchronize(self.device)
        return True

    def run(self, tier: int, verify: bool, ride: int = 0) -> None:
        """Replay (or run eagerly) the tier's verify or decode step on the static buffers, with
        ``ride`` rider tokens in its forward."""
        graph = self.ride_graphs.get((tier, verify, ride)) if ride else self.graphs.get((tier, verify))
        if graph is not None:
            graph.replay()
        else:
            _require(not (ride and self.capture), "ride", f"graph ({tier}, {verify}, {ride}) not captured: "
                     "call prepare_ride before loading the step")
            self._run_phases(tier, verify, ride)


def _copy_out(out: AcceptOutput, ref: AcceptOutput) -> None:
    out.out_tokens.copy_(ref.out_tokens)
    out.num_out.copy_(ref.num_out)
    out.accepted.copy_(ref.accepted)


# ---------------------------------------------------------------------------------------------
# Step


@dataclass
class _StatsSlot:
    host: torch.Tensor  # [3 * max_k + 3] int64, pinned on CUDA
    event: Any  # torch.cuda.Event or None
    step: int = -1


class AdaptiveVerifier:
    """Host side of a step: fill static buffers, replay, copy counters out without waiting."""

    def __init__(self, pool: GraphPool, *, prior: Sequence[float] | None = None):
        self.pool = pool
        k = pool.max_k
        accept = list(prior) if prior else [DEFAULT_ACCEPTANCE]
        _require(all(0.0 <= p <= 1.0 for p in accept), "prior", "conditional acceptances must be in [0, 1]")
        accept = (accept + [accept[-1]] * k)[:k]
        # conf of drafters that give none: the conditional acceptance per position, so the
        # allocation ranks positions by the prior's survival
        self.prior = torch.tensor(accept, dtype=torch.float32, device=pool.device)  # [max_k]
        cuda = pool.device.type == "cuda"
        size = pool.buf.stats.counters.numel()
        self._slots = [
            _StatsSlot(torch.zeros(size, dtype=torch.int64, pin_memory=cuda),
                       torch.cuda.Event() if cuda else None)
            for _ in range(2)
        ]
        self._steps = 0
        self._read_step = -1
        self._last = StatsSnapshot.from_counters([0] * size, k)

    def step(
        self,
        last_token: torch.Tensor,  # [>= batch] int64, on the pool's device
        drafts: torch.Tensor | None,  # [>= batch, k] int64 (None when plan.k == 0)
        conf: torch.Tensor | None,  # [>= batch, k] float32; None: the acceptance prior
        batch_size: int,
        plan: PlanLike,
        *,
        context_lens: torch.Tensor,  # [>= batch] int32, tokens already in the KV cache
        block_tables: torch.Tensor | None = None,  # [>= batch, <= max_blocks] int32
        k_valid: torch.Tensor | None = None,  # [>= batch] int32, drafts each request has (<= k)
        draft_probs: torch.Tensor | None = None,  # [>= batch, k, V] float32 (sampling with probs)
        ride: int = 0,  # rider tokens in the forward (a bucket of the pool's rider, loaded)
        copy_stats: bool = True,  # False: the caller adds to the counters first, then ``copy_stats()``
    ) -> StepOutput:
        pool, b, n = self.pool, self.pool.buf, batch_size
        tier, k = plan.tier, plan.k
        _require(tier in pool.tiers, "plan.tier", f"{tier} is not a captured tier {pool.tiers}")
        assert tier is not None
        _require(ride == 0 or (pool.rider is not None and ride in pool.rider.buckets), "ride",
                 f"{ride} is not a bucket of the pool's rider")
        lo = 0 if ride else 1
        _require(lo <= n <= pool.rows(tier), "batch_size",
                 f"{n} is outside {lo}..{pool.rows(tier)} for tier {tier} (max_batch {pool.max_batch})")
        _require(0 <= k <= pool.max_k, "plan.k", f"{k} is outside 0..{pool.max_k}")
        _require(last_token.shape[0] >= n and context_lens.shape[0] >= n, "last_token",
                 f"last_token and context_lens need >= {n} rows")
        b.last_token[:n].copy_(last_token[:n], non_blocking=True)
        b.context_lens[:n].copy_(context_lens[:n], non_blocking=True)
        if block_tables is not None:
            width = block_tables.shape[1]
            _require(width <= b.block_tables.shape[1], "block_tables",
                     f"{width} blocks per request, the pool holds {b.block_tables.shape[1]}")
            b.block_tables[:n, :width].copy_(block_tables[:n], non_blocking=True)
        b.num_reqs.fill_(n)
        verify = k > 0
        if verify:
            self._fill_drafts(n, k, plan.verify_budget, tier, drafts, conf, k_valid, draft_probs)
        pool.run(tier, verify, ride)
        if copy_stats:
            self.copy_stats()
        grant = pool.packed[tier].grant_used[:n] if verify else b.no_grant[:n]
        return StepOutput(b.out.out_tokens[:n], b.out.num_out[:n], grant, k, tier)

    def _fill_drafts(self, n: int, k: int, budget: int, tier: int, drafts: torch.Tensor | None,
                     conf: torch.Tensor | None, k_valid: torch.Tensor | None,
                     draft_probs: torch.Tensor | None) -> None:
        b = self.pool.buf
        _require(drafts is not None and drafts.ndim == 2 and drafts.shape[0] >= n and drafts.shape[1] >= k,
                 "drafts", f"must be [>= {n}, >= {k}] when plan.k = {k}")
        assert drafts is not None
        b.drafts[:n, :k].copy_(drafts[:n, :k], non_blocking=True)
        if conf is None:
            b.conf[:n, :k].copy_(self.prior[:k].expand(n, k))
        else:
            _require(conf.ndim == 2 and conf.shape[0] >= n and conf.shape[1] >= k, "conf",
                     f"must be [>= {n}, >= {k}], got {list(conf.shape)}")
            b.conf[:n, :k].copy_(conf[:n, :k], non_blocking=True)
        if k_valid is None:
            b.k_valid[:n].fill_(k)
        else:
            b.k_valid[:n].copy_(k_valid[:n], non_blocking=True).clamp_(0, k)
        b.k_valid[n:].zero_()  # requests past the batch get no drafts
        b.budget.fill_(max(0, min(budget, tier - n)))  # never more drafts than the tier holds
        if b.draft_probs is not None:
            _require(draft_probs is not None, "draft_probs", "the pool was built to use drafter probabilities")
            assert draft_probs is not None
            b.draft_probs[:n, :k].copy_(draft_probs[:n, :k], non_blocking=True)

    # -- statistics, one step late --------------------------------------------------------------

    def copy_stats(self) -> None:
        """Enqueue the step's counters copy to pinned host memory (``step`` does, unless told
        ``copy_stats=False``: a caller that adds counts of its own to this step, as the engine
        does for the drafts a proposer declined, copies after them, so they read with this step)."""
        slot = self._slots[self._steps % len(self._slots)]
        slot.host.copy_(self.pool.buf.stats.counters, non_blocking=slot.event is not None)
        if slot.event is not None:
            slot.event.record()
        slot.step = self._steps
        self._steps += 1

    def poll_stats(self) -> StatsSnapshot | None:
        """Counts since the last poll, up to the newest step whose copy has landed; None if no
        new copy has landed yet. Never waits for the device."""
        ready = [s for s in self._slots
                 if s.step > self._read_step and (s.event is None or s.event.query())]
        if not ready:
            return None
        newest = max(ready, key=lambda s: s.step)
        snap = StatsSnapshot.from_counters(newest.host.tolist(), self.pool.max_k)
        delta = snap.minus(self._last)
        self._last, self._read_step = snap, newest.step
        return delta
