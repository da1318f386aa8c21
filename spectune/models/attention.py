"""Attention backends over a packed token axis, and the float64-able reference they are tested on.

A backend is any callable ``backend(layer, q [T,H,D], k [T,Hkv,D], v [T,Hkv,D], meta) -> [T,H,D]``
that writes the new K/V into its cache and attends: request ``b``'s query ``j`` sees its cached
context (``context_lens[b]`` tokens) and its own new tokens ``0..j`` (causal) or all of them
(``causal=False``, block drafters). Padding rows past ``cu_seqlens_q[B]`` are inert: zero output,
no write into any request's cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from spectune.kernels.attention_metadata import AttnMeta

AttnMode = Literal["folded", "sdpa_gqa"]
SLOT_ALIGN = 16  # cache slots per request rounded up to this (aligned mask rows for SDPA kernels)


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta) -> Tensor: ...


@dataclass
class _Plan:
    """Index tensors of one step, computed on the device from ``meta`` (graph-capturable)."""

    slot: Tensor  # [T] int64, flat cache slot of each packed row (padding -> trash slot)
    src: Tensor  # [B, max_q] int64, packed row gathered into each padded query position
    back: Tensor  # [T] int64, padded position (b * max_q + j) each packed row reads its output from
    valid: Tensor  # [T] bool, row belongs to a request
    mask: Tensor  # [B, max_q, S] bool, key slot visible to query j of request b


class DenseTorchAttention:
    """Dense per-layer KV cache ``[batch, slots, Hkv, D]`` (``slots >= ctx_max + max_q``) and SDPA.

    mode "folded": the G = H/Hkv query heads that share a KV head are folded into the query axis,
    ``q -> [B, Hkv, G*max_q, D]``, so each request's KV is read once whatever its query length.
    mode "sdpa_gqa": ``q -> [B, H, max_q, D]`` with ``enable_gqa=True`` (the library's GQA path).
    """

    def __init__(self, n_layers: int, batch: int, ctx_max: int, max_q: int, n_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, mode: AttnMode = "folded",
                 causal: bool = True, scale: float | None = None):
        if mode not in ("folded", "sdpa_gqa"):
            raise ValueError(f"mode must be 'folded' or 'sdpa_gqa', got {mode!r}")
        self.n_layers, self.batch, self.ctx_max, self.max_q = n_layers, batch, ctx_max, max_q
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.mode, self.causal = mode, causal
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.slots = -(-(ctx_max + max_q) // SLOT_ALIGN) * SLOT_ALIGN
        flat = batch * self.slots + 1  # the last slot is the padding rows' trash slot
        # k_store / v_store: [n_layers, batch * slots + 1, Hkv, D]
        self.k_store = torch.zeros(n_layers, flat, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_store = torch.zeros_like(self.k_store)
        self._plan: _Plan | None = None
        self.released = False

    @property
    def shape_key(self) -> tuple[int, int, int]:
        return self.batch, self.ctx_max, self.max_q

    def nbytes(self) -> int:
        return 2 * self.k_store.numel() * self.k_store.element_size()

    def cache(self, layer: int) -> tuple[Tensor, Tensor]:
        """Views ``[batch, slots, Hkv, D]`` of layer ``layer``'s K and V caches."""
        n = self.batch * self.slots
        shape = (self.batch, self.slots, self.n_kv_heads, self.head_dim)
        return self.k_store[layer, :n].view(shape), self.v_store[layer, :n].view(shape)

    def release(self) -> None:
        """Free the cache memory now (a newer point replaced this cache); later calls fail."""
        empty = self.k_store.new_empty(0)
        self.k_store, self.v_store, self._plan = empty, empty, None
        self.released = True

    def randomize_(self, generator: torch.Generator | None = None) -> None:
        """Fill the caches with non-zero random values (profiling inputs are never zeros)."""
        self.k_store.normal_(generator=generator)
        self.v_store.normal_(generator=generator)

    def plan(self, meta: AttnMeta, tokens: int) -> _Plan:
        cu = meta.cu_seqlens_q.long()  # [B+1]
        ctx = meta.context_lens.long()  # [B]
        b, mq, device = ctx.shape[0], meta.max_q, ctx.device
        if b > self.batch or mq > self.max_q:
            raise ValueError(f"step has batch {b}, max_q {mq}; cache was built for batch "
                             f"{self.batch}, max_q {self.max_q}")
        t = torch.arange(tokens, device=device)
        req = torch.searchsorted(cu[1:].contiguous(), t, right=True)  # [T], B for padding rows
        valid = req < b
        req = req.clamp(max=b - 1)
        j = t - cu[req]  # query index inside its request
        valid &= j < mq
        j = j.clamp(0, mq - 1)
        pos = (ctx[req] + j).clamp(max=self.slots - 1)
        trash = self.batch * self.slots
        slot = torch.where(valid, req * self.slots + pos, torch.full_like(pos, trash))
        jj = torch.arange(mq, device=device)
        src = (cu[:-1, None] + jj).clamp(max=max(tokens - 1, 0))  # [B, max_q]
        back = req * mq + j
        # key slot p is visible to query j of request b iff p < ctx_b + j + 1 (causal)
        # or p < ctx_b + q_b (whole block visible)
        p = torch.arange(self.slots, device=device)
        if self.causal:
            limit = ctx[:, None] + jj[None, :] + 1  # [B, max_q]
        else:
            limit = (ctx + cu[1:] - cu[:-1]).clamp(min=1)[:, None].expand(b, mq)
        mask = p[None, None, :] < limit[:, :, None]  # [B, max_q, S]
        return _Plan(slot=slot, src=src, back=back, valid=valid, mask=mask)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta) -> Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]
        if self.released:
            raise RuntimeError("attention cache was released: a newer step replaced it")
        if layer == 0 or self._plan is None:
            self._plan = self.plan(meta, q.shape[0])
        plan = self._plan
        self.k_store[layer].index_copy_(0, plan.slot, k.to(self.k_store.dtype))
        self.v_store[layer].index_copy_(0, plan.slot, v.to(self.v_store.dtype))
        b, mq = plan.src.shape
        k_cache, v_cache = self.cache(layer)
        k_cache, v_cache = k_cache[:b].transpose(1, 2), v_cache[:b].transpose(1, 2)  # [B, Hkv, S, D]
        q_pad = q[plan.src]  # [B, max_q, H, D]
        if self.mode == "folded":
            o = self._attend_folded(q_pad, k_cache, v_cache, plan.mask)
        else:
            o = self._attend_gqa(q_pad, k_cache, v_cache, plan.mask)
        out = o.reshape(b * mq, *q.shape[1:])[plan.back]  # [T, H, D]
        return torch.where(plan.valid[:, None, None], out, torch.zeros((), dtype=out.dtype,
                                                                        device=out.device))

    def _attend_folded(self, q_pad: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        b, mq, h, d = q_pad.shape
        hkv = self.n_kv_heads
        g = h // hkv
        # head h = kv * G + g; folded query index = g * max_q + j
        qf = q_pad.view(b, mq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * mq, d)
        m = mask.repeat(1, g, 1).unsqueeze(1)  # [B, 1, G*max_q, S]
        o = F.scaled_dot_product_attention(qf, k, v, attn_mask=m, scale=self.scale)
        return o.view(b, hkv, g, mq, d).permute(0, 3, 1, 2, 4)  # [B, max_q, Hkv, G, D]

    def _attend_gqa(self, q_pad: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        qt = q_pad.transpose(1, 2)  # [B, H, max_q, D]
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask.unsqueeze(1), scale=self.scale,
                                           enable_gqa=True)
        return o.transpose(1, 2)  # [B, max_q, H, D]


def reference_attention(q: Tensor, k: Tensor, v: Tensor, meta: AttnMeta, k_ctx: Tensor,
                        v_ctx: Tensor, *, causal: bool = True, scale: float | None = None) -> Tensor:
    """Per-request loop with an explicit softmax. ``k_ctx``/``v_ctx``: [B, >= max ctx, Hkv, D], the
    cached context of each request. Returns [T, H, D]; padding rows are zero."""
    t_all, h, d = q.shape
    g = h // k.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    cu = [int(x) for x in meta.cu_seqlens_q.tolist()]
    ctx = [int(x) for x in meta.context_lens.tolist()]
    out = torch.zeros_like(q)
    for b in range(len(ctx)):
        lo, hi = cu[b], cu[b + 1]
        n = hi - lo
        if n == 0:
            continue
        keys = torch.cat([k_ctx[b, :ctx[b]], k[lo:hi]]).repeat_interleave(g, dim=1)  # [L, H, D]
        vals = torch.cat([v_ctx[b, :ctx[b]], v[lo:hi]]).repeat_interleave(g, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi], keys) * scale  # [H, n, L]
        qi = torch.arange(n)[:, None]
        kp = torch.arange(ctx[b] + n)[None, :]
        visible = kp <= ctx[b] + qi if causal else torch.ones(n, ctx[b] + n, dtype=torch.bool)
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        scores = scores - scores.amax(-1, keepdim=True)
        weights = scores.exp()
        weights = weights / weights.sum(-1, keepdim=True)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", weights, vals)
    return out
