"""Fused pieces of a decoder layer: residual add + RMSNorm, SiLU(gate) x up, q/k RMSNorm + RoPE
(+ the paged KV-cache write).

Each piece replaces several elementwise kernels of ``models/decoder.py`` with one launch; each has
a torch reference that *is* the unfused decoder's maths (the decoder calls the references when it
runs unfused), and the kernels keep that maths within bf16 rounding:

    add_rms_norm   h = residual + x (rounded to the dtype), y = h * rsqrt(mean(h^2) + eps) * w
                   (float32, rounded once): returns (y, h); h is written into ``residual`` and y
                   into ``x`` (the layer's output, dead after the add) in place
    rms_norm       the same without the add (the first layer's input norm)
    silu_mul       gu [T, 2I] = [gate | up] -> silu(gate) (rounded) * up
    qk_norm_rope   qkv [T, (H + 2 Hkv) D] -> q [T, H, D], k [T, Hkv, D] contiguous, v a view:
                   per-head RMSNorm over D (Qwen3; skipped when the weights are None, Llama),
                   rounded, then rotate-half RoPE with the step's cos/sin [T, 1, D]:
                   out[:D/2] = x1 cos1 - x2 sin1, out[D/2:] = x2 cos2 + x1 sin2
    qk_norm_rope_write  the same, with the paged KV-cache write folded in: returns q only; the
                   normed + rotated k and the v rows go straight to cache slot ``slot_mapping[t]``
                   (``kv_cache.write_kv``'s layout; a slot < 0 is a padding row and writes
                   nothing). The caches hold qkv's dtype, so the write is an exact copy: the cache
                   ends up bit for bit as ``qk_norm_rope`` + ``write_kv`` leave it

Every program reads one row (one token) with block sizes set by the model's widths
only, never by T, so a token's output does not depend on the other rows of the step (greedy
speculative output stays equal to plain greedy output). Roundings to bf16 inside the kernels are
done in integer arithmetic (nearest even), because Triton's CPU interpreter truncates on a cast.

Kernels run on CUDA and under Triton's CPU interpreter (``TRITON_INTERPRET=1``); elsewhere
:func:`triton_runs` is False and the caller uses the references.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spectune.kernels.kv_cache import check, check_cache, write_kv_ref

DTYPES = (torch.bfloat16, torch.float32)
MAX_NORM_WIDTH = 16384  # widest row the one-block-per-row norm kernels take
SILU_BLOCK = 1024  # columns of the SiLU x mul output per program


def triton_runs(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, or CPU under Triton's interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------
# References (the unfused decoder's maths)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> RMSNorm(x) * weight in x's dtype."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (RMSNorm(residual + x) * weight, residual + x); inputs untouched."""
    h = residual + x
    return rms_norm_ref(h, weight, eps), h


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D]; rotate_half(x) = [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) D] -> q [T, H, D], k [T, Hkv, D] (normed when the weights are given,
    then rotated), v [T, Hkv, D] (a view of qkv)."""
    t = qkv.shape[0]
    hq, hkv = n_heads * head_dim, n_kv_heads * head_dim
    q, k, v = qkv.split([hq, hkv, hkv], dim=-1)
    q = q.view(t, n_heads, head_dim)  # [T, H, D]
    k = k.view(t, n_kv_heads, head_dim)  # [T, Hkv, D]
    v = v.reshape(t, n_kv_heads, head_dim)
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def qk_norm_rope_write_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`qk_norm_rope_ref`, then k and v into their paged cache slots as ``write_kv_ref``
    writes them (rows with slot < 0 write nothing); returns q [T, H, D]."""
    q, k, v = qk_norm_rope_ref(qkv, cos, sin, q_weight, k_weight, eps, n_heads, n_kv_heads, head_dim)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping.to(torch.int64))
    return q


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _round(y, ROUND_BF16: tl.constexpr):
    """float32 ``y`` -> the nearest bf16 value (ties to even), still float32; identity if not
    ROUND_BF16."""
    if ROUND_BF16:
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the high 16 bits
        y = bits.to(tl.float32, bitcast=True)
    return y


