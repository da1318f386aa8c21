"""Verification attention over a paged KV cache: the Triton kernel and its torch references.

One step verifies, per request b, ``q_len[b]`` new tokens (1..K+1: the last real token plus its
granted drafts). Their K/V rows are already in the cache (``write_kv`` runs first), so request b
has ``seq_len = context_lens[b] + q_len[b]`` cached tokens and new token j (0-based) sees cache
positions ``< context_lens[b] + j + 1`` (causal among the request's own new tokens).

The G = H / Hkv query heads sharing a kv head and all of a request's new tokens form ``G * max_q``
query rows (row r = token r // G, head kvh * G + r % G), so each KV block is read once whatever
q_len is: the cost stays KV-read bound from 1 to 16 query tokens. The rows are cut into query
tiles of BLOCK_M rows (usually one tile); the kernel runs one program per (request, kv head x
query tile, split). When too few programs would fill the GPU, the context is cut into
``num_splits`` chunks (flash-decoding); each split writes a partial output and its log-sum-exp,
and a second kernel combines them. Launch parameters come from static sizes only (a tuned table
per GPU, ``spectune.kernels.attention_configs``), so a step can be captured in a CUDA graph.

Inside a program the KV range is walked in two loops: whole blocks every row may see (all keys
below ``context_len + 1`` in causal mode), with no mask at all, then the one or two tail blocks
where the causal mask and the range end apply. A config with ``lazy`` set keeps the whole tiles'
running max until a row's tile max passes it by more than ``LAZY_LOG2`` (log2 units): a tile
under it skips the rescale of the accumulator and the row sums (the online softmax's per-tile
ALU work, which the 64-row tiles of 16-token verification pay 64 times per kv head).

``meta`` is duck-typed (``spectune.kernels.attention_metadata.AttnMeta``): ``cu_seqlens_q [B+1] int32``,
``context_lens [B] int32``, ``max_q`` (static int), ``block_tables [B, max_blocks] int32``.
Rows >= cu_seqlens_q[-1] are padding and come out as zeros. A meta with ``parts`` (a mixed step's
decode rows, then its prompt pieces) runs one launch per part, in order, into one output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from spectune.kernels.attention_configs import (
    MAX_BLOCK_M,
    MAX_SPLITS,
    MIN_BLOCK_M,
    MIN_SPLIT_TOKENS,
    AttnConfig,
    choose_num_splits,
    default_config,
    natural_block_m,
    num_sms,
)
from spectune.kernels.kv_cache import KernelInputError, check, check_cache

__all__ = [
    "MAX_BLOCK_M", "MAX_SPLITS", "MIN_BLOCK_M", "MIN_SPLIT_TOKENS", "AttnConfig", "LaunchPlan",
    "choose_num_splits", "default_config", "folded_dense", "gather_dense_kv", "plan_launch",
    "sdpa_gqa_dense", "verify_attention", "verify_attention_folded", "verify_attention_ref",
    "verify_attention_sdpa_gqa",
]


LAZY_LOG2 = tl.constexpr(8.0)  # a stale max leaves p <= 2^8: no overflow in fp32, none in bf16's P

# ---------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _load_kv_tile(base, blk, off, stride_b, stride_s, d, n_ok, d_ok,
                  MASK_N: tl.constexpr, MASK_D: tl.constexpr, DOT_F32: tl.constexpr):
    ptrs = base + blk[:, None] * stride_b + off[:, None] * stride_s + d[None, :]  # [BLOCK_N, BLOCK_D]
    if MASK_N:
        x = tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif MASK_D:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _attend_tile(
    acc, l_i, m_i,  # [BLOCK_M, BLOCK_D] fp32, [BLOCK_M] fp32, [BLOCK_M] fp32 (log2 domain, scaled)
    q,  # [BLOCK_M, BLOCK_D]
    k_base, v_base,  # cache pointers already offset to this kv head
    bt_row,  # this request's block-table row
    start, kv_hi, limit,  # tile start, split end, [BLOCK_M] visibility limit of each row
    stride_kb, stride_ks, stride_vb, stride_vs,
    qk_scale, d, d_ok,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK_D: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, LAZY: tl.constexpr,
):
    n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    n_ok = n < kv_hi
    if MASKED:
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
    off = n % BLOCK_SIZE
    k = _load_kv_tile(k_base, blk, off, stride_kb, stride_ks, d, n_ok, d_ok, MASKED, MASK_D, DOT_F32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    # softmax in the log2 domain: exp(x * sm_scale) = exp2(x * qk_scale), qk_scale > 0
    if LAZY and not MASKED:  # (masked tiles stay exact: rows may have nothing visible yet)
        # the running max moves only when some row's tile max passes it by more than LAZY_LOG2:
        # otherwise p = exp2(score - stale max) <= 2^LAZY_LOG2 (exact in fp32, and in bf16 to its
        # usual relative precision) and acc and l are not rescaled; o = acc / l is the same
        m_tile = tl.max(s, 1) * qk_scale
        m_new = m_i
        if tl.max(m_tile - m_i, 0) > LAZY_LOG2:  # (the first tile always: m_i is -inf there)
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        if MASKED:
            s = tl.where((n[None, :] < limit[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new  # every row sees every key of this tile
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
    v = _load_kv_tile(v_base, blk, off, stride_vb, stride_vs, d, n_ok, d_ok, MASKED, MASK_D, DOT_F32)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["stride_bt", "num_tokens", "num_requests", "num_splits"])
def _verify_attn_kernel(
    # Pointers
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B+1] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [T, H, D]
    part_o_ptr,  # [num_splits, T, H, D] fp32 (SPLIT)
    part_lse_ptr,  # [num_splits, T, H] fp32, log2 domain (SPLIT)
    # Strides
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    # Dimensions
    num_tokens, num_heads, num_requests, num_splits,
    qk_scale,  # sm_scale * log2(e)
    # Meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    CAUSAL: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    M_TILES: tl.constexpr,  # query tiles per kv head: M_TILES * BLOCK_M >= G * max_q
    BLOCK_M: tl.constexpr,  # >= G
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the combine kernel
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast operands before tl.dot (the CPU interpreter's bf16 dot is wrong)
    LAZY: tl.constexpr,  # whole tiles rescale only past LAZY_LOG2 (``AttnConfig.lazy``)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // M_TILES
    m_tile = tl.program_id(1) % M_TILES
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_end = tl.load(cu_seqlens_q_ptr + b + 1)
    q_len = q_end - q_start
    ctx = tl.load(context_lens_ptr + b)
    seq_len = ctx + q_len

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    j = rows // G  # new-token index of each row
    heads = kvh * G + rows % G
    row_ok = j < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (q_start + j)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if CAUSAL:  # noqa: SIM108 (constexpr branch)
        limit = ctx + j + 1  # [BLOCK_M] keys < limit are visible
    else:
        limit = seq_len + j * 0  # block drafters: every new token sees the whole block

    # this split's KV range: chunks of whole tiles, computed on the device from seq_len;
    # a query tile without a real row reads nothing
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.where(m_tile * BLOCK_M < G * q_len, tl.minimum(kv_lo + chunk, seq_len), kv_lo)
    # keys below open_hi are visible to every row: whole tiles there need no mask
    if CAUSAL:  # noqa: SIM108 (constexpr branch)
        open_hi = tl.minimum(kv_hi, ctx + 1)
    else:
        open_hi = kv_hi
    full_hi = kv_lo + tl.maximum(open_hi - kv_lo, 0) // BLOCK_N * BLOCK_N

    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, kv_hi, limit,
                                     stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, d, d_ok,
                                     BLOCK_SIZE, BLOCK_N, BLOCK_D != HEAD_DIM, False,
                                     DOT_PRECISION, DOT_F32, LAZY)
    for start in range(full_hi, kv_hi, BLOCK_N):  # tail: causal mask and range end
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_base, v_base, bt_row, start, kv_hi, limit,
                                     stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, d, d_ok,
                                     BLOCK_SIZE, BLOCK_N, BLOCK_D != HEAD_DIM, True,
                                     DOT_PRECISION, DOT_F32, LAZY)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLIT:
        part_row = (split * num_tokens + q_start + j) * num_heads + heads  # [BLOCK_M]
        tl.store(part_o_ptr + part_row[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
    else:
        tl.store(out_ptr + (q_start + j)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)

    # padding rows (after the last request's queries) come out as zeros
    if (b == num_requests - 1) & (split == 0) & (m_tile == 0):
        lr = tl.arange(0, BLOCK_M)
        pj = lr // G
        ph = kvh * G + lr % G
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty)
        for t0 in range(q_end, num_tokens, BLOCK_M // G):
            t = t0 + pj
            pad_mask = ((pj < BLOCK_M // G) & (t < num_tokens))[:, None] & d_ok[None, :]
            tl.store(out_ptr + t[:, None] * stride_ot + ph[:, None] * stride_oh + d[None, :],
                     zeros, mask=pad_mask)


@triton.jit(do_not_specialize=["num_tokens", "num_requests", "num_splits"])
def _combine_splits_kernel(
    # Pointers
    part_o_ptr,  # [num_splits, T, H, D] fp32
    part_lse_ptr,  # [num_splits, T, H] fp32, log2 domain
    cu_seqlens_q_ptr,  # [B+1] int32
    out_ptr,  # [T, H, D]
    # Strides
    stride_ot, stride_oh,
    # Dimensions
    num_tokens, num_heads, num_requests, num_splits,
    # Meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # rows of this launch's requests only (a part of a mixed step starts past row 0)
    if (t >= tl.load(cu_seqlens_q_ptr)) & (t < tl.load(cu_seqlens_q_ptr + num_requests)):
        s = tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        part_row = (s * num_tokens + t) * num_heads + h  # [BLOCK_S]
        lse = tl.load(part_lse_ptr + part_row, mask=s_ok, other=float("-inf"))
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.where(s_ok, tl.math.exp2(lse - top), 0.0)  # [BLOCK_S]
        o = tl.load(part_o_ptr + part_row[:, None] * HEAD_DIM + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        den = tl.sum(w, 0)
        res = tl.sum(w[:, None] * o, 0) / tl.where(den == 0.0, 1.0, den)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# Wrapper


def _check_meta(meta: Any) -> tuple[int, int]:
    cu = meta.cu_seqlens_q
    check(cu.ndim == 1 and cu.shape[0] >= 2, "meta.cu_seqlens_q", f"must be [B+1] with B >= 1, got {tuple(cu.shape)}")
    batch = cu.shape[0] - 1
    check(meta.context_lens.shape == (batch,), "meta.context_lens", f"must be [{batch}], got {tuple(meta.context_lens.shape)}")
    check(int(meta.max_q) >= 1, "meta.max_q", f"must be >= 1, got {meta.max_q}")
    bt = getattr(meta, "block_tables", None)
    if bt is None:
        raise KernelInputError("meta.block_tables", "required for paged attention")
    check(bt.ndim == 2 and bt.shape[0] == batch, "meta.block_tables", f"must be [{batch}, max_blocks], got {tuple(bt.shape)}")
    return batch, int(meta.max_q)


@dataclass(frozen=True)
class LaunchPlan:
    config: AttnConfig  # the config used (explicit, tuned table or heuristic)
    block_m: int  # query rows per program
    m_tiles: int  # query tiles per kv head
    num_splits: int  # KV splits per (request, kv head, query tile)


def plan_launch(device: torch.device, *, num_heads: int, n_kv_heads: int, head_dim: int,
                batch: int, max_q: int, max_kv_len: int, config: AttnConfig | None = None,
                num_splits: int | None = None) -> LaunchPlan:
    """Everything verify_attention decides on the host, from static sizes only."""
    group = num_heads // n_kv_heads
    rows = group * max_q
    cfg = config or default_config(device, rows, head_dim, batch * n_kv_heads)
    block_m = max(cfg.block_m or natural_block_m(rows), triton.next_power_of_2(group), MIN_BLOCK_M)
    m_tiles = -(-rows // block_m)
    if num_splits is None:
        if cfg.num_splits:
            num_splits = min(cfg.num_splits, max(1, max_kv_len // MIN_SPLIT_TOKENS))
        else:
            num_splits = choose_num_splits(batch * m_tiles, n_kv_heads, max_kv_len, num_sms(device))
    return LaunchPlan(cfg, block_m, m_tiles, num_splits)


def verify_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: Any,
    *,
    out: torch.Tensor | None = None,  # [T, H, D]
    num_splits: int | None = None,
    config: AttnConfig | None = None,
    sm_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Paged varlen verification attention; returns out [T, H, D] (padding rows zero).
    ``causal=False``: each new token sees all of its request's new tokens (block drafters).
    ``num_splits`` overrides the config's split count (which is clamped to the cache length)."""
    check_cache(k_cache, v_cache)
    _, block_size, n_kv_heads, head_dim = k_cache.shape
    check(q.ndim == 3 and q.shape[2] == head_dim, "q", f"must be [T, H, {head_dim}], got {tuple(q.shape)}")
    num_tokens, num_heads, _ = q.shape
    check(num_heads % n_kv_heads == 0, "q", f"{num_heads} heads is not a multiple of {n_kv_heads} kv heads")
    check(q.dtype == k_cache.dtype, "q", f"dtype {q.dtype} != k_cache {k_cache.dtype}")
    check(q.stride(-1) == 1, "q", "head_dim must be contiguous")
    parts = getattr(meta, "parts", None)
    if parts:  # a mixed step: one launch per part, in order, into the same output
        if out is None:
            out = torch.empty_like(q)
        for part in parts:
            verify_attention(q, k_cache, v_cache, part, out=out, num_splits=num_splits, config=config,
                             sm_scale=sm_scale, causal=causal)
        return out
    batch, max_q = _check_meta(meta)
    group = num_heads // n_kv_heads
    check(group <= MAX_BLOCK_M, "q", f"{group} query heads per kv head > {MAX_BLOCK_M}")
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else sm_scale
    check(scale > 0, "sm_scale", f"must be > 0, got {scale}")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, "out",
          f"must be {tuple(q.shape)} {q.dtype} with contiguous head_dim")
    if num_tokens == 0:
        return out
    block_tables = meta.block_tables
    plan = plan_launch(q.device, num_heads=num_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                       batch=batch, max_q=max_q, max_kv_len=block_tables.shape[1] * block_size,
                       config=config, num_splits=num_splits)
    cfg, block_m, m_tiles, num_splits = plan.config, plan.block_m, plan.m_tiles, plan.num_splits
    check(1 <= num_splits <= 64, "num_splits", f"must be in 1..64, got {num_splits}")
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_o = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _verify_attn_kernel[(batch, n_kv_heads * m_tiles, num_splits)](
        q, k_cache, v_cache, block_tables, meta.cu_seqlens_q, meta.context_lens,
        out, part_o, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_tokens, num_heads, batch, num_splits,
        scale * math.log2(math.e),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, CAUSAL=causal, G=group, M_TILES=m_tiles,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=q.device.type != "cuda" and q.dtype == torch.bfloat16, LAZY=bool(cfg.lazy),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs or None,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_o, part_lse, meta.cu_seqlens_q, out,
            out.stride(0), out.stride(1),
            num_tokens, num_heads, batch, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=4 if q.device.type == "cuda" else 1,
        )
    return out


