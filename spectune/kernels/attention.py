"""Verification attention over a paged KV cache: the Triton kernel and its torch references.

One step verifies, per request b, ``q_len[b]`` new tokens (1..K+1: the last real token plus its
granted drafts). Their K/V rows are already in the cache (``write_kv`` runs first), so request b
has ``seq_len = context_lens[b] + q_len[b]`` cached tokens and new token j (0-based) sees cache
positions ``< context_lens[b] + j + 1`` (causal among the request's own new tokens).

The kernel runs one program per (request, kv head, split). The G = H / Hkv query heads sharing a
kv head and all of the request's new tokens form one query tile of ``G * q_len`` rows
(row r = token r // G, head kvh * G + r % G), so each KV block is read once whatever q_len is:
the cost stays KV-read bound from 1 to 16 query tokens. When batch x kv heads is too small to fill
the GPU, the context is cut into ``num_splits`` chunks (flash-decoding); each split writes a
partial output and its log-sum-exp, and a second kernel combines them. ``num_splits`` is chosen
from static sizes only, so a step can be captured in a CUDA graph.

``meta`` is duck-typed (``spectune.kernels.meta.AttnMeta``): ``cu_seqlens_q [B+1] int32``,
``context_lens [B] int32``, ``max_q`` (static int), ``block_tables [B, max_blocks] int32``.
Rows >= cu_seqlens_q[-1] are padding and come out as zeros.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from spectune.kernels.kv_cache import KernelInputError, check, check_cache

MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
MAX_BLOCK_M = 256  # G * max_q above this does not fit one query tile
MIN_SPLIT_TOKENS = 128  # a split reads at least this many KV positions
MAX_SPLITS = 16


@dataclass(frozen=True)
class AttnConfig:
    block_n: int = 64  # KV positions per tile
    num_warps: int = 4
    num_stages: int = 2


# Hand-picked for sm_90 (H100/H200); the benchmark sweeps SM90_CONFIGS to re-check them.
SM90_CONFIGS = (
    AttnConfig(64, 4, 2),
    AttnConfig(64, 4, 3),
    AttnConfig(128, 4, 2),
    AttnConfig(64, 8, 3),
    AttnConfig(128, 8, 2),
)
INTERPRETER_CONFIG = AttnConfig(block_n=16, num_warps=1, num_stages=1)


def default_config(device: torch.device, block_m: int, head_dim: int) -> AttnConfig:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if block_m >= 128 or head_dim > 128:
        return AttnConfig(64, 8, 2)
    return AttnConfig(64, 4, 3)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, n_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Static split count: enough (request, kv head, split) programs to cover the SMs twice when
    batch x kv heads alone would leave them idle, each split keeping >= MIN_SPLIT_TOKENS."""
    programs = batch * n_kv_heads
    if programs >= num_sms:
        return 1
    wanted = -(-2 * num_sms // programs)
    by_len = max(1, max_kv_len // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_len, MAX_SPLITS))


# ---------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _verify_attn_kernel(
    # Pointers
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    cu_seqlens_q_ptr,  # [B+1] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [T, H, D]
    part_o_ptr,  # [NUM_SPLITS, T, H, D] fp32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [NUM_SPLITS, T, H] fp32, log2 domain (NUM_SPLITS > 1)
    # Strides
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    # Dimensions
    num_tokens, num_heads, head_dim, num_requests,
    qk_scale,  # sm_scale * log2(e)
    # Meta-parameters
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    CAUSAL: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,  # >= G * max_q
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast operands before tl.dot (the CPU interpreter's bf16 dot is wrong)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_end = tl.load(cu_seqlens_q_ptr + b + 1)
    q_len = q_end - q_start
    ctx = tl.load(context_lens_ptr + b)
    seq_len = ctx + q_len

    rows = tl.arange(0, BLOCK_M)
    j = rows // G  # new-token index of each row
    heads = kvh * G + rows % G
    row_ok = j < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (q_start + j)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if CAUSAL:  # noqa: SIM108 (constexpr branch)
        limit = ctx + j + 1  # [BLOCK_M] keys < limit are visible
    else:
        limit = seq_len + j * 0  # block drafters: every new token sees the whole block

    # this split's KV range: chunks of whole tiles, computed on the device from seq_len
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.where(q_len > 0, tl.minimum(kv_lo + chunk, seq_len), kv_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        blk = tl.load(block_tables_ptr + b * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        blk = blk.to(tl.int64)
        off = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks
                    + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (n[None, :] < limit[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
                    + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + (q_start + j)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part_row = (split * num_tokens + q_start + j) * num_heads + heads  # [BLOCK_M]
        tl.store(part_o_ptr + part_row[:, None] * head_dim + d[None, :], o, mask=q_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)

    # padding rows (after the last request's queries) come out as zeros
    if (b == num_requests - 1) & (split == 0):
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty)
        for t0 in range(q_end, num_tokens, BLOCK_M // G):
            t = t0 + j
            pad_mask = ((j < BLOCK_M // G) & (t < num_tokens))[:, None] & d_ok[None, :]
            tl.store(out_ptr + t[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     zeros, mask=pad_mask)


@triton.jit
def _combine_splits_kernel(
    # Pointers
    part_o_ptr,  # [NUM_SPLITS, T, H, D] fp32
    part_lse_ptr,  # [NUM_SPLITS, T, H] fp32, log2 domain
    cu_seqlens_q_ptr,  # [B+1] int32
    out_ptr,  # [T, H, D]
    # Strides
    stride_ot, stride_oh,
    # Dimensions
    num_tokens, num_heads, head_dim, num_requests,
    # Meta-parameters
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t < tl.load(cu_seqlens_q_ptr + num_requests):
        s = tl.arange(0, BLOCK_S)
        s_ok = s < NUM_SPLITS
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        part_row = (s * num_tokens + t) * num_heads + h  # [BLOCK_S]
        lse = tl.load(part_lse_ptr + part_row, mask=s_ok, other=float("-inf"))
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.where(s_ok, tl.math.exp2(lse - top), 0.0)  # [BLOCK_S]
        o = tl.load(part_o_ptr + part_row[:, None] * head_dim + d[None, :],
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
    ``causal=False``: each new token sees all of its request's new tokens (block drafters)."""
    check_cache(k_cache, v_cache)
    _, block_size, n_kv_heads, head_dim = k_cache.shape
    check(q.ndim == 3 and q.shape[2] == head_dim, "q", f"must be [T, H, {head_dim}], got {tuple(q.shape)}")
    num_tokens, num_heads, _ = q.shape
    check(num_heads % n_kv_heads == 0, "q", f"{num_heads} heads is not a multiple of {n_kv_heads} kv heads")
    check(q.dtype == k_cache.dtype, "q", f"dtype {q.dtype} != k_cache {k_cache.dtype}")
    check(q.stride(-1) == 1, "q", "head_dim must be contiguous")
    batch, max_q = _check_meta(meta)
    group = num_heads // n_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group * max_q))
    check(block_m <= MAX_BLOCK_M, "meta.max_q", f"{group} heads x {max_q} tokens > {MAX_BLOCK_M} rows per kv head")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, "out",
          f"must be {tuple(q.shape)} {q.dtype} with contiguous head_dim")
    if num_tokens == 0:
        return out
    block_tables = meta.block_tables
    if num_splits is None:
        max_kv_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, n_kv_heads, max_kv_len, _num_sms(q.device))
    check(1 <= num_splits <= 64, "num_splits", f"must be in 1..64, got {num_splits}")
    cfg = config or default_config(q.device, block_m, head_dim)
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else sm_scale
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_o = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _verify_attn_kernel[(batch, n_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, meta.cu_seqlens_q, meta.context_lens,
        out, part_o, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_tokens, num_heads, head_dim, batch,
        scale * math.log2(math.e),
        BLOCK_SIZE=block_size, CAUSAL=causal, G=group, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=q.device.type != "cuda" and q.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part_o, part_lse, meta.cu_seqlens_q, out,
            out.stride(0), out.stride(1),
            num_tokens, num_heads, head_dim, batch,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
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