@triton.jit
def _rms_norm_kernel(
    # Pointers
    x_ptr,  # [T, N] input (the layer output to add, or the row to normalise)
    res_ptr,  # [T, N] residual in, residual + x out (HAS_RESIDUAL only)
    w_ptr,  # [N] norm weight
    out_ptr,  # [T, N] normalised output (may be x_ptr)
    # Dimensions
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    eps,
    # Meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = _round(h + r, ROUND_BF16)
        tl.store(res_ptr + row * stride_r + cols, h.to(res_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(h * rstd * w, ROUND_BF16)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(
    # Pointers
    gu_ptr,  # [T, 2I] gate then up
    out_ptr,  # [T, I]
    # Dimensions
    inter,
    stride_gu,
    stride_o,
    # Meta-parameters
    ROUND_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), ROUND_BF16)
    y = _round(s * u, ROUND_BF16)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    # Pointers
    qkv_ptr,  # [T, (H + 2 Hkv) D]
    cos_ptr,  # [T, ., D]
    sin_ptr,  # [T, ., D]
    qw_ptr,  # [D] q norm weight (HAS_NORM only)
    kw_ptr,  # [D] k norm weight (HAS_NORM only)
    q_ptr,  # [T, H, D] contiguous, output
    k_ptr,  # [T, Hkv, D] contiguous, output (not WRITE_KV)
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] (WRITE_KV only)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D] (WRITE_KV only)
    slot_ptr,  # [T] int32/int64 flat cache slot, < 0 = padding (WRITE_KV only)
    # Dimensions
    n_heads,
    n_kv_heads,
    stride_qkv,
    stride_cos,
    stride_sin,
    block_size,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    eps,
    # Meta-parameters
    HEAD_DIM: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,  # next power of two >= H + Hkv (+ Hkv with WRITE_KV)
    HALF_BLOCK: tl.constexpr,  # next power of two >= HEAD_DIM / 2
    HAS_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    # one program per token: a [heads, D/2] tile of each half; heads 0..H-1 are q, H..H+Hkv-1
    # are k, and with WRITE_KV H+Hkv.. are v (the order of qkv). v rows pass through unchanged.
    row = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    head = tl.arange(0, HEADS_BLOCK)[:, None]  # [HB, 1]
    d = tl.arange(0, HALF_BLOCK)[None, :]  # [1, HALF]
    d_ok = d < half
    n_rows = n_heads + n_kv_heads
    if WRITE_KV:
        n_rows += n_kv_heads
    ok = (head < n_rows) & d_ok
    q_ok = (head < n_heads) & d_ok  # rows written to q
    k_ok = ok & (head >= n_heads) & (head < n_heads + n_kv_heads)  # rows written to k
    src = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    raw1 = tl.load(src + d, mask=ok, other=0.0)  # [HB, HALF], qkv's dtype
    raw2 = tl.load(src + half + d, mask=ok, other=0.0)
    if WRITE_KV:
        # v rows go to the cache as read (the cache holds qkv's dtype); slot -> (block, offset)
        # as write_kv reads it; a padding row (slot < 0) writes nothing
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot >= 0:
            v_ok = ok & (head >= n_heads + n_kv_heads)
            v_head = head - n_heads - n_kv_heads
            v_dst = (v_cache_ptr + (slot // block_size) * stride_vcb
                     + (slot % block_size) * stride_vcs + v_head * stride_vch)
            tl.store(v_dst + d, raw1, mask=v_ok)
            tl.store(v_dst + half + d, raw2, mask=v_ok)
    x1 = raw1.to(tl.float32)
    x2 = raw2.to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [HB]
        rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        qw1 = tl.load(qw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)  # [1, HALF]
        qw2 = tl.load(qw_ptr + half + d, mask=d_ok, other=0.0).to(tl.float32)
        kw1 = tl.load(kw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        kw2 = tl.load(kw_ptr + half + d, mask=d_ok, other=0.0).to(tl.float32)
        is_q = head < n_heads
        x1 = _round(x1 * rstd * tl.where(is_q, qw1, kw1), ROUND_BF16)
        x2 = _round(x2 * rstd * tl.where(is_q, qw2, kw2), ROUND_BF16)
    c1 = tl.load(cos_ptr + row * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)  # [1, HALF]
    c2 = tl.load(cos_ptr + row * stride_cos + half + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sin + half + d, mask=d_ok, other=0.0).to(tl.float32)
    y1 = _round(x1 * c1 - x2 * s1, ROUND_BF16)
    y2 = _round(x2 * c2 + x1 * s2, ROUND_BF16)
    q_dst = q_ptr + (row * n_heads + head) * HEAD_DIM
    tl.store(q_dst + d, y1.to(q_ptr.dtype.element_ty), mask=q_ok)
    tl.store(q_dst + half + d, y2.to(q_ptr.dtype.element_ty), mask=q_ok)
    if WRITE_KV:
        slot = tl.load(slot_ptr + row).to(tl.int64)  # as above
        if slot >= 0:
            k_head = head - n_heads
            k_dst = (k_cache_ptr + (slot // block_size) * stride_kcb
                     + (slot % block_size) * stride_kcs + k_head * stride_kch)
            tl.store(k_dst + d, y1.to(k_cache_ptr.dtype.element_ty), mask=k_ok)
            tl.store(k_dst + half + d, y2.to(k_cache_ptr.dtype.element_ty), mask=k_ok)
    else:
        k_dst = k_ptr + (row * n_kv_heads + head - n_heads) * HEAD_DIM
        tl.store(k_dst + d, y1.to(k_ptr.dtype.element_ty), mask=k_ok)
        tl.store(k_dst + half + d, y2.to(k_ptr.dtype.element_ty), mask=k_ok)


# ---------------------------------------------------------------------------------------------
# Launchers (capturable: no host reads of device values)


def _check_rows(name: str, x: torch.Tensor) -> None:
    check(x.ndim == 2, name, f"must be [T, N], got shape {tuple(x.shape)}")
    check(x.dtype in DTYPES, name, f"must be bfloat16 or float32, got {x.dtype}")
    check(x.stride(-1) == 1, name, "last dim must be contiguous")


def _check_weight(name: str, w: torch.Tensor, n: int, x: torch.Tensor) -> None:
    check(
        w.shape == (n,) and w.is_contiguous(),
        name,
        f"must be contiguous [{n}], got {tuple(w.shape)}",
    )
    check(w.device == x.device, name, f"device {w.device} != input {x.device}")


def _norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    t, n = x.shape
    check(n <= MAX_NORM_WIDTH, "x", f"rows of {n} > {MAX_NORM_WIDTH} columns")
    if t == 0:
        return
    res = residual if residual is not None else x
    _rms_norm_kernel[(t,)](
        x,
        res,
        weight,
        out,
        n,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        ROUND_BF16=x.dtype == torch.bfloat16,
        BLOCK=triton.next_power_of_2(max(n, 16)),
        num_warps=4 if n <= 2048 else 8,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same as :func:`rms_norm_ref` for x [T, N], one launch; returns a new tensor."""
    _check_rows("x", x)
    _check_weight("weight", weight, x.shape[1], x)
    out = torch.empty_like(x)
    _norm_launch(x, None, weight, eps, out)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`add_rms_norm_ref`, one launch, in place: ``residual`` becomes residual + x
    and ``x`` its normalised value; returns (x, residual)."""
    _check_rows("x", x)
    _check_rows("residual", residual)
    check(
        residual.shape == x.shape,
        "residual",
        f"shape {tuple(residual.shape)} != x {tuple(x.shape)}",
    )
    check(residual.dtype == x.dtype, "residual", f"dtype {residual.dtype} != x {x.dtype}")
    check(residual.device == x.device, "residual", f"device {residual.device} != x {x.device}")
    _check_weight("weight", weight, x.shape[1], x)
    _norm_launch(x, residual, weight, eps, x)
    return x, residual


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """Same as :func:`silu_mul_ref` for gu [T, 2I], one launch."""
    _check_rows("gu", gu)
    t, two_i = gu.shape
    check(two_i % 2 == 0, "gu", f"width {two_i} is not gate + up of equal halves")
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gu.dtype, device=gu.device)
    if t == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(max(inter, 16)))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gu,
        out,
        inter,
        gu.stride(0),
        out.stride(0),
        ROUND_BF16=gu.dtype == torch.bfloat16,
        BLOCK=block,
        num_warps=4,
    )
    return out


def _qk_norm_rope_launch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    heads: tuple[int, int, int],  # (H, Hkv, D)
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (k_cache, v_cache, slots)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks, allocates and launches: (q [T, H, D], k [T, Hkv, D]), or (q, None) when ``cache``
    is given and k, v go to their slots instead."""
    n_heads, n_kv_heads, head_dim = heads
    _check_rows("qkv", qkv)
    t = qkv.shape[0]
    width = (n_heads + 2 * n_kv_heads) * head_dim
    check(qkv.shape[1] == width, "qkv", f"width {qkv.shape[1]} != (H + 2 Hkv) * D = {width}")
    check(head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {head_dim}")
    for name, c in (("cos", cos), ("sin", sin)):
        check(
            c.shape[0] == t and c.shape[-1] == head_dim and c.numel() == t * head_dim,
            name,
            f"must be [{t}, 1, {head_dim}], got {tuple(c.shape)}",
        )
        check(
            c.stride(-1) == 1 and c.device == qkv.device, name, "must be contiguous on qkv's device"
        )
    has_norm = q_weight is not None and k_weight is not None
    if q_weight is not None and k_weight is not None:
        _check_weight("q_weight", q_weight, head_dim, qkv)
        _check_weight("k_weight", k_weight, head_dim, qkv)
    q = torch.empty(t, n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = None
    if cache is None:
        k = torch.empty(t, n_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q, k
    k_cache, v_cache, slots = cache if cache is not None else (qkv, qkv, qkv)
    write = cache is not None
    rows = n_heads + n_kv_heads + (n_kv_heads if write else 0)  # q, k (, v) rows of the tile
    block = triton.next_power_of_2(rows)
    half = triton.next_power_of_2(max(head_dim // 2, 16))
    _qk_norm_rope_kernel[(t,)](
        qkv,
        cos,
        sin,
        q_weight if q_weight is not None else qkv,
        k_weight if k_weight is not None else qkv,
        q,
        k if k is not None else q,
        k_cache,
        v_cache,
        slots,
        n_heads,
        n_kv_heads,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.shape[1] if write else 1,
        *(k_cache.stride()[:3] if write else (0, 0, 0)),
        *(v_cache.stride()[:3] if write else (0, 0, 0)),
        eps,
        HEAD_DIM=head_dim,
        HEADS_BLOCK=block,
        HALF_BLOCK=half,
        HAS_NORM=has_norm,
        WRITE_KV=write,
        ROUND_BF16=qkv.dtype == torch.bfloat16,
        num_warps=4 if block * half <= 4096 else 8,
    )
    return q, k


def qk_norm_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same as :func:`qk_norm_rope_ref`, one launch (a program per token)."""
    heads = (n_heads, n_kv_heads, head_dim)
    q, k = _qk_norm_rope_launch(qkv, cos, sin, q_weight, k_weight, eps, heads, None)
    assert k is not None
    t, hkv = qkv.shape[0], n_kv_heads * head_dim
    v = qkv[:, n_heads * head_dim + hkv :].view(t, n_kv_heads, head_dim)
    return q, k, v


def qk_norm_rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], qkv's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], qkv's dtype
    slot_mapping: torch.Tensor,  # [T] int32/int64, < 0 = padding
) -> torch.Tensor:
    """Same as :func:`qk_norm_rope_write_ref`, one launch (a program per token): returns q; k and
    v go straight to their cache slots. The caches must hold qkv's dtype (the write is then an
    exact copy of what :func:`qk_norm_rope` + ``write_kv`` store)."""
    check_cache(k_cache, v_cache)
    t = qkv.shape[0]
    check(
        k_cache.shape[2:] == (n_kv_heads, head_dim),
        "k_cache",
        f"must be [num_blocks, block_size, {n_kv_heads}, {head_dim}], got {tuple(k_cache.shape)}",
    )
    check(k_cache.dtype == qkv.dtype, "k_cache", f"dtype {k_cache.dtype} != qkv {qkv.dtype}")
    check(k_cache.device == qkv.device, "k_cache", f"device {k_cache.device} != qkv {qkv.device}")
    check(
        slot_mapping.shape == (t,) and slot_mapping.dtype in (torch.int32, torch.int64),
        "slot_mapping",
        f"must be [{t}] int32/int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}",
    )
    check(
        slot_mapping.device == qkv.device,
        "slot_mapping",
        f"device {slot_mapping.device} != qkv {qkv.device}",
    )
    heads = (n_heads, n_kv_heads, head_dim)
    cache = (k_cache, v_cache, slot_mapping)
    q, _ = _qk_norm_rope_launch(qkv, cos, sin, q_weight, k_weight, eps, heads, cache)
    return q
