"""Paged KV cache attention backend for the reference models: Triton cache write + Triton
verification attention (``spectune.kernels``).

``backend(layer, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D], meta) -> [T,H,D]`` writes the new K/V rows
into layer ``layer``'s cache at ``meta.slot_mapping`` (derived from the block tables when absent)
and attends over each request's blocks. ``meta.block_tables`` falls back to the tables of the last
``allocate`` (drafters build their own per-step meta without tables). Every step is device work
with static shapes, so the model forward can be captured in a CUDA graph. A fused decoder layer
that writes the cache in its own kernel calls ``write_target`` then ``attend`` instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from spectune.kernels.attention import AttnConfig, verify_attention
from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.kv_cache import (
    KernelInputError,
    allocate_kv_cache,
    blocks_needed,
    check,
    make_block_tables,
    slot_mapping_for,
    write_kv,
)


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
        self.block_tables: Tensor | None = None  # [B, max_blocks] int32 of the last allocate()
        self.shape_key: tuple[int, int, int] | None = None  # (batch, context_len, max_q) allocated
        self.released = False
        self._slots: Tensor | None = None  # [T] int64, derived at layer 0 when meta has none

    def nbytes(self) -> int:
        return self.n_layers * self.cache.nbytes_per_layer()

    def release(self) -> None:
        """Free the cache memory now (a newer point replaced this cache); later calls fail."""
        empty = tuple(t.new_empty(0) for t in self.cache.k)
        self.cache = dataclasses.replace(self.cache, k=empty, v=empty)
        self.block_tables, self._slots, self.released = None, None, True

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
        self.block_tables, self.shape_key = tables, (batch, context_len, max_q)
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

    def write_target(self, layer: int, meta: AttnMeta, num_tokens: int) -> tuple[AttnMeta, Tensor, Tensor, Tensor]:
        """Where this step's K/V rows go: (meta with block tables, k_cache, v_cache, slots [T]).
        A kernel that writes the cache itself (``kernels.fused.qk_norm_rope_write``) takes these,
        then :meth:`attend`; ``__call__`` is the same with ``write_kv`` between them."""
        if self.released:
            raise RuntimeError("attention cache was released: a newer step replaced it")
        tables = meta.block_tables
        if tables is None:
            if self.block_tables is None:
                raise KernelInputError("meta.block_tables", "required by the paged backend (none allocated)")
            batch = meta.cu_seqlens_q.shape[0] - 1
            if batch > self.block_tables.shape[0]:
                raise KernelInputError("meta", f"{batch} requests, tables allocated for {self.block_tables.shape[0]}")
            tables = self.block_tables[:batch]  # the first requests' tables (a smaller step)
            meta = dataclasses.replace(meta, block_tables=tables)
        slots = meta.slot_mapping
        if slots is None:
            if layer == 0 or self._slots is None or self._slots.shape[0] != num_tokens:
                self._slots = slot_mapping_for(tables, meta.context_lens,
                                               meta.cu_seqlens_q, num_tokens, self.block_size)
            slots = self._slots
        k_cache, v_cache = self.kv(layer)
        return meta, k_cache, v_cache, slots

    def attend(self, layer: int, q: Tensor, meta: AttnMeta) -> Tensor:
        """q [T, H, D] over layer ``layer``'s cache, which already holds this step's K/V rows
        (``meta`` as :meth:`write_target` returned it)."""
        k_cache, v_cache = self.kv(layer)
        out = verify_attention(q.to(self.dtype), k_cache, v_cache, meta, num_splits=self.num_splits,
                               config=self.config, sm_scale=self.scale, causal=self.causal)
        return out.to(q.dtype)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta) -> Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]
        meta, k_cache, v_cache, slots = self.write_target(layer, meta, q.shape[0])
        write_kv(k, v, k_cache, v_cache, slots)
        return self.attend(layer, q, meta)
