"""Drafters that share the target's hidden size and vocabulary (random weights, real shapes).

Both answer ``propose(hidden [B, dim], last_ids [B], k) -> (draft_ids [B, k], confidences [B, k])``:
greedy argmax drafts, confidence = softmax probability of the argmax. Both are graph-capturable
(static shapes for a given B and k, no host reads of device values).

- ``EagleDrafter`` (EAGLE / MTP style, autoregressive): ``fc([embed(token), feature]) -> N layers``;
  K sequential steps of B tokens, each step's output feature feeds the next step.
- ``BlockDrafter`` (DFlash style, parallel): one forward over B*K tokens, a block per request of
  ``[last token, MASK, ..., MASK]`` conditioned on the target hidden state; position j of the block
  predicts draft j. Attention inside a block is bidirectional when its backend has ``causal=False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.attention import AttentionBackend
from spectune.models.config import DrafterSpec, ModelArgs
from spectune.models.decoder import (
    DecoderLayer,
    Device,
    RMSNorm,
    Rotary,
    _empty,
    init_random_,
    run_layers,
)


def greedy_confidence(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits [N, vocab] -> (ids [N] int64, probability of the argmax [N] float32), no sync."""
    top, ids = logits.max(dim=-1)
    conf = torch.exp(top.float() - torch.logsumexp(logits.float(), dim=-1))
    return ids, conf


