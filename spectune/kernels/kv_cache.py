"""Paged KV cache: allocation, block tables, slot mapping, and the cache-write kernel.

Layout of one layer's cache (K and V alike):
    cache: [num_blocks, block_size, n_kv_heads, head_dim]
A request's token at position ``pos`` lives in block ``block_table[pos // block_size]`` at offset
``pos % block_size``; its flat **slot** is ``block * block_size + offset``. A slot < 0 marks a
padding row: nothing is written for it.

Everything here that runs per step (``slot_mapping_for``, ``write_kv``) is device-side with static
shapes, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spectune.errors import SpectuneError

PAD_SLOT = -1  # slot_mapping value of a padding row


class KernelInputError(SpectuneError):
    """A kernel wrapper got a tensor of the wrong shape, dtype or device; names the argument."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"{name}: {reason}")


def check(cond: bool, name: str, reason: str) -> None:
    if not cond:
        raise KernelInputError(name, reason)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check(k_cache.ndim == 4, "k_cache", f"must be [num_blocks, block_size, n_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape, "v_cache", f"shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    check(v_cache.dtype == k_cache.dtype, "v_cache", f"dtype {v_cache.dtype} != k_cache {k_cache.dtype}")
    check(v_cache.device == k_cache.device, "v_cache", f"device {v_cache.device} != k_cache {k_cache.device}")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache", "head_dim must be contiguous")


# ---------------------------------------------------------------------------------------------
# Allocation


@dataclass(frozen=True)
class PagedKVCache:
    k: tuple[torch.Tensor, ...]  # n_layers x [num_blocks, block_size, n_kv_heads, head_dim]
    v: tuple[torch.Tensor, ...]  # n_layers x [num_blocks, block_size, n_kv_heads, head_dim]

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    def nbytes_per_layer(self) -> int:
        return 2 * self.k[0].numel() * self.k[0].element_size()


def allocate_kv_cache(
    n_layers: int,
    num_blocks: int,
    block_size: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> PagedKVCache:
    for name, value in (("n_layers", n_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        check(value >= 1, name, f"must be >= 1, got {value}")
    shape = (num_blocks, block_size, n_kv_heads, head_dim)
    k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers))
    v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers))
    return PagedKVCache(k=k, v=v)


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def make_block_tables(
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    *,
    max_blocks: int | None = None,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Host-side block assignment -> block_tables [B, max_blocks] int32.

    Request b gets ``ceil(seq_lens[b] / block_size)`` distinct blocks; unused entries are 0 (never
    read: the kernels stop at each request's length). ``shuffle`` scatters blocks over the pool as a
    long-running server would; otherwise requests get consecutive blocks.
    """
    need = [blocks_needed(n, block_size) for n in seq_lens]
    width = max(need, default=0) if max_blocks is None else max_blocks
    width = max(width, 1)
    check(all(n >= 0 for n in seq_lens), "seq_lens", f"must be >= 0, got {seq_lens}")
    check(max(need, default=0) <= width, "max_blocks", f"{width} < {max(need)} blocks needed")
    check(sum(need) <= num_blocks, "num_blocks", f"{num_blocks} < {sum(need)} blocks needed")
    if shuffle:
        pool = torch.randperm(num_blocks, generator=generator)[: sum(need)]
    else:
        pool = torch.arange(sum(need))
    tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = pool[start : start + n].to(torch.int32)
        start += n
    return tables.to(device)


def slot_mapping_for(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, tokens cached before this step
    cu_seqlens_q: torch.Tensor,  # [B+1] int32, query start offsets
    num_tokens: int,  # T, static packed length (>= cu_seqlens_q[-1])
    block_size: int,
) -> torch.Tensor:
    """Slots [T] int64 of the new tokens (new token j of request b sits at context_lens[b] + j);
    rows >= cu_seqlens_q[-1] get PAD_SLOT. Device ops only, no host sync."""
    device = block_tables.device
    t = torch.arange(num_tokens, device=device, dtype=torch.int64)
    cu = cu_seqlens_q.to(torch.int64)
    b = torch.searchsorted(cu[1:].contiguous(), t, right=True)  # request of each row
    b = b.clamp(max=block_tables.shape[0] - 1)
    pos = context_lens.to(torch.int64)[b] + (t - cu[b])
    col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    block = block_tables.to(torch.int64)[b, col]
    slots = block * block_size + pos % block_size
    return torch.where(t < cu[-1], slots, torch.full_like(slots, PAD_SLOT))


# ---------------------------------------------------------------------------------------------
# Cache write


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = padding
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))


@triton.jit
def _write_kv_kernel(
    # Pointers
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_ptr,  # [T] int64
    # Strides
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    # Dimensions
    n_kv_heads, head_dim,
    block_size,
    # Meta-parameters
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < n_kv_heads) & (d < head_dim)
        kv = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
                 kv.to(k_cache_ptr.dtype.element_ty), mask=mask)
        vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
                 vv.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = padding
) -> None:
    """Write each row's new K/V into its cache slot, skipping slots < 0. Capturable."""
    check_cache(k_cache, v_cache)
    _, _, n_kv_heads, head_dim = k_cache.shape
    check(k.ndim == 3 and k.shape[1:] == (n_kv_heads, head_dim), "k",
          f"must be [T, {n_kv_heads}, {head_dim}], got {tuple(k.shape)}")
    check(v.shape == k.shape, "v", f"shape {tuple(v.shape)} != k {tuple(k.shape)}")
    check(slot_mapping.shape == (k.shape[0],), "slot_mapping", f"must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    check(k.stride(-1) == 1 and v.stride(-1) == 1, "k", "head_dim must be contiguous")
    if k.shape[0] == 0:
        return
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_kv_heads, head_dim,
        k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(n_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
