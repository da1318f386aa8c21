"""Verify-budget allocation: grant a step's draft budget to the best (request, position) pairs.

Survival score of request i at draft position j (0-based) is the running product of the drafter's
confidences, ``score[i, j] = conf[i, 0] * ... * conf[i, j]`` (confidences clamped to [0, 1]), so it
never increases along j. Positions j >= k_valid[i] are not drafts and never granted.

The budget goes to the ``budget`` best pairs ordered by (score descending, request ascending,
position ascending). Scores do not increase along a request and ties fall to the lower position,
so every request's grant is a prefix of its drafts: the output is just its length ``grant[i]``.
Each request also keeps its one real token, so the target runs on ``B + sum(grant)`` tokens.

Device method (one program, fixed work, capturable): scores are >= 0, so their float32 bit
patterns order like the values. A fixed number of bisection steps over the bit patterns finds the
largest threshold ``t`` with ``count(score >= t) >= budget``; every score above ``t`` is granted
and the remaining budget goes to the scores equal to ``t`` in (request, position) order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spectune.kernels.kv_cache import check

ONE_BITS = 0x3F800000  # float32 bit pattern of 1.0, the largest possible score
NOT_A_DRAFT = -1  # bit key of positions >= k_valid: below every real score's key (>= 0)
BISECT_STEPS = 31  # [0, ONE_BITS + 1] has < 2**31 keys: 31 halvings always narrow it to one
MAX_TILE = 1 << 16  # batch x max_k elements one program holds


def survival_scores_ref(
    conf: torch.Tensor,  # [B, K] float32
    k_valid: torch.Tensor,  # [B] int32
) -> torch.Tensor:  # [B, K] float32, -inf where j >= k_valid
    """Running product of clamped confidences, multiplied in position order (bit-exact with the
    kernel, which multiplies in the same order)."""
    conf = conf.float().clamp(0.0, 1.0)
    scores = torch.empty_like(conf)
    running = torch.ones(conf.shape[0], dtype=conf.dtype, device=conf.device)
    for j in range(conf.shape[1]):
        running = running * conf[:, j]
        scores[:, j] = running
    scores = scores + 0.0  # -0.0 -> 0.0
    positions = torch.arange(conf.shape[1], device=conf.device)
    is_draft = positions[None, :] < k_valid.to(conf.device)[:, None].long()
    return torch.where(is_draft, scores, torch.full_like(scores, float("-inf")))


def allocate_ref(
    conf: torch.Tensor,  # [B, K] float32
    k_valid: torch.Tensor,  # [B] int32
    budget: int | torch.Tensor,
) -> torch.Tensor:  # grant [B] int32
    """Sort every (request, position) pair by score, take the top ``budget``, count per request."""
    batch, max_k = conf.shape
    scores = survival_scores_ref(conf, k_valid).flatten()  # [B * K], row-major = (i, j) order
    n_drafts = int(torch.isfinite(scores).sum())
    budget = int(budget.reshape(-1)[0]) if isinstance(budget, torch.Tensor) else int(budget)
    take = max(0, min(budget, n_drafts))
    # stable descending sort keeps (request, position) order among equal scores
    order = torch.sort(scores, descending=True, stable=True).indices[:take]
    grant = torch.bincount(order // max(max_k, 1), minlength=batch)
    return grant.to(torch.int32)


@triton.jit
def _allocate_kernel(
    # Pointers
    conf_ptr,  # [B, K] float32
    k_valid_ptr,  # [B] int32
    budget_ptr,  # [1] int32 (read when BUDGET_ON_DEVICE)
    grant_ptr,  # [B] int32, output
    # Dimensions
    batch,
    max_k,
    budget_value,  # python int budget (used when not BUDGET_ON_DEVICE)
    # Meta-parameters
    BUDGET_ON_DEVICE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_KEY: tl.constexpr,
    NOT_A_DRAFT_KEY: tl.constexpr,
    N_BISECT: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_B)  # request i
    cols = tl.arange(0, BLOCK_K)  # draft position j
    row_ok = rows < batch
    k_valid = tl.load(k_valid_ptr + rows, mask=row_ok, other=0)
    is_draft = (cols[None, :] < k_valid[:, None]) & (cols[None, :] < max_k) & row_ok[:, None]

    conf = tl.load(conf_ptr + rows[:, None] * max_k + cols[None, :],
                   mask=row_ok[:, None] & (cols[None, :] < max_k), other=1.0)
    conf = tl.minimum(tl.maximum(conf.to(tl.float32), 0.0), 1.0)
    # score[i, j] = conf[i, 0] * ... * conf[i, j], multiplied in position order
    score = tl.full((BLOCK_B, BLOCK_K), 1.0, tl.float32)
    for l in tl.static_range(BLOCK_K):
        c = tl.sum(tl.where(cols[None, :] == l, conf, 0.0), axis=1)  # column l, exactly
        score = tl.where(cols[None, :] >= l, score * c[:, None], score)
    score = tl.where(score > 0.0, score, 0.0)  # -0.0 -> 0.0 so the bit key orders it with 0
    key = tl.where(is_draft, score.to(tl.int32, bitcast=True), NOT_A_DRAFT_KEY)

    n_drafts = tl.sum(is_draft.to(tl.int32))
    budget = tl.load(budget_ptr) if BUDGET_ON_DEVICE else budget_value
    budget = tl.minimum(tl.maximum(budget, 0), n_drafts)

    # largest t with count(key >= t) >= budget; invariant: count(>= lo) >= budget > count(>= hi)
    lo = 0
    hi = ONE_KEY + 1
    for _ in range(N_BISECT):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((key >= mid).to(tl.int32)) >= budget
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    above = key > lo
    tie = key == lo
    left = budget - tl.sum(above.to(tl.int32))
    # rank of each tie in (request, position) order: ties in earlier rows + earlier in this row
    tie_i = tie.to(tl.int32)
    per_row = tl.sum(tie_i, axis=1)
    before_row = tl.cumsum(per_row, axis=0) - per_row
    rank = before_row[:, None] + tl.cumsum(tie_i, axis=1) - tie_i
    granted = above | (tie & (rank < left))
    grant = tl.sum(granted.to(tl.int32), axis=1)
    tl.store(grant_ptr + rows, grant, mask=row_ok)


def _int32(value: int) -> int:
    return max(-(2**31), min(2**31 - 1, int(value)))


def allocate(
    conf: torch.Tensor,  # [B, K] float32
    k_valid: torch.Tensor,  # [B] int32
    budget: int | torch.Tensor,  # python int, or [1]/0-dim int32 device tensor read in-kernel
    *,
    out: torch.Tensor | None = None,  # grant [B] int32
) -> torch.Tensor:
    """Grant ``budget`` drafts to the best (request, position) pairs -> grant [B] int32.

    A budget below 0 grants nothing; a budget above the number of drafts grants every draft.
    With a device tensor budget the value may change between CUDA-graph replays.
    """
    check(conf.ndim == 2, "conf", f"must be [B, K], got shape {tuple(conf.shape)}")
    batch, max_k = conf.shape
    check(conf.dtype in (torch.float32, torch.float16, torch.bfloat16), "conf",
          f"must be a float tensor, got {conf.dtype}")
    check(conf.is_contiguous(), "conf", "must be contiguous")
    check(k_valid.shape == (batch,), "k_valid", f"must be [{batch}], got {tuple(k_valid.shape)}")
    check(k_valid.dtype == torch.int32, "k_valid", f"must be int32, got {k_valid.dtype}")
    check(k_valid.device == conf.device, "k_valid", f"on {k_valid.device}, conf on {conf.device}")
    on_device = isinstance(budget, torch.Tensor)
    if on_device:
        assert isinstance(budget, torch.Tensor)
        check(budget.numel() == 1, "budget", f"must hold one value, got shape {tuple(budget.shape)}")
        check(budget.dtype == torch.int32, "budget", f"must be int32, got {budget.dtype}")
        check(budget.device == conf.device, "budget", f"on {budget.device}, conf on {conf.device}")
    if out is None:
        out = torch.empty(batch, dtype=torch.int32, device=conf.device)
    check(out.shape == (batch,) and out.dtype == torch.int32, "out",
          f"must be [{batch}] int32, got {tuple(out.shape)} {out.dtype}")
    check(out.device == conf.device, "out", f"on {out.device}, conf on {conf.device}")
    if batch == 0:
        return out
    block_b = triton.next_power_of_2(batch)
    block_k = triton.next_power_of_2(max(max_k, 1))
    check(block_b * block_k <= MAX_TILE, "conf",
          f"batch x max_k = {batch} x {max_k} is above the one-program limit {MAX_TILE}")
    _allocate_kernel[(1,)](
        conf, k_valid, budget if on_device else k_valid, out,
        batch, max_k, 0 if on_device else _int32(budget),  # type: ignore[arg-type]
        BUDGET_ON_DEVICE=on_device,
        BLOCK_B=block_b,
        BLOCK_K=block_k,
        ONE_KEY=ONE_BITS,
        NOT_A_DRAFT_KEY=NOT_A_DRAFT,
        N_BISECT=BISECT_STEPS,
        num_warps=4 if block_b * block_k <= 4096 else 8,
    )
    return out
