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

On CUDA with bf16 inputs the activation quantisation is the Triton kernel below and the product
``torch._scaled_mm`` (``mat2`` column-major, K and N multiples of 16), one of two ways by M, the
rows of the step (static in a captured graph):
- M <= ``UNSCALED_MAX_M``: the integer product with unit scales into float32 (cuBLASLt's FP8 GEMM),
  then the scales and the cast in one Triton kernel (``scale_out``);
- larger M: row-wise scales inside the GEMM (``scale_a [M, 1]``, ``scale_b [1, N]``, bf16 out),
  which on an H200 (torch 2.11) ran 1.3-2x slower than the first way at M <= 64 and faster than
  bf16 from M = 256 on (benchmarks/targets_probe.py).
Elsewhere (CPU, float32 activations) everything runs as the torch reference, the formula above in
float32.
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
UNSCALED_MAX_M = 128  # up to this many rows: unit-scale GEMM into float32, then scale_out


# ---------------------------------------------------------------------------------------------
# Reference


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K] e4m3, scale [M, 1] float32), ``x ~= q * scale`` row by row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX  # [M, 1]
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def scale_out_ref(
    acc: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """acc [M, N] float32 integer-product sums -> acc * s_x [M, 1] * s_w [N], cast to ``dtype``."""
    return (acc * s_x * s_w[None, :]).to(dtype)


def fp8_linear_ref(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """x [M, K], q_w [N, K] e4m3, s_w [N] float32 -> [M, N] in x's dtype (the formula above)."""
    q_x, s_x = quantize_rows_ref(x)
    acc = q_x.float() @ q_w.float().t()  # [M, N]
    return scale_out_ref(acc, s_x, s_w, x.dtype)


# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _e4m3_bits(v):
    """fp32 ``v`` (|v| <= FP8_MAX) -> the e4m3fn bits of its nearest value, ties to even, as uint8,
    in integer and exact fp32 arithmetic only (products with powers of two, one rounding add): no
    fp8 cast, whose results differ between Triton's interpreter (some values at a binade's top
    rounded down a binade) and the GPU (-0.0 written as +0.0; odd elements lost when a thread
    holds two, Triton 3.6)."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.abs(v)
    # spacing of e4m3 values at |v|: 2**(exponent - 3), subnormals 2**-9 below 2**-6
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    ulp = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    mag = ((mag * inv_ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2**23: round half to even
    # mag is an e4m3 value: normal -> (exponent + 7) << 3 | top 3 mantissa bits; subnormal -> mag / 2**-9
    mag_bits = mag.to(tl.int32, bitcast=True)
    normal = ((((mag_bits >> 23) & 0xFF) - 120) << 3) | ((mag_bits >> 20) & 0x7)
    subnormal = (mag * 512.0).to(tl.int32)
    out = tl.where(mag >= 0.015625, normal, subnormal) | (
        (bits >> 24) & 0x80
    )  # 2**-6; the sign bit
    return out.to(tl.uint8)


@triton.jit
def _quantize_rows_kernel(
    # Pointers
    x_ptr,  # [M, K] bf16/fp16/fp32, last dim contiguous
    q_ptr,  # [M, K] uint8 view of the e4m3 output
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
    # IEEE divisions (tl.div_rn), as torch's: "/" on fp32 compiles to an approximate division on GPUs
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX_VALUE), FP8_MAX_VALUE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK_K):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX_VALUE, FP8_MAX_VALUE)
        tl.store(q_ptr + row * stride_q + start + cols, _e4m3_bits(q), mask=mask)


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
        q.view(torch.uint8),
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


@triton.jit
def _scale_out_kernel(
    # Pointers
    acc_ptr,  # [M, N] float32
    s_x_ptr,  # [M, 1] float32
    s_w_ptr,  # [N] float32
    y_ptr,  # [M, N] bf16/fp16/fp32, output
    # Dimensions
    n_cols,
    # Meta-parameters
    TO_BF16: tl.constexpr,  # y is bf16 (else float32)
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    acc = tl.load(acc_ptr + row * n_cols + cols, mask=mask, other=0.0)
    y = acc * tl.load(s_x_ptr + row) * tl.load(s_w_ptr + cols, mask=mask, other=0.0)
    if TO_BF16:  # round to nearest even in integer arithmetic (Triton's interpreter truncates)
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the high 16 bits
        y = bits.to(tl.float32, bitcast=True)  # a bf16 value: the cast below is exact
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def scale_out(
    acc: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Same as :func:`scale_out_ref`, one kernel launch. Capturable."""
    check(
        acc.ndim == 2 and acc.dtype == torch.float32 and acc.is_contiguous(),
        "acc",
        f"must be contiguous [M, N] float32, got {tuple(acc.shape)} {acc.dtype}",
    )
    m, n = acc.shape
    check(
        s_x.shape == (m, 1) and s_x.dtype == torch.float32 and s_x.is_contiguous(),
        "s_x",
        f"must be contiguous [{m}, 1] float32",
    )
    check(
        s_w.shape == (n,) and s_w.dtype == torch.float32 and s_w.is_contiguous(),
        "s_w",
        f"must be contiguous [{n}] float32",
    )
    check(
        dtype in (torch.bfloat16, torch.float32), "dtype", f"must be bf16 or float32, got {dtype}"
    )
    y = torch.empty(m, n, dtype=dtype, device=acc.device)
    if m == 0:
        return y
    block = min(triton.next_power_of_2(max(n, 16)), 1024)
    _scale_out_kernel[(m, triton.cdiv(n, block))](
        acc, s_x, s_w, y, n, TO_BF16=dtype == torch.bfloat16, BLOCK_N=block, num_warps=4
    )
    return y


# ---------------------------------------------------------------------------------------------
# Linear layer

_UNIT: dict[torch.device, torch.Tensor] = {}  # a float32 1.0 per device: _scaled_mm's unit scales


def _unit(device: torch.device) -> torch.Tensor:
    if device not in _UNIT:
        if torch.cuda.is_current_stream_capturing():  # it would live in the graph's private pool
            raise RuntimeError("fp8_linear: run it once before capturing a CUDA graph")
        _UNIT[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT[device]


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
    if x2.shape[0] <= UNSCALED_MAX_M:
        one = _unit(x.device)
        acc = torch._scaled_mm(q_x, q_w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = scale_out(acc, s_x, s_w, x.dtype)
    else:
        y = torch._scaled_mm(q_x, q_w.t(), scale_a=s_x, scale_b=s_w.view(1, n), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], n)
