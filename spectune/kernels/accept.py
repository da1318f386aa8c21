"""Acceptance of a packed verification step (greedy and rejection sampling).

Terms (Leviathan et al. 2023, Chen et al. 2023): request i's packed rows are
``cu_seqlens_q[i] .. cu_seqlens_q[i+1]``: its real token, then ``g_i = q_i - 1`` granted drafts.
The target's row ``start + j`` predicts the token after draft j (row ``start`` the token after the
real one), so draft j is checked against row ``start + j``.
  accepted  the longest prefix of granted drafts the target agrees with (``a_i`` drafts)
  recovered at the first rejection, a token drawn from norm(max(0, p - q)) at row start + a_i
  bonus     when all g_i drafts are accepted, a token drawn from p at row start + g_i
Each live request emits ``a_i + 1`` tokens: its accepted drafts, then the recovered/bonus token
(greedy: the target's argmax at row start + a_i). ``out_tokens`` rows end in PLACEHOLDER_TOKEN_ID.
A request with no packed rows (q_i = 0, not live this step) emits nothing.

The grant is read from ``cu_seqlens_q`` (the rows actually packed), so it always matches the
target's rows. Randomness comes in as tensors (uniforms and exponential noise) so a captured graph
can refill them in place and tests can seed them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spectune.kernels.kv_cache import check
from spectune.kernels.stats import EMITTED, REQUESTS, STEPS, StatsCounters, update_stats_ref

PLACEHOLDER_TOKEN_ID = -1  # out_tokens entry past a request's emitted tokens
NO_SCORE = -1.0  # sampling score of vocabulary columns past V (every real score is >= 0)


@dataclass(frozen=True)
class AcceptOutput:
    out_tokens: torch.Tensor  # [B, K+1] int64, emitted tokens then PLACEHOLDER_TOKEN_ID
    num_out: torch.Tensor  # [B] int32, accepted + 1 (0 for a request not in the step)
    accepted: torch.Tensor  # [B] int32, accepted drafts

    @classmethod
    def empty(cls, batch: int, max_k: int, device: torch.device | str) -> AcceptOutput:
        return cls(
            out_tokens=torch.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device),
            num_out=torch.zeros(batch, dtype=torch.int32, device=device),
            accepted=torch.zeros(batch, dtype=torch.int32, device=device),
        )


def make_sample_noise(shape: tuple[int, ...], *, generator: torch.Generator | None = None,
                      device: torch.device | str = "cpu", out: torch.Tensor | None = None) -> torch.Tensor:
    """``1 / E`` with E ~ Exp(1): argmax(w * noise) draws an index with probability w / sum(w)."""
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=device)
    out.exponential_(generator=generator)
    return out.reciprocal_()


# ---------------------------------------------------------------------------------------------
# References


def _request_rows(cu_seqlens_q: torch.Tensor, max_k: int) -> list[tuple[int, int]]:
    cu = [int(c) for c in cu_seqlens_q]
    return [(cu[i], min(max(cu[i + 1] - cu[i] - 1, -1), max_k)) for i in range(len(cu) - 1)]


def _accept_ref(
    drafts: torch.Tensor,  # [B, K] int64
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    stats: StatsCounters | None,
    decide: Callable[[int, int, int], tuple[int, torch.Tensor]],  # (i, start, g) -> (a_i, last token)
) -> AcceptOutput:
    """Each live request i emits its ``a_i`` accepted drafts, then the token ``decide`` drew."""
    batch, max_k = drafts.shape
    out = AcceptOutput.empty(batch, max_k, "cpu")
    grants = []
    for i, (start, g) in enumerate(_request_rows(cu_seqlens_q, max_k)):
        grants.append(max(g, 0))
        if g < 0:
            continue
        a, token = decide(i, start, g)
        out.out_tokens[i, :a] = drafts[i, :a]
        out.out_tokens[i, a] = token
        out.accepted[i] = a
        out.num_out[i] = a + 1
    if stats is not None:
        update_stats_ref(stats, out.accepted, torch.tensor(grants), out.num_out > 0)
    return out


def accept_greedy_ref(
    target_ids: torch.Tensor,  # [T] int64, argmax of the target's logits per packed row
    drafts: torch.Tensor,  # [B, K] int64
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    stats: StatsCounters | None = None,
) -> AcceptOutput:
    def decide(i: int, start: int, g: int) -> tuple[int, torch.Tensor]:
        a = 0
        while a < g and int(drafts[i, a]) == int(target_ids[start + a]):
            a += 1
        return a, target_ids[start + a]

    return _accept_ref(drafts, cu_seqlens_q, stats, decide)


def accept_sampling_ref(
    target_probs: torch.Tensor,  # [T, V] float32
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, None: one-hot proposals
    drafts: torch.Tensor,  # [B, K] int64
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    uniform: torch.Tensor,  # [B, K] float32 in [0, 1)
    sample_noise: torch.Tensor,  # [B, V] float32, 1 / Exp(1)
    stats: StatsCounters | None = None,
) -> AcceptOutput:
    def decide(i: int, start: int, g: int) -> tuple[int, torch.Tensor]:
        a = 0
        while a < g:
            x = int(drafts[i, a])
            p_x = target_probs[start + a, x]
            q_x = draft_probs[i, a, x] if draft_probs is not None else torch.tensor(1.0)
            # accept with probability min(1, p(x) / q(x))  <=>  u * q(x) < p(x), u in [0, 1)
            if not bool(uniform[i, a] * q_x < p_x):
                break
            a += 1
        p = target_probs[start + a]
        q = torch.zeros_like(p)
        if a < g:  # rejected at a: recovered token from norm(max(0, p - q))
            if draft_probs is not None:
                q = draft_probs[i, a]
            else:
                q[int(drafts[i, a])] = 1.0
        w = torch.clamp(p - q, min=0.0)
        if not bool((w > 0).any()):
            w = p  # p == q on every token: nothing to recover, draw from p
        return a, torch.argmax(w * sample_noise[i])

    return _accept_ref(drafts, cu_seqlens_q, stats, decide)


# ---------------------------------------------------------------------------------------------
# Kernels

STEPS_AT: tl.constexpr = tl.constexpr(STEPS)  # offsets into the totals of the stats buffer
REQUESTS_AT: tl.constexpr = tl.constexpr(REQUESTS)
EMITTED_AT: tl.constexpr = tl.constexpr(EMITTED)


@triton.jit
def _request_grants(
    cu_seqlens_q_ptr,  # [B+1] int32
    batch,
    max_k,
    BLOCK_B: tl.constexpr,
):
    # this program's requests, their first packed row, and the drafts granted to each
    req = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
    req_ok = req < batch
    start = tl.load(cu_seqlens_q_ptr + req, mask=req_ok, other=0)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1, mask=req_ok, other=0) - start
    live = req_ok & (q_len >= 1)  # q_len = 0: not in this step
    grant = tl.minimum(tl.maximum(q_len - 1, 0), max_k)
    return req, req_ok, start, live, grant


@triton.jit
def _add_stats(
    stats_ptr,  # [3 * K + 3] int64: accepted | offered | granted | steps, requests, emitted
    accepted,  # [BLOCK_B] int32
    grant,  # [BLOCK_B] int32
    live,  # [BLOCK_B] bool
    max_k,
    BLOCK_Q: tl.constexpr,
):
    j = tl.arange(0, BLOCK_Q)[None, :]
    on = live[:, None]
    a = accepted[:, None]
    g = grant[:, None]
    pos_ok = tl.arange(0, BLOCK_Q) < max_k
    n_accepted = tl.sum(((j < a) & on).to(tl.int64), axis=0)
    n_offered = tl.sum(((j < g) & (j <= a) & on).to(tl.int64), axis=0)
    n_granted = tl.sum(((j < g) & on).to(tl.int64), axis=0)
    pos = tl.arange(0, BLOCK_Q)
    tl.atomic_add(stats_ptr + pos, n_accepted, mask=pos_ok)
    tl.atomic_add(stats_ptr + max_k + pos, n_offered, mask=pos_ok)
    tl.atomic_add(stats_ptr + 2 * max_k + pos, n_granted, mask=pos_ok)
    totals = stats_ptr + 3 * max_k
    if tl.program_id(0) == 0:
        tl.atomic_add(totals + STEPS_AT, 1)
    tl.atomic_add(totals + REQUESTS_AT, tl.sum(live.to(tl.int64)))
    tl.atomic_add(totals + EMITTED_AT, tl.sum(tl.where(live, accepted + 1, 0).to(tl.int64)))


@triton.jit
def _write_out(
    out_tokens_ptr,  # [B, K+1] int64
    num_out_ptr,  # [B] int32
    accepted_ptr,  # [B] int32
    req,  # [BLOCK_B]
    req_ok,  # [BLOCK_B] bool
    live,  # [BLOCK_B] bool
    accepted,  # [BLOCK_B] int32
    tokens,  # [BLOCK_B, BLOCK_Q] int64, emitted token at each j <= accepted
    max_k,
    PLACEHOLDER: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    j = tl.arange(0, BLOCK_Q)[None, :]
    keep = live[:, None] & (j <= accepted[:, None])
    tl.store(out_tokens_ptr + req[:, None] * (max_k + 1) + j, tl.where(keep, tokens, PLACEHOLDER),
             mask=req_ok[:, None] & (j < max_k + 1))
    tl.store(num_out_ptr + req, tl.where(live, accepted + 1, 0), mask=req_ok)
    tl.store(accepted_ptr + req, tl.where(live, accepted, 0), mask=req_ok)


@triton.jit
def _accept_greedy_kernel(
    # Pointers
    target_ids_ptr,  # [T] int64
    drafts_ptr,  # [B, K] int64
    cu_seqlens_q_ptr,  # [B+1] int32
    out_tokens_ptr,  # [B, K+1] int64, output
    num_out_ptr,  # [B] int32, output
    accepted_ptr,  # [B] int32, output
    stats_ptr,  # [3 * K + 3] int64, added to (when HAS_STATS)
    # Dimensions
    batch,
    max_k,
    # Meta-parameters
    HAS_STATS: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    req, req_ok, start, live, grant = _request_grants(cu_seqlens_q_ptr, batch, max_k, BLOCK_B)
    j = tl.arange(0, BLOCK_Q)[None, :]
    target = tl.load(target_ids_ptr + start[:, None] + j, mask=live[:, None] & (j <= grant[:, None]), other=PLACEHOLDER)
    draft = tl.load(drafts_ptr + req[:, None] * max_k + j, mask=live[:, None] & (j < grant[:, None]), other=PLACEHOLDER)
    # accepted = first granted position where the draft differs from the target's argmax
    mismatch = (j < grant[:, None]) & (draft != target)
    accepted = tl.min(tl.where(mismatch, j, grant[:, None]), axis=1)
    # accepted drafts equal the target's rows, so the emitted tokens are target rows 0..accepted
    _write_out(out_tokens_ptr, num_out_ptr, accepted_ptr, req, req_ok, live, accepted, target,
               max_k, PLACEHOLDER, BLOCK_Q)
    if HAS_STATS:
        _add_stats(stats_ptr, accepted, grant, live, max_k, BLOCK_Q)


@triton.jit
def _accept_sampling_kernel(
    # Pointers
    target_probs_ptr,  # [T, V] float32
    draft_probs_ptr,  # [B, K, V] float32 (read when HAS_DRAFT_PROBS)
    drafts_ptr,  # [B, K] int64
    cu_seqlens_q_ptr,  # [B+1] int32
    uniform_ptr,  # [B, K] float32
    sample_noise_ptr,  # [B, V] float32
    out_tokens_ptr,  # [B, K+1] int64, output
    num_out_ptr,  # [B] int32, output
    accepted_ptr,  # [B] int32, output
    stats_ptr,  # [3 * K + 3] int64, added to (when HAS_STATS)
    # Dimensions
    batch,
    max_k,
    vocab,
    # Meta-parameters
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_STATS: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
    EMPTY_SCORE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req, req_ok, start, live, grant = _request_grants(cu_seqlens_q_ptr, batch, max_k, BLOCK_B)
    j = tl.arange(0, BLOCK_Q)[None, :]
    is_granted = live[:, None] & (j < grant[:, None])
    draft = tl.load(drafts_ptr + req[:, None] * max_k + j, mask=is_granted, other=0)
    row = (start[:, None] + j).to(tl.int64)
    p_x = tl.load(target_probs_ptr + row * vocab + draft, mask=is_granted, other=0.0)
    if HAS_DRAFT_PROBS:
        q_x = tl.load(draft_probs_ptr + (req[:, None] * max_k + j).to(tl.int64) * vocab + draft,
                      mask=is_granted, other=1.0)
    else:
        q_x = tl.full((BLOCK_B, BLOCK_Q), 1.0, tl.float32)
    u = tl.load(uniform_ptr + req[:, None] * max_k + j, mask=is_granted, other=1.0)
    # accept draft x with probability min(1, p(x) / q(x))  <=>  u * q(x) < p(x), u in [0, 1)
    rejected = is_granted & (u * q_x >= p_x)
    accepted = tl.min(tl.where(rejected, j, grant[:, None]), axis=1)

    # recovered (accepted < grant) or bonus token, both drawn at row start + accepted:
    # argmax(w * noise), w = max(0, p - q) (q = 0 for the bonus), or p when w is all zero
    was_rejected = live & (accepted < grant)
    last_row = (start + accepted).to(tl.int64)
    bad_draft = tl.sum(tl.where(j == accepted[:, None], draft, 0), axis=1)  # draft at `accepted`
    best_w = tl.full((BLOCK_B,), EMPTY_SCORE, tl.float32)
    arg_w = tl.zeros((BLOCK_B,), tl.int64)
    best_p = tl.full((BLOCK_B,), EMPTY_SCORE, tl.float32)
    arg_p = tl.zeros((BLOCK_B,), tl.int64)
    w_max = tl.zeros((BLOCK_B,), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)[None, :]
        v_ok = live[:, None] & (v < vocab)
        p = tl.load(target_probs_ptr + last_row[:, None] * vocab + v, mask=v_ok, other=0.0)
        if HAS_DRAFT_PROBS:
            q_row = (req * max_k + accepted).to(tl.int64)
            q = tl.load(draft_probs_ptr + q_row[:, None] * vocab + v, mask=v_ok & was_rejected[:, None], other=0.0)
        else:
            q = tl.where(was_rejected[:, None] & (v == bad_draft[:, None]), 1.0, 0.0)
        w = tl.maximum(p - q, 0.0)
        noise = tl.load(sample_noise_ptr + req[:, None].to(tl.int64) * vocab + v, mask=v_ok, other=0.0)
        score_w = tl.where(v_ok, w * noise, EMPTY_SCORE)
        score_p = tl.where(v_ok, p * noise, EMPTY_SCORE)
        w_max = tl.maximum(w_max, tl.max(w, axis=1))
        chunk_w = tl.max(score_w, axis=1)
        chunk_p = tl.max(score_p, axis=1)
        at_w = v0 + tl.argmax(score_w, axis=1, tie_break_left=True).to(tl.int64)
        at_p = v0 + tl.argmax(score_p, axis=1, tie_break_left=True).to(tl.int64)
        arg_w = tl.where(chunk_w > best_w, at_w, arg_w)  # strict: earlier chunks win ties
        best_w = tl.maximum(best_w, chunk_w)
        arg_p = tl.where(chunk_p > best_p, at_p, arg_p)
        best_p = tl.maximum(best_p, chunk_p)
    sampled = tl.where(w_max > 0.0, arg_w, arg_p)

    tokens = tl.where(j == accepted[:, None], sampled[:, None], draft)
    _write_out(out_tokens_ptr, num_out_ptr, accepted_ptr, req, req_ok, live, accepted, tokens,
               max_k, PLACEHOLDER, BLOCK_Q)
    if HAS_STATS:
        _add_stats(stats_ptr, accepted, grant, live, max_k, BLOCK_Q)


# ---------------------------------------------------------------------------------------------
# Wrappers


def _check_common(drafts, cu_seqlens_q, stats, out):
    check(drafts.ndim == 2, "drafts", f"must be [B, K], got shape {tuple(drafts.shape)}")
    check(drafts.dtype == torch.int64 and drafts.is_contiguous(), "drafts", "must be contiguous int64")
    batch, max_k = drafts.shape
    device = drafts.device
    check(cu_seqlens_q.shape == (batch + 1,) and cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q",
          f"must be [{batch + 1}] int32, got {list(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}")
    check(cu_seqlens_q.device == device, "cu_seqlens_q", f"on {cu_seqlens_q.device}, drafts on {device}")
    if stats is not None:
        check(stats.max_k == max_k, "stats", f"counts {stats.max_k} positions, drafts have {max_k}")
        check(stats.counters.device == device, "stats", f"on {stats.counters.device}, drafts on {device}")
    if out is None:
        return AcceptOutput.empty(batch, max_k, device)
    check(out.out_tokens.shape == (batch, max_k + 1) and out.out_tokens.dtype == torch.int64,
          "out.out_tokens", f"must be [{batch}, {max_k + 1}] int64")
    for name in ("num_out", "accepted"):
        t = getattr(out, name)
        check(t.shape == (batch,) and t.dtype == torch.int32, f"out.{name}", f"must be [{batch}] int32")
    for name in ("out_tokens", "num_out", "accepted"):
        t = getattr(out, name)
        check(t.device == device and t.is_contiguous(), f"out.{name}", f"must be contiguous on {device}")
    return out


def accept_greedy(
    target_ids: torch.Tensor,  # [T] int64, argmax of the target's logits per packed row
    drafts: torch.Tensor,  # [B, K] int64
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    *,
    stats: StatsCounters | None = None,
    out: AcceptOutput | None = None,
    block_b: int = 16,
) -> AcceptOutput:
    """Greedy acceptance: longest prefix of drafts equal to the target's argmax. Capturable."""
    out = _check_common(drafts, cu_seqlens_q, stats, out)
    check(target_ids.ndim == 1 and target_ids.dtype == torch.int64, "target_ids",
          f"must be [T] int64, got {list(target_ids.shape)} {target_ids.dtype}")
    check(target_ids.device == drafts.device and target_ids.is_contiguous(), "target_ids",
          f"must be contiguous on {drafts.device}")
    batch, max_k = drafts.shape
    if batch == 0:
        return out
    _accept_greedy_kernel[(triton.cdiv(batch, block_b),)](
        target_ids, drafts, cu_seqlens_q, out.out_tokens, out.num_out, out.accepted,
        stats.counters if stats is not None else out.num_out,
        batch, max_k,
        HAS_STATS=stats is not None,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK_B=block_b,
        BLOCK_Q=triton.next_power_of_2(max_k + 1),
        num_warps=4,
    )
    return out


