"""Decisive logits: random-weight targets whose greedy choice survives reduction-order noise.

A random-weight target's top two logits are often within bf16 rounding of each other, so a plain
decode step (1 token per request) and a verification step (1 + K tokens per request, another
tier, other GEMM kernels) can pick different argmax tokens for the same context. Real model pairs
have the same property at real near ties (batch variance); with random weights it happens on
almost every request, after which a replayed draft no longer matches the target's context.

``DecisiveLogits`` wraps the target forward and adds, to each row's logits, a bonus of twice the
row's largest |logit| on one token chosen by a fixed hash of (input token, position). The full
forward still runs (every weight read, every FLOP, the real attention over the paged KV cache);
only the greedy decision is made robust: the hashed token wins by more than any rounding
difference. Greedy output then depends on the context through the token and its position, so
speculative output must still match plain decoding token for token (packing, positions, the
acceptance rule and the emitted-token bookkeeping are all checked); what it no longer checks is
that attention read the right KV, which the float32 gate (no bias) covers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.logit_rows import logits_at

# odd multipliers of a multiplicative hash; any fixed values do
_MUL_TOKEN = 0x9E3779B1
_MUL_POS = 0x85EBCA77


def decisive_token(input_ids: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """[T] int64: the token each row's bonus goes to, a fixed function of (token, position)."""
    h = input_ids.to(torch.int64) * _MUL_TOKEN + positions.to(torch.int64) * _MUL_POS
    return torch.remainder(h ^ (h >> 15), vocab)


class DecisiveLogits:
    """Callable like the target: ``(input_ids [T], positions [T], meta) -> logits [T, V]``."""

    def __init__(self, target: Callable[[Tensor, Tensor, AttnMeta], Tensor]):
        self.target = target

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttnMeta,
                 logit_rows: Tensor | None = None) -> Tensor:
        if logit_rows is None:
            logits = self.target(input_ids, positions, meta)  # [T, V]
        else:  # [R, V]: the rows' tokens and positions pick their bonus
            logits = logits_at(self.target, input_ids, positions, meta, logit_rows)
            input_ids, positions = input_ids.index_select(0, logit_rows), positions.index_select(0, logit_rows)
        bonus = 2.0 * logits.abs().amax(dim=1, keepdim=True) + 1.0  # [T, 1]
        idx = decisive_token(input_ids, positions, logits.shape[1]).unsqueeze(1)  # [T, 1]
        return logits.scatter_add(1, idx, bonus.to(logits.dtype))

    def __getattr__(self, name: str):  # backend, args, ... of the wrapped model
        return getattr(self.target, name)
