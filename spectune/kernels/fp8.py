"""FP8 (e4m3) linear layers: per-output-channel weight scales, per-token activation scales.

A weight ``w [N, K]`` is stored as ``q_w [N, K]`` e4m3 and ``s_w [N]`` float32 with
``s_w[n] = max_k |w[n, k]| / FP8_MAX`` and ``q_w = round(w / s_w)``. Activations stay in their own
dtype (bf16) between layers; each linear quantises its input row by row the same way
(``s_x [M, 1]``, dynamic: from the rows it is given) and returns the input's dtype:

    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k]        (fp32 accumulation)

Scales are per row on both sides, so a token's output never depends on the other rows of the batch
(a per-tensor activation scale would: padding rows or another request would change it), which keeps
greedy speculative output equal to plain greedy output. Zero rows get the scale ``MIN_AMAX / FP8_MAX``
and quantise to zeros.

On CUDA with bf16 inputs the product is ``torch._scaled_mm`` with row-wise scales (``scale_a
[M, 1]``, ``scale_b [1, N]`` float32, ``mat2`` column-major, K and N multiples of 16, bf16 out) and
the activation quantisation is the Triton kernel below; elsewhere (CPU, float32 activations) both
run as the torch reference, which computes the formula above in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spectune.kernels.kv_cache import check

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_AMAX = 1e-12  # row maximum used for an all-zero row (keeps the scale finite and non-zero)
ALIGN = 16  # _scaled_mm: K and N must be multiples of this


# ---------------------------------------------------------------------------------------------
# Reference


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K] e4m3, scale [M, 1] float32), ``x ~= q * scale`` row by row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX  # [M, 1]
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def fp8_linear_ref(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """x [M, K], q_w [N, K] e4m3, s_w [N] float32 -> [M, N] in x's dtype (the formula above)."""
    q_x, s_x = quantize_rows_ref(x)
    acc = q_x.float() @ q_w.float().t()  # [M, N]
    return (acc * s_x * s_w[None, :]).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _round_to_e4m3(v):
    """Round fp32 ``v`` (|v| <= FP8_MAX) to the nearest e4m3 value, ties to even, in fp32 arithmetic.
    The result is exactly representable, so the final cast does not round (Triton's interpreter
    rounds some values at a binade's top to the binade below)."""
    mag = tl.abs(v)
    exponent = ((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # e4m3 subnormals: spacing 2**-9 below 2**-6
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    mag = ((mag / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2**23: round half to even
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -mag, mag)  # the sign bit, -0.0 included


@triton.jit
def _quantize_rows_kernel(
    # Pointers
    x_ptr,  # [M, K] bf16/fp16/fp32, last dim contiguous
    q_ptr,  # [M, K] e4m3, output
    scale_ptr,  # [M, 1] float32, output
    # Dimensions
    n_cols,
    stride_x,
    stride_q,
    # Meta-parameters
    FP8_MAX_VALUE: tl.constexpr,
    MIN_AMAX_VALUE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < n_cols, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX_VALUE) / FP8_MAX_VALUE
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK_K):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX_VALUE, FP8_MAX_VALUE)  # IEEE division, as torch
        q = _round_to_e4m3(q)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(
    x: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`quantize_rows_ref`, one kernel launch. Capturable."""
    check(x.ndim == 2, "x", f"must be [M, K], got shape {tuple(x.shape)}")
    check(
        x.dtype in (torch.bfloat16, torch.float16, torch.float32),
        "x",
        f"must be bf16, fp16 or fp32, got {x.dtype}",
    )
    check(x.stride(-1) == 1, "x", "last dim must be contiguous")
    m, k = x.shape
    if out is None:
        out = (
            torch.empty(m, k, dtype=FP8, device=x.device),
            torch.empty(m, 1, dtype=torch.float32, device=x.device),
        )
    q, scale = out
    check(
        q.shape == (m, k) and q.dtype == FP8 and q.is_contiguous(),
        "out.q",
        f"must be contiguous [{m}, {k}] {FP8}, got {list(q.shape)} {q.dtype}",
    )
    check(
        scale.shape == (m, 1) and scale.dtype == torch.float32 and scale.is_contiguous(),
        "out.scale",
        f"must be contiguous [{m}, 1] float32, got {list(scale.shape)} {scale.dtype}",
    )
    if m == 0:
        return q, scale
    _quantize_rows_kernel[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        FP8_MAX_VALUE=FP8_MAX,
        MIN_AMAX_VALUE=MIN_AMAX,
        BLOCK_K=min(triton.next_power_of_2(max(k, 16)), 4096),
        num_warps=4,
    )
    return q, scale


# ---------------------------------------------------------------------------------------------
# Linear layer


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q_w [N, K] e4m3, s_w [N] float32): one scale per output channel."""
    check(w.ndim == 2, "weight", f"must be [N, K], got shape {tuple(w.shape)}")
    q, scale = quantize_rows_ref(w)
    return q, scale[:, 0].contiguous()


def scaled_mm_ok(x: torch.Tensor, q_w: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` runs ``torch._scaled_mm`` on these inputs (else the reference)."""
    n, k = q_w.shape
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and k % ALIGN == 0
        and n % ALIGN == 0
        and torch.cuda.get_device_capability(x.device) >= (8, 9)
    )


def fp8_linear(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype; q_w [N, K] e4m3 (row-major), s_w [N] float32."""
    check(
        q_w.ndim == 2 and q_w.dtype == FP8,
        "q_w",
        f"must be [N, K] {FP8}, got {tuple(q_w.shape)} {q_w.dtype}",
    )
    n, k = q_w.shape
    check(x.shape[-1] == k, "x", f"last dim {x.shape[-1]} != weight K {k}")
    check(s_w.shape == (n,) and s_w.dtype == torch.float32, "s_w", f"must be [{n}] float32")
    x2 = x.reshape(-1, k)
    if not scaled_mm_ok(x2, q_w):
        return fp8_linear_ref(x2, q_w, s_w).view(*x.shape[:-1], n)
    q_x, s_x = quantize_rows(x2 if x2.stride(-1) == 1 else x2.contiguous())
    y = torch._scaled_mm(q_x, q_w.t(), scale_a=s_x, scale_b=s_w.view(1, n), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], n)
