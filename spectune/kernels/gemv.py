"""Small-M linear: ``y [M, N] = x [M, K] @ w [N, K].T`` for M = 1..16 rows, a weight-read kernel.

At decode sizes a projection is a read of its weight: 2 N K bytes against 2 M N K flops, so the
time is the weight's bytes over the HBM bandwidth, and cuBLAS's GEMMs at M = 1..16 reach only part
of it on an H200 (wo 4096 x 4096: 2.53 of 4.15 TB/s; benchmarks/results/engine_speed_h200/
gemm_check.json). The kernel is shaped for the read:

    program (n, s) owns output columns [n * BLOCK_N, (n + 1) * BLOCK_N) for all M rows (each
    weight element is read once) and the K range [s * k_chunk, (s + 1) * k_chunk) of its split:
        acc [BLOCK_N, BLOCK_M] = sum over BLOCK_K chunks of  w_tile [BLOCK_N, BLOCK_K] @ x_tile.T
    (the product is swapped, y.T = w @ x.T, so the wide side BLOCK_N is the dot's M and the few
    rows of x, padded to BLOCK_M = 16, its N), fp32 accumulation.
    SPLIT_K == 1: acc cast to the output dtype and stored.
    SPLIT_K > 1:  fp32 partials [SPLIT_K, M, N] into a workspace, summed in split order and cast
                  by a second kernel (``_reduce_splits_kernel``): deterministic, no atomics.

Split-K lets a small N (wo: 64 column blocks of 64) still fill the GPU's SMs. Results differ from
``x.float() @ w.float().T`` cast to the output dtype only by the order of the fp32 sums (and the
last bit of the cast where that order moves a value across a rounding boundary).

Capturable in a CUDA graph: no host sync; the output and the workspace come from torch's caching
allocator (a captured graph keeps its own, the same every replay), their sizes fixed by the
shapes. Configs: ``heuristic_config(n, k, num_sms)``, no tuned table yet (none measured).
``small_m_linear`` runs the kernel where it applies (``small_m_ok``) and ``F.linear`` elsewhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spectune.kernels.fused import triton_runs
from spectune.kernels.kv_cache import check

MAX_M = 16  # rows the kernel takes; more go to F.linear
BLOCK_M = 16  # x rows padded to this (tl.dot's smallest side)
DTYPES = (torch.bfloat16, torch.float16)  # what small_m_linear sends to the kernel
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what small_m_matmul takes
PROGRAMS_PER_SM = 4  # split K until the grid holds about this many programs per SM
MIN_K_BLOCKS_PER_SPLIT = 2  # a split reads at least this many BLOCK_K chunks
MAX_SPLIT_K = 16


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64  # output columns per program (the dot's M side)
    block_k: int = 256  # K per loop step
    split_k: int = 1  # programs per column block, each over its own K range
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check(_pow2(self.block_n) and 16 <= self.block_n <= 256, "block_n",
              f"must be a power of 2 in 16..256, got {self.block_n}")
        check(_pow2(self.block_k) and 16 <= self.block_k <= 1024, "block_k",
              f"must be a power of 2 in 16..1024, got {self.block_k}")
        check(1 <= self.split_k <= 64, "split_k", f"must be in 1..64, got {self.split_k}")
        check(self.num_warps in (1, 2, 4, 8), "num_warps", f"must be 1, 2, 4 or 8, got {self.num_warps}")
        check(1 <= self.num_stages <= 8, "num_stages", f"must be in 1..8, got {self.num_stages}")


def heuristic_config(n: int, k: int, num_sms: int) -> GemvConfig:
    """Config for a [N, K] weight: 64 columns x 256 K per step (a 32 KiB bf16 tile, three in
    flight per program), split K until about ``PROGRAMS_PER_SM`` programs per SM, each split
    reading at least ``MIN_K_BLOCKS_PER_SPLIT`` chunks (split_k as the launch runs it: every split
    non-empty). H200 (132 SMs) qwen3-8b: wo 4096 x 4096 -> 64 column blocks x 8 splits; wqkv
    6144 x 4096 -> 96 x 6; w2 4096 x 12288 -> 64 x 8; w13 24576 x 4096 -> 384 x 2; lm_head unsplit."""
    block_n = 64
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    n_blocks = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, n_blocks)
    split = max(1, min(want, k_blocks // MIN_K_BLOCKS_PER_SPLIT, MAX_SPLIT_K))
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=launch_splits(k, block_k, split)[0])


def launch_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) a launch runs for ``split_k``: K cut into equal whole-BLOCK_K chunks,
    as many as ``split_k`` asks or fewer (no empty split)."""
    k_blocks = triton.cdiv(k, block_k)
    k_chunk = triton.cdiv(k_blocks, min(split_k, k_blocks)) * block_k
    return triton.cdiv(k, k_chunk), k_chunk


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.lru_cache(maxsize=256)
def _cached_config(n: int, k: int, num_sms: int) -> GemvConfig:
    return heuristic_config(n, k, num_sms)