class _DrafterBase(nn.Module):
    kind: str = ""

    def __init__(self, args: ModelArgs, n_layers: int, backend: AttentionBackend | None, *,
                 target: nn.Module | None, device: Device, dtype: torch.dtype | None,
                 generator: torch.Generator | None, fused: bool = False):
        super().__init__()
        self.args, self.n_layers, self.backend = args, n_layers, backend
        self.fused = fused  # run_layers with the fused kernels
        self.fc = _empty(args.dim, 2 * args.dim, device=device, dtype=dtype)  # [dim, 2*dim]
        self.layers = nn.ModuleList(DecoderLayer(args, device=device, dtype=dtype)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(args.dim, args.rms_eps, device=device, dtype=dtype)
        self.rotary = Rotary(args.head_dim, args.rope_theta, device=device)
        self._own_embed = target is None
        if target is None:
            self.embed = _empty(args.vocab_size, args.dim, device=device, dtype=dtype)
            self.lm_head = _empty(args.vocab_size, args.dim, device=device, dtype=dtype)
        self._init_extra(device, dtype)
        init_random_(self, n_layers, generator)
        if target is not None:  # shared after init: the target's weights are left as they are
            self._shared = (target.embed, target.head_weight)

    def _init_extra(self, device: Device, dtype: torch.dtype | None) -> None:
        pass

    @property
    def embed_weight(self) -> Tensor:  # [vocab, dim]
        return self.embed if self._own_embed else self._shared[0]  # type: ignore[return-value]

    @property
    def head_weight(self) -> Tensor:  # [vocab, dim]
        return self.lm_head if self._own_embed else self._shared[1]  # type: ignore[return-value]

    def _layers(self, x: Tensor, positions: Tensor, meta: AttnMeta) -> tuple[Tensor, Tensor]:
        """x [T, dim] -> (feature after the last layer, its final norm), each [T, dim]."""
        if self.backend is None:
            raise RuntimeError("drafter has no attention backend; assign drafter.backend first")
        rope = self.rotary(positions, x.dtype)
        return run_layers(cast(Sequence[DecoderLayer], self.layers), x, rope, meta, self.backend,
                          self.norm, self.fused)

    def _context(self, context_lens: Tensor | None, batch: int, device: torch.device) -> Tensor:
        if context_lens is None:
            return torch.zeros(batch, dtype=torch.int32, device=device)
        return context_lens.to(torch.int32)


class EagleDrafter(_DrafterBase):
    kind = "autoregressive"

    def __init__(self, args: ModelArgs, n_layers: int = 1, backend: AttentionBackend | None = None, *,
                 target: nn.Module | None = None, device: Device = None,
                 dtype: torch.dtype | None = None, generator: torch.Generator | None = None,
                 fused: bool = False):
        super().__init__(args, n_layers, backend, target=target, device=device, dtype=dtype,
                         generator=generator, fused=fused)

    @torch.no_grad()
    def propose(self, hidden: Tensor, last_ids: Tensor, k: int, *,
                context_lens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # hidden: [B, dim] target feature of each request's last token; last_ids: [B]
        # context_lens: [B] tokens already in the drafter's own KV cache (default 0)
        b = hidden.shape[0]
        ctx = self._context(context_lens, b, hidden.device)
        cu = torch.arange(b + 1, dtype=torch.int32, device=hidden.device)  # one token per request
        ids, feat = last_ids, hidden
        drafts, confs = [], []
        for i in range(k):
            step_ctx = ctx + i
            meta = AttnMeta(cu_seqlens_q=cu, context_lens=step_ctx, max_q=1)
            x = F.linear(torch.cat([F.embedding(ids, self.embed_weight), feat], dim=-1), self.fc)
            feat, normed = self._layers(x, step_ctx.long(), meta)  # [B, dim] each
            ids, conf = greedy_confidence(F.linear(normed, self.head_weight))
            drafts.append(ids)
            confs.append(conf)
        if k == 0:
            return (torch.empty(b, 0, dtype=torch.long, device=hidden.device),
                    torch.empty(b, 0, dtype=torch.float32, device=hidden.device))
        return torch.stack(drafts, dim=1), torch.stack(confs, dim=1)  # [B, k] each


class BlockDrafter(_DrafterBase):
    kind = "parallel"

    def __init__(self, args: ModelArgs, n_layers: int = 1, backend: AttentionBackend | None = None, *,
                 target: nn.Module | None = None, device: Device = None,
                 dtype: torch.dtype | None = None, generator: torch.Generator | None = None,
                 fused: bool = False):
        super().__init__(args, n_layers, backend, target=target, device=device, dtype=dtype,
                         generator=generator, fused=fused)

    def _init_extra(self, device: Device, dtype: torch.dtype | None) -> None:
        self.mask_embed = _empty(self.args.dim, device=device, dtype=dtype)  # the MASK token

    @torch.no_grad()
    def propose(self, hidden: Tensor, last_ids: Tensor, k: int, *,
                context_lens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # hidden: [B, dim]; last_ids: [B]; one forward over B*k tokens
        b, dim = hidden.shape
        if k == 0:
            return (torch.empty(b, 0, dtype=torch.long, device=hidden.device),
                    torch.empty(b, 0, dtype=torch.float32, device=hidden.device))
        ctx = self._context(context_lens, b, hidden.device)
        tok = F.embedding(last_ids, self.embed_weight)[:, None, :]  # [B, 1, dim]
        block = torch.cat([tok, self.mask_embed.expand(b, k - 1, dim)], dim=1)  # [B, k, dim]
        x = F.linear(torch.cat([block, hidden[:, None, :].expand(b, k, dim)], dim=-1), self.fc)
        offs = torch.arange(k, device=hidden.device)
        positions = (ctx.long()[:, None] + offs).reshape(b * k)  # [B*k]
        cu = torch.arange(b + 1, dtype=torch.int32, device=hidden.device) * k
        meta = AttnMeta(cu_seqlens_q=cu, context_lens=ctx, max_q=k)
        _, normed = self._layers(x.reshape(b * k, dim), positions, meta)  # [B*k, dim]
        ids, conf = greedy_confidence(F.linear(normed, self.head_weight))
        return ids.view(b, k), conf.view(b, k)


def make_drafter(args: ModelArgs, spec: DrafterSpec, backend: AttentionBackend | None = None, *,
                 target: nn.Module | None = None, device: Device = None,
                 dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None, fused: bool = False) -> EagleDrafter | BlockDrafter:
    cls = EagleDrafter if spec.kind == "autoregressive" else BlockDrafter
    return cls(args, spec.n_layers, backend, target=target, device=device, dtype=dtype,
               generator=generator, fused=fused)