# ---------------------------------------------------------------------------------------------
# Torch references


def verify_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: Any,
    sm_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Ground truth: per-request loop, explicit block-table gather, fp32 math, explicit mask."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // n_kv_heads
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else sm_scale
    cu = meta.cu_seqlens_q.tolist()
    ctx = meta.context_lens.tolist()
    tables = meta.block_tables.to(torch.int64)
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
    for b in range(len(ctx)):
        q_len = cu[b + 1] - cu[b]
        if q_len <= 0:
            continue
        pos = torch.arange(ctx[b] + q_len, device=q.device)  # [L]
        blocks = tables[b, pos // block_size]
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(group, dim=1)  # [L, H, D]
        qb = q[cu[b] : cu[b + 1]].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [H, q_len, L]
        limit = ctx[b] + torch.arange(q_len, device=q.device) + 1  # new token j sees pos < ctx + j + 1
        if not causal:
            limit = torch.full_like(limit, ctx[b] + q_len)
        visible = pos[None, :] < limit[:, None]  # [q_len, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)


def gather_dense_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each request's blocks into dense [B, Hkv, max_blocks * block_size, D] K and V."""
    idx = block_tables.to(torch.int64)
    batch, width = idx.shape
    k = k_cache[idx].reshape(batch, width * k_cache.shape[1], *k_cache.shape[2:]).transpose(1, 2)
    v = v_cache[idx].reshape(batch, width * v_cache.shape[1], *v_cache.shape[2:]).transpose(1, 2)
    return k, v


def _row_index(meta: Any, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed row t -> (request b [T], new-token index j [T], is-real [T]); device ops only."""
    cu = meta.cu_seqlens_q.to(torch.int64)
    t = torch.arange(num_tokens, device=cu.device)
    b = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=cu.shape[0] - 2)
    j = t - cu[b]
    return b, j.clamp(0, int(meta.max_q) - 1), (t < cu[-1]) & (j < int(meta.max_q))


def _dense_queries(q: torch.Tensor, meta: Any) -> torch.Tensor:
    """Packed q [T, H, D] -> [B, max_q, H, D]; rows past a request's q_len repeat its first row."""
    cu = meta.cu_seqlens_q.to(torch.int64)
    max_q = int(meta.max_q)
    j = torch.arange(max_q, device=q.device)
    q_len = cu[1:] - cu[:-1]
    rows = cu[:-1, None] + torch.where(j[None, :] < q_len[:, None], j[None, :], 0)  # [B, max_q]
    return q[rows.clamp(max=max(q.shape[0] - 1, 0))]


def _visible(meta: Any, kv_len: int, rows: int, group: int) -> torch.Tensor:
    """Boolean mask [B, 1, rows, kv_len]: row r is new token r // group."""
    ctx = meta.context_lens.to(torch.int64)
    q_len = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).to(torch.int64)
    j = torch.arange(rows, device=ctx.device) // group
    limit = ctx[:, None] + torch.minimum(j[None, :], (q_len[:, None] - 1).clamp(min=0)) + 1  # [B, rows]
    pos = torch.arange(kv_len, device=ctx.device)
    return (pos[None, None, :] < limit[:, :, None])[:, None]


def _scatter_rows(dense: torch.Tensor, meta: Any, num_tokens: int) -> torch.Tensor:
    """[B, max_q, H, D] -> packed [T, H, D] with zero padding rows."""
    b, j, real = _row_index(meta, num_tokens)
    return torch.where(real[:, None, None], dense[b, j], torch.zeros((), dtype=dense.dtype, device=dense.device))


def sdpa_gqa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
    """q [T, H, D], dense k/v [B, Hkv, L, D] -> [T, H, D] via SDPA(enable_gqa=True)."""
    qd = _dense_queries(q, meta).transpose(1, 2)  # [B, H, max_q, D]
    mask = _visible(meta, k.shape[2], qd.shape[2], 1)
    o = torch.nn.functional.scaled_dot_product_attention(qd, k, v, attn_mask=mask, enable_gqa=True)
    return _scatter_rows(o.transpose(1, 2), meta, q.shape[0])


def folded_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
    """q [T, H, D], dense k/v [B, Hkv, L, D] -> [T, H, D]; the G query heads of a kv head are
    folded into the query axis (row r = token r // G, head r % G) so K/V are read once."""
    batch, n_kv_heads = k.shape[0], k.shape[1]
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // n_kv_heads
    max_q = int(meta.max_q)
    qd = _dense_queries(q, meta)  # [B, max_q, H, D]
    qf = qd.reshape(batch, max_q, n_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qf = qf.reshape(batch, n_kv_heads, max_q * group, head_dim)  # [B, Hkv, max_q * G, D]
    mask = _visible(meta, k.shape[2], max_q * group, group)
    o = torch.nn.functional.scaled_dot_product_attention(qf, k, v, attn_mask=mask)
    o = o.reshape(batch, n_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return _scatter_rows(o.reshape(batch, max_q, num_heads, head_dim), meta, q.shape[0])


def verify_attention_sdpa_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any) -> torch.Tensor:
    """Dense gather from the block tables + SDPA with enable_gqa=True (torch baseline)."""
    k, v = gather_dense_kv(k_cache, v_cache, meta.block_tables)
    return sdpa_gqa_dense(q, k, v, meta)


def verify_attention_folded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any) -> torch.Tensor:
    """Dense gather + one SDPA call with query heads folded into the query axis (torch baseline)."""
    k, v = gather_dense_kv(k_cache, v_cache, meta.block_tables)
    return folded_dense(q, k, v, meta)
