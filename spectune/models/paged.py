"""Paged KV cache attention backend for the reference models: Triton cache write + Triton
verification attention (``spectune.kernels``).

``backend(layer, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D], meta) -> [T,H,D]`` writes the new K/V rows
into layer ``layer``'s cache at ``meta.slot_mapping`` (derived from ``meta.block_tables`` when
absent) and attends over each request's blocks. Every step is device work with static shapes, so
the model forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from spectune.kernels.attention import AttnConfig, verify_attention
from spectune.kernels.kv_cache import (
    KernelInputError,
    allocate_kv_cache,
    blocks_needed,
    check,
    make_block_tables,
    slot_mapping_for,
    write_kv,
)
from spectune.kernels.meta import AttnMeta


class PagedTritonAttention:
    """Per-layer paged caches ``[num_blocks, block_size, Hkv, D]`` and the Triton kernels."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, *, causal: bool = True,
                 scale: float | None = None, num_splits: int | None = None,
                 config: AttnConfig | None = None):
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.cache = allocate_kv_cache(n_layers, num_blocks, block_size, n_kv_heads, head_dim,
                                       dtype, device)
        self.n_layers, self.num_blocks, self.block_size = n_layers, num_blocks, block_size
        self.n_kv_heads, self.head_dim, self.dtype, self.device = n_kv_heads, head_dim, dtype, device
        self.causal = causal
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.num_splits, self.config = num_splits, config
        self._slots: Tensor | None = None  # [T] int64, derived at layer 0 when meta has none

    def nbytes(self) -> int:
        return self.n_layers * self.cache.nbytes_per_layer()

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s K and V caches, [num_blocks, block_size, Hkv, D] each."""
        return self.cache.k[layer], self.cache.v[layer]

    def randomize_(self, generator: torch.Generator | None = None) -> None:
        """Fill every cache with standard normal values (profiling inputs are never zeros)."""
        for t in (*self.cache.k, *self.cache.v):
            t.normal_(generator=generator)

    def allocate(self, batch: int, context_len: int, max_q: int, *, shuffle: bool = True,
                 generator: torch.Generator | None = None) -> Tensor:
        """Block tables [batch, max_blocks] int32 for ``batch`` requests of ``context_len`` cached
        tokens plus room for ``max_q`` new ones; the context is prefilled with random K/V.
        ``shuffle`` scatters blocks over the pool (as a long-running server's cache looks)."""
        check(batch >= 1, "batch", f"must be >= 1, got {batch}")
        check(context_len >= 0, "context_len", f"must be >= 0, got {context_len}")
        check(max_q >= 1, "max_q", f"must be >= 1, got {max_q}")
        per_request = blocks_needed(context_len + max_q, self.block_size)
        if batch * per_request > self.num_blocks:
            raise KernelInputError("num_blocks", f"{self.num_blocks} blocks < {batch * per_request} "
                                   f"needed for batch {batch} x {context_len + max_q} tokens")
        tables = make_block_tables([context_len + max_q] * batch, self.block_size, self.num_blocks,
                                   shuffle=shuffle, generator=generator, device=self.device)
        self.randomize_()
        return tables

    def meta_for(self, block_tables: Tensor, q_lens: Sequence[int], context_lens: Sequence[int],
                 *, num_tokens: int | None = None, max_q: int | None = None) -> AttnMeta:
        """Host-side builder of a step's AttnMeta (offsets, block tables, slots; T = num_tokens,
        rows past sum(q_lens) are padding)."""
        meta = AttnMeta.from_lens(q_lens, context_lens, device=self.device, max_q=max_q)
        total = sum(q_lens) if num_tokens is None else num_tokens
        if total < sum(q_lens):
            raise KernelInputError("num_tokens", f"{total} < {sum(q_lens)} query tokens")
        meta.block_tables = block_tables.to(device=self.device, dtype=torch.int32)
        meta.slot_mapping = slot_mapping_for(meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                                             total, self.block_size)
        return meta

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta) -> Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]
        if meta.block_tables is None:
            raise KernelInputError("meta.block_tables", "required by the paged backend")
        slots = meta.slot_mapping
        if slots is None:
            if layer == 0 or self._slots is None or self._slots.shape[0] != q.shape[0]:
                self._slots = slot_mapping_for(meta.block_tables, meta.context_lens,
                                               meta.cu_seqlens_q, q.shape[0], self.block_size)
            slots = self._slots
        k_cache, v_cache = self.kv(layer)
        write_kv(k, v, k_cache, v_cache, slots)
        out = verify_attention(q.to(self.dtype), k_cache, v_cache, meta, num_splits=self.num_splits,
                               config=self.config, sm_scale=self.scale, causal=self.causal)
        return out.to(q.dtype)