def accept_sampling(
    target_probs: torch.Tensor,  # [T, V] float32
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, None: one-hot proposals (q(x) = 1)
    drafts: torch.Tensor,  # [B, K] int64
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    uniform: torch.Tensor,  # [B, K] float32 in [0, 1)
    sample_noise: torch.Tensor,  # [B, V] float32, 1 / Exp(1) (see make_sample_noise)
    *,
    stats: StatsCounters | None = None,
    out: AcceptOutput | None = None,
    block_b: int = 16,
    block_v: int = 1024,
) -> AcceptOutput:
    """Rejection sampling that leaves the target distribution unchanged. Capturable."""
    out = _check_common(drafts, cu_seqlens_q, stats, out)
    batch, max_k = drafts.shape
    device = drafts.device
    check(target_probs.ndim == 2 and target_probs.dtype == torch.float32, "target_probs",
          f"must be [T, V] float32, got {list(target_probs.shape)} {target_probs.dtype}")
    vocab = target_probs.shape[1]
    check(target_probs.device == device and target_probs.is_contiguous(), "target_probs",
          f"must be contiguous on {device}")
    if draft_probs is not None:
        check(draft_probs.shape == (batch, max_k, vocab) and draft_probs.dtype == torch.float32,
              "draft_probs", f"must be [{batch}, {max_k}, {vocab}] float32, got "
              f"{list(draft_probs.shape)} {draft_probs.dtype}")
        check(draft_probs.device == device and draft_probs.is_contiguous(), "draft_probs",
              f"must be contiguous on {device}")
    for name, t, shape in (("uniform", uniform, (batch, max_k)), ("sample_noise", sample_noise, (batch, vocab))):
        check(t.shape == shape and t.dtype == torch.float32, name,
              f"must be {list(shape)} float32, got {list(t.shape)} {t.dtype}")
        check(t.device == device and t.is_contiguous(), name, f"must be contiguous on {device}")
    if batch == 0:
        return out
    _accept_sampling_kernel[(triton.cdiv(batch, block_b),)](
        target_probs, draft_probs if draft_probs is not None else target_probs, drafts, cu_seqlens_q,
        uniform, sample_noise, out.out_tokens, out.num_out, out.accepted,
        stats.counters if stats is not None else out.num_out,
        batch, max_k, vocab,
        HAS_DRAFT_PROBS=draft_probs is not None,
        HAS_STATS=stats is not None,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        EMPTY_SCORE=NO_SCORE,
        BLOCK_B=block_b,
        BLOCK_Q=triton.next_power_of_2(max_k + 1),
        BLOCK_V=min(triton.next_power_of_2(vocab), block_v),
        num_warps=4,
    )
    return out
