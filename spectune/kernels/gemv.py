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
shapes. Measured on the H200 it loses to cuBLAS at every M = 1..16 (1.4-1.7x with its best swept
config), so ``small_m_linear`` does not run it: it is kept for the sweep and as the multi-row
starting point.

One row (M = 1) has its own kernel, ``gemv_row``: the streaming GEMV, no tl.dot (x padded to 16
rows wastes the dot's N side 16x) and no split-K (one launch, no workspace, no reduce pass):

    program n owns output columns [n * BLOCK_N, (n + 1) * BLOCK_N) and reads their whole K:
        acc [BLOCK_N, BLOCK_K] += w_tile [BLOCK_N, BLOCK_K] * x_chunk [1, BLOCK_K]   (fp32)
    over the BLOCK_K chunks, then y = sum(acc, axis=1) once, cast to x's dtype.

Its fill of the GPU comes from the column blocks alone (``row_heuristic_config`` picks BLOCK_N for
about ``ROW_PROGRAMS_PER_SM`` programs per SM); the w tile is contiguous along K so its loads
vectorise. Deterministic: each output's sum is one program's, in a fixed order. H200, qwen3-8b's
weights at M = 1: 1.03-1.25x faster than cuBLAS (wo 10.6 vs 13.2 us, 3.16 TB/s; lm_head 282 vs
297 us, 4.41 TB/s); ``small_m_linear`` runs it at one row (``small_m_ok``), ``F.linear``
elsewhere. Its configs have no table, only the heuristic (the best swept is 1-5 % faster).

Configs per weight shape (N, K): a tuned table's entry for exactly that shape, else
``heuristic_config``. Tables are JSON files ``configs/gemv/<device name>.json`` (none shipped yet:
nothing measured), written by ``benchmarks/gemm_check.py --sweep`` as ``gemv_configs.json``;
``SPECTUNE_GEMV_CONFIGS=<file>`` replaces the packaged table.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spectune.kernels.attention_configs import (
    CONFIG_DIR,
    ConfigTableError,
    read_json,
    table_file_name,
    table_head,
)
from spectune.kernels.fused import triton_runs
from spectune.kernels.kv_cache import check

MAX_M = 16  # rows the kernel takes; more go to F.linear
BLOCK_M = 16  # x rows padded to this (tl.dot's smallest side)
DTYPES = (torch.bfloat16, torch.float16)  # what small_m_linear sends to the kernel
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what small_m_matmul takes
PROGRAMS_PER_SM = 4  # split K until the grid holds about this many programs per SM
MIN_K_BLOCKS_PER_SPLIT = 2  # a split reads at least this many BLOCK_K chunks
MAX_SPLIT_K = 16
ROW_PROGRAMS_PER_SM = 4  # gemv_row: the widest column block that still gives this many programs per SM
ROW_TILE = 8192  # gemv_row heuristic: at most this many w elements a tile (64 fp32 accumulators a thread at 4 warps)


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
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    return GemvConfig(block_n=64, block_k=block_k, split_k=auto_splits(n, k, 64, block_k, num_sms))


def auto_splits(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Splits that bring the grid to about ``PROGRAMS_PER_SM`` programs per SM, each split at
    least ``MIN_K_BLOCKS_PER_SPLIT`` chunks, as the launch runs them."""
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, triton.cdiv(n, block_n))
    split = max(1, min(want, triton.cdiv(k, block_k) // MIN_K_BLOCKS_PER_SPLIT, MAX_SPLIT_K))
    return launch_splits(k, block_k, split)[0]


def launch_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) a launch runs for ``split_k``: K cut into equal whole-BLOCK_K chunks,
    as many as ``split_k`` asks or fewer (no empty split)."""
    k_blocks = triton.cdiv(k, block_k)
    k_chunk = triton.cdiv(k_blocks, min(split_k, k_blocks)) * block_k
    return triton.cdiv(k, k_chunk), k_chunk


def candidate_configs(n: int, k: int, num_sms: int) -> list[GemvConfig]:
    """What ``gemm_check.py --sweep`` times for one shape: the heuristic's config, and around it
    block_n 32/64/128, block_k 128/256/512 (at most K's power of 2), splits half / same / twice
    the heuristic's for each tile (as the launch runs them), 4 stages, 4 warps (also 8 for the
    128-wide tile: a narrower tile holds too few loads per warp for 8 to help). About 36 configs
    a shape, so a sweep of one decoder's five weights at three M values stays within a minute."""
    base = heuristic_config(n, k, num_sms)
    out = {base}
    k_pow2 = max(16, triton.next_power_of_2(k))
    for block_n in (32, 64, 128):
        for block_k in sorted({min(b, k_pow2) for b in (128, 256, 512)}):
            auto = auto_splits(n, k, block_n, block_k, num_sms)
            for split in {max(1, auto // 2), auto, 2 * auto}:
                split = launch_splits(k, block_k, min(split, 64))[0]
                for warps in (4, 8) if block_n == 128 else (4,):
                    out.add(GemvConfig(block_n, block_k, split, warps, 4))
    return sorted(out, key=lambda c: (c != base, tuple(asdict(c).values())))


@dataclass(frozen=True)
class GemvRowConfig:
    """``gemv_row``'s launch: a [block_n, block_k] w tile per loop step, one program per block_n
    output columns (no split: a program reads its columns' whole K)."""

    block_n: int  # output columns per program (w rows of a tile)
    block_k: int  # K per loop step (contiguous along a w row: the vectorised side)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check(_pow2(self.block_n) and self.block_n <= 128, "block_n",
              f"must be a power of 2 in 1..128, got {self.block_n}")
        check(_pow2(self.block_k) and 16 <= self.block_k <= 4096, "block_k",
              f"must be a power of 2 in 16..4096, got {self.block_k}")
        check(self.num_warps in (1, 2, 4, 8), "num_warps", f"must be 1, 2, 4 or 8, got {self.num_warps}")
        check(1 <= self.num_stages <= 8, "num_stages", f"must be in 1..8, got {self.num_stages}")


def row_heuristic_config(n: int, k: int, num_sms: int) -> GemvRowConfig:
    """Config for ``gemv_row`` on a [N, K] weight: the widest block_n of 32/16/8 that still gives
    ``ROW_PROGRAMS_PER_SM`` programs per SM (8 if none does: the GPU is filled by column blocks
    alone), block_k 512 at most (and at most K's power of 2 and ``ROW_TILE`` elements a tile:
    64 fp32 accumulators a thread), 4 warps, 3 stages. H200 (132 SMs, 528 programs wanted)
    qwen3-8b: wo 4096 x 4096, wqkv 6144 x 4096 and w2 4096 x 12288 -> 8 x 512 (512, 768, 512
    programs); w13 24576 x 4096 -> 32 x 256 (768); lm_head 151936 x 4096 -> 32 x 256 (4748)."""
    want = ROW_PROGRAMS_PER_SM * num_sms
    block_n = next((b for b in (32, 16, 8) if triton.cdiv(n, b) >= want), 8)
    k_pow2 = max(16, triton.next_power_of_2(k))
    return GemvRowConfig(block_n=block_n, block_k=min(512, k_pow2, ROW_TILE // block_n))


def row_candidate_configs(n: int, k: int, num_sms: int) -> list[GemvRowConfig]:
    """What a sweep times for ``gemv_row`` on one shape: the heuristic's config first, then
    block_n 4/8/16/32 x block_k 256/512/1024 (at most K's power of 2) pruned by the tile:
    2K..16K elements (smaller: too little in flight a program; larger: too many accumulators);
    4 warps up to 8K elements, 8 from 8K (about 16..64 fp32 accumulators a thread); stages so
    that the tiles loaded ahead of the one in use, (stages - 1) x the bf16 tile, hold 8..32 KiB.
    27 configs at K >= 1024 (qwen3-8b's five weights), fewer where K caps block_k."""
    base = row_heuristic_config(n, k, num_sms)
    out = {base}
    k_pow2 = max(16, triton.next_power_of_2(k))
    for block_n in (4, 8, 16, 32):
        for block_k in sorted({min(b, k_pow2) for b in (256, 512, 1024)}):
            tile = block_n * block_k
            if not 2048 <= tile <= 16384:
                continue
            for warps in (w for w, lo, hi in ((4, 0, 8192), (8, 8192, 1 << 30)) if lo <= tile <= hi):
                for stages in (2, 3, 4):
                    if 8192 <= 2 * tile * (stages - 1) <= 32768:
                        out.add(GemvRowConfig(block_n, block_k, warps, stages))
    return sorted(out, key=lambda c: (c != base, tuple(asdict(c).values())))


# ---------------------------------------------------------------------------------------------
# Tuned tables: {"format", "device_name", "sm_count", "source", "configs": [{"n", "k", <config>}]}

TABLE_FORMAT = "spectune-gemv-configs/1"
TABLE_ENV = "SPECTUNE_GEMV_CONFIGS"
_CONFIG_KEYS = {f.name for f in fields(GemvConfig)}


def table_to_json(device_name: str, sm_count: int, source: str,
                  entries: dict[tuple[int, int], GemvConfig]) -> str:
    """A table's JSON text, one shape per line."""
    head = {"format": TABLE_FORMAT, "device_name": device_name, "sm_count": sm_count, "source": source}
    lines = [json.dumps({"n": n, "k": k, **asdict(cfg)}) for (n, k), cfg in sorted(entries.items())]
    return ("{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(v)}" for key, v in head.items())
            + ',\n "configs": [\n' + ",\n".join("  " + line for line in lines) + "\n ]\n}\n")


def table_from_dict(data: Any, where: str) -> dict[tuple[int, int], GemvConfig]:
    """Validate a parsed table -> {(N, K): config}; every error names ``where`` and the field."""
    def fail(field: str, reason: str) -> ConfigTableError:
        return ConfigTableError(f"{where}: {field}: {reason}")

    _, _, raw = table_head(data, where, TABLE_FORMAT)
    entries: dict[tuple[int, int], GemvConfig] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise fail(f"configs[{i}]", "must be an object")
        bad = sorted(set(item) - _CONFIG_KEYS - {"n", "k"})
        if bad:
            raise fail(f"configs[{i}].{bad[0]}", "unknown key")
        for key in ("n", "k", *sorted(_CONFIG_KEYS & set(item))):
            if not isinstance(item.get(key), int) or isinstance(item.get(key), bool) or item[key] < 1:
                raise fail(f"configs[{i}].{key}", f"must be an integer >= 1, got {item.get(key)!r}")
        try:
            cfg = GemvConfig(**{key: item[key] for key in _CONFIG_KEYS & set(item)})
        except ValueError as exc:
            raise fail(f"configs[{i}]", str(exc)) from None
        entries[(item["n"], item["k"])] = cfg
    return entries


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> dict[tuple[int, int], GemvConfig]:
    """Read and validate one table file (cached per path)."""
    return table_from_dict(read_json(path), path)


def table_for_device(device_name: str) -> dict[tuple[int, int], GemvConfig]:
    """$SPECTUNE_GEMV_CONFIGS, else the packaged ``configs/gemv/<device>.json``, else empty."""
    override = os.environ.get(TABLE_ENV)
    if override:
        return load_table(override)
    path = CONFIG_DIR / "gemv" / table_file_name(device_name)
    return load_table(str(path)) if path.is_file() else {}


@functools.cache
def _device_facts(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return "", 1
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


@functools.lru_cache(maxsize=256)
def config_for(name: str, sms: int, n: int, k: int) -> GemvConfig:
    """The table's config of GPU ``name`` for (N, K), else the heuristic for ``sms`` SMs."""
    found = table_for_device(name).get((n, k)) if name else None
    return found or heuristic_config(n, k, sms)


def default_config(device: torch.device, n: int, k: int) -> GemvConfig:
    """The table's config for this exact (N, K) on this GPU, else the heuristic (1 SM off CUDA)."""
    return config_for(*_device_facts(device), n, k)


# ---------------------------------------------------------------------------------------------
# Reference


def small_m_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K], w [N, K] -> [M, N] in x's dtype: the float32 product, cast once."""
    return (x.float() @ w.float().t()).to(x.dtype)


@functools.lru_cache(maxsize=256)
def _row_config(sms: int, n: int, k: int) -> GemvRowConfig:
    return row_heuristic_config(n, k, sms)


def row_default_config(device: torch.device, n: int, k: int) -> GemvRowConfig:
    """``gemv_row``'s config when none is given: the heuristic for this GPU's SMs (1 SM off CUDA)."""
    return _row_config(_device_facts(device)[1], n, k)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit(do_not_specialize=["m_rows", "k_chunk"])
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
    SPLIT: tl.constexpr,  # more than one split: fp32 partials into out_ptr
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
    if not SPLIT:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split * m_rows * n_cols + offs, acc, mask=mask)


@triton.jit(do_not_specialize=["size", "splits"])
def _reduce_splits_kernel(
    # Pointers
    part_ptr,  # [splits, M, N] float32
    y_ptr,  # [M, N] output dtype
    # Dimensions
    size,  # M * N
    splits,
    # Meta-parameters
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in range(1, splits):  # in split order: deterministic
        acc += tl.load(part_ptr + s * size + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_row_kernel(
    # Pointers
    x_ptr,  # [1, K] bf16/fp16/fp32, contiguous
    w_ptr,  # [N, K], same dtype, last dim contiguous
    y_ptr,  # [1, N] in x's dtype
    # Dimensions
    n_cols,
    k_dim,
    stride_wn,
    # Meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # BLOCK_K divides K: no K mask, so nothing stops the loads vectorising
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = w rows
    # Tail columns read w's last row again instead of a masked load (the store drops them): the
    # w loads keep no N mask.
    w_rows = w_ptr + tl.minimum(cols, n_cols - 1).to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")  # read once: stream it
            xk = tl.load(x_ptr + ks, eviction_policy="evict_last")  # read by every program
        else:
            k_ok = ks < k_dim
            w = tl.load(w_rows + ks[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xk = tl.load(x_ptr + ks, mask=k_ok, other=0.0, eviction_policy="evict_last")
        acc += w.to(tl.float32) * xk.to(tl.float32)[None, :]  # [BLOCK_N, BLOCK_K]
    y = tl.sum(acc, axis=1)  # [BLOCK_N], once after the loop
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


REDUCE_BLOCK = 1024


def _check_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    """What both kernels ask of x [M, K] (its rows checked by the caller) and w [N, K]."""
    check(w.ndim == 2, "w", f"must be [N, K], got shape {tuple(w.shape)}")
    k = x.shape[1]
    check(w.shape[1] == k, "w", f"K {w.shape[1]} != x's K {k}")
    check(x.dtype in KERNEL_DTYPES, "x", f"must be bf16, fp16 or fp32, got {x.dtype}")
    check(w.dtype == x.dtype, "w", f"dtype {w.dtype} != x's {x.dtype}")
    check(w.device == x.device, "w", f"device {w.device} != x's {x.device}")
    check(x.stride(-1) == 1, "x", "needs a contiguous last dim")
    check(w.stride(-1) == 1, "w", "needs a contiguous last dim")
    check(k >= 1 and w.shape[0] >= 1, "w", f"needs N, K >= 1, got {tuple(w.shape)}")


def small_m_matmul(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """Same as :func:`small_m_matmul_ref` up to the order of the fp32 sums; x [M, K] with
    1 <= M <= 16, w [N, K]; one launch, two with split-K. Capturable."""
    check(x.ndim == 2, "x", f"must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    check(1 <= m <= MAX_M, "x", f"must have 1..{MAX_M} rows, got {m}")
    _check_operands(x, w)
    n = w.shape[0]
    cfg = config or default_config(x.device, n, k)
    split, k_chunk = launch_splits(k, cfg.block_k, cfg.split_k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _small_m_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, w, out, m, n, k, k_chunk, x.stride(0), w.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_F32=x.device.type != "cuda" and x.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        _reduce_splits_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            out, y, m * n, split, BLOCK=REDUCE_BLOCK, num_warps=4)
    return y


def gemv_row(x: torch.Tensor, w: torch.Tensor, config: GemvRowConfig | None = None) -> torch.Tensor:
    """Same as :func:`small_m_matmul_ref` up to the order of the fp32 sums, for one row: x [1, K],
    w [N, K] -> [1, N] in x's dtype; one launch (no split-K workspace), deterministic. Capturable."""
    check(x.ndim == 2 and x.shape[0] == 1, "x", f"must be [1, K], got shape {tuple(x.shape)}")
    _check_operands(x, w)
    n, k = w.shape
    cfg = config or row_default_config(x.device, n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_row_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, y, n, k, w.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


# ---------------------------------------------------------------------------------------------
# Linear layer


def small_m_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernels here take x [..., K] and w: Triton runs on the device (CUDA, or CPU under
    its interpreter), bf16/fp16 x and w of one dtype, 1 <= M <= 16 rows, w's last dim contiguous
    (``small_m_linear`` runs ``gemv_row`` where this holds and M is 1)."""
    m = x.numel() // max(x.shape[-1], 1)
    return (
        triton_runs(x.device)
        and x.dtype in DTYPES
        and w.dtype == x.dtype
        and w.ndim == 2
        and w.stride(-1) == 1
        and 1 <= m <= MAX_M
    )


@contextlib.contextmanager
def blas_library(name: str | None) -> Iterator[None]:
    """torch's preferred BLAS library (``torch.backends.cuda.preferred_blas_library``) set to
    ``name`` inside, restored after (None: left as it is). A CUDA graph captured inside keeps the
    kernels the library chose."""
    if name is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


LT_ROWS = range(17, 65)  # rows at which ``rows_linear`` runs F.linear under cuBLASLt


def rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``small_m_linear``, with 17..64 rows (``LT_ROWS``) on CUDA through cuBLASLt instead of
    torch's default cuBLAS: on the H200 at M = 32 qwen3-8b's wo reads in 11.7 vs 13.9 us and w2 in
    27.8 vs 30.1 us, M = 64 w2 28.6 vs 32.6 us, the other weights within 0.5 % (the gemm_check
    sweep, docs/BENCHMARKS.md section 8); at 16 rows and below cuBLAS is as fast or faster."""
    if x.is_cuda and x.numel() // max(x.shape[-1], 1) in LT_ROWS:
        with blas_library("cublaslt"):
            return F.linear(x, w)
    return small_m_linear(x, w)


def small_m_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` (no bias) for x [..., K], w [N, K]: the one-row kernel (``gemv_row``) at
    one row where ``small_m_ok``, else F.linear itself. On the H200 the one-row kernel reads
    qwen3-8b's weights 1.03-1.25x faster than cuBLAS; the small-M kernel at 2..16 rows is 1.4-1.6x
    slower than cuBLAS, so it stays out of this path (benchmarks/gemm_check.py, docs/BENCHMARKS.md
    section 8)."""
    if x.numel() != x.shape[-1] or not small_m_ok(x, w):
        return F.linear(x, w)
    k = x.shape[-1]
    x2 = x.reshape(1, k)
    y = gemv_row(x2 if x2.stride(-1) == 1 else x2.contiguous(), w)
    return y.view(*x.shape[:-1], w.shape[0])
