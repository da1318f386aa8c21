"""Attention metadata of one packed verification step.

The target runs on a packed token axis ``T`` (a captured tier): ``B`` requests with query lengths
``q_i`` (1 real token + granted drafts) laid out back to back, then padding rows that belong to no
request. Every tensor here lives on the device and may be rewritten in place between graph replays;
``max_q`` is a python int fixed per captured graph.

A mixed step (decode/verify rows and prompt pieces in one forward, ``spectune.engine.mixed``) also
carries ``parts``: the same rows as consecutive sub-batches, each with its own static ``max_q``.
The Triton kernel runs one launch per part, so the decode rows are tiled for their 1..K+1 tokens
and not for the longest prompt piece; the concatenated fields above still describe every row (the
cache write and the torch references use them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttnMeta:
    cu_seqlens_q: Tensor  # [B+1] int32, query start offsets into the packed axis
    context_lens: Tensor  # [B] int32, KV tokens already cached per request
    max_q: int  # static max query length of the captured graph
    # paged backends: block_tables [B, max_blocks] int32, slot_mapping [T] int64
    block_tables: Tensor | None = None
    slot_mapping: Tensor | None = None
    # mixed steps: consecutive sub-batches covering the rows above, one kernel launch each
    parts: tuple[AttnMeta, ...] | None = None

    @property
    def batch(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def from_lens(cls, q_lens: Sequence[int], context_lens: Sequence[int], *,
                  device: torch.device | str | None = None, max_q: int | None = None) -> AttnMeta:
        """Host-side builder (not for use inside a captured region): offsets from query lengths."""
        if len(q_lens) != len(context_lens):
            raise ValueError(f"q_lens has {len(q_lens)} entries, context_lens {len(context_lens)}")
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + int(q))
        return cls(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
            max_q=int(max_q if max_q is not None else max(q_lens, default=1)),
        )