def default_config(device: torch.device, n: int, k: int) -> GemvConfig:
    return _cached_config(n, k, _num_sms(device))


# ---------------------------------------------------------------------------------------------
# Reference


def small_m_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in x's dtype: the float32 product, cast once."""
    return (x.float() @ w.float().t()).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _small_m_kernel(
    # Pointers
    x_ptr,  # [M, K] bf16/fp16/fp32, last dim contiguous
    w_ptr,  # [N, K], same dtype, last dim contiguous
    out_ptr,  # SPLIT_K == 1: y [M, N] in x's dtype; else partials [SPLIT_K, M, N] float32
    # Dimensions
    m_rows,
    n_cols,
    k_dim,
    k_chunk,  # K per split, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast operands before tl.dot (the CPU interpreter's bf16 dot is wrong)
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = weight rows
    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x
    col_ok = cols < n_cols
    row_ok = rows < m_rows
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + rows[None, :] * stride_xm  # [1, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y.T tile
    k_lo = split * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, k_dim)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = ks < k_hi
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_rows + ks[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        if DOT_F32:
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    mask = col_ok[:, None] & row_ok[None, :]
    offs = rows[None, :] * n_cols + cols[:, None]  # y [M, N] element (m, n) of acc[n, m]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split * m_rows * n_cols + offs, acc, mask=mask)


@triton.jit
def _reduce_splits_kernel(
    # Pointers
    part_ptr,  # [SPLIT_K, M, N] float32
    y_ptr,  # [M, N] output dtype
    # Dimensions
    size,  # M * N
    # Meta-parameters
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * size + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK = 1024


def small_m_matmul(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """Same as :func:`small_m_matmul_ref` up to the order of the fp32 sums; x [M, K] with
    1 <= M <= 16, w [N, K]; one launch, two with split-K. Capturable."""
    check(x.ndim == 2, "x", f"must be [M, K], got shape {tuple(x.shape)}")
    check(w.ndim == 2, "w", f"must be [N, K], got shape {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    check(1 <= m <= MAX_M, "x", f"must have 1..{MAX_M} rows, got {m}")
    check(w.shape[1] == k, "w", f"K {w.shape[1]} != x's K {k}")
    check(x.dtype in KERNEL_DTYPES, "x", f"must be bf16, fp16 or fp32, got {x.dtype}")
    check(w.dtype == x.dtype, "w", f"dtype {w.dtype} != x's {x.dtype}")
    check(w.device == x.device, "w", f"device {w.device} != x's {x.device}")
    check(x.stride(-1) == 1 and w.stride(-1) == 1, "x", "x and w need a contiguous last dim")
    check(k >= 1 and n >= 1, "w", f"needs N, K >= 1, got {tuple(w.shape)}")
    cfg = config or default_config(x.device, n, k)
    split, k_chunk = launch_splits(k, cfg.block_k, cfg.split_k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _small_m_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, w, out, m, n, k, k_chunk, x.stride(0), w.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_F32=x.device.type != "cuda" and x.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        _reduce_splits_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            out, y, m * n, SPLIT_K=split, BLOCK=REDUCE_BLOCK, num_warps=4)
    return y


# ---------------------------------------------------------------------------------------------
# Linear layer


def small_m_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``small_m_linear`` runs the kernel: Triton runs on the device (CUDA, or CPU under
    its interpreter), bf16/fp16 x and w of one dtype, 1 <= M <= 16 rows, contiguous last dims."""
    m = x.numel() // max(x.shape[-1], 1)
    return (
        triton_runs(x.device)
        and x.dtype in DTYPES
        and w.dtype == x.dtype
        and w.ndim == 2
        and w.stride(-1) == 1
        and 1 <= m <= MAX_M
    )


def small_m_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias) for x [..., K], w [N, K]: the kernel where ``small_m_ok``,
    else F.linear itself."""
    if not small_m_ok(x, w):
        return F.linear(x, w)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    y = small_m_matmul(x2 if x2.stride(-1) == 1 else x2.contiguous(), w)
    return y.view(*x.shape[:-1], w.shape[0])
