"""Chunked prefill inside the step: admitted prompts ride in the decode/verify step's target forward.

Without it, an admission costs separate prefill forwards (``prefill.PrefillGraphs``), each a full
read of the target's weights. Speculation staggers completions, so admissions are small and
frequent; with ``Engine(mixed_prefill=True)`` their prompt pieces join the next step instead
(vLLM-style mixed batches, a token budget per step):

  layout   the forward runs on ``tier + P`` tokens, P a bucket of ``default_buckets(chunk,
           budget)``: the step's packed decode/verify tokens (``total`` of them, a device value),
           the pieces back to back right after them, then padding (no KV slot, zero attention)
  meta     query slots of the tier's requests, then the pieces' (<= ``prefill.SPAN`` tokens a
           slot; offsets shifted by ``total``, context = the slot's first position, the row's
           block table, KV slots from the tables); the two groups are also the meta's ``parts``:
           attention runs one launch for each, so the step's 1..K+1-token rows are not tiled for
           a piece's length
  outputs  the tier's logits go to the step's accept phase as before (and to ``MarginTap`` on a
           decode step); where a piece ends its prompt, its last token's argmax (the request's
           first output) and ``top2_margin`` land at the request's engine row
  host     each step takes, per request still filling (admission order), its next piece of
           <= ``chunk`` tokens, <= ``budget`` in all, <= ``max_pieces`` pieces
           (``prefill.next_forward``; the pieces' attention launch has a program per piece slot,
           used or not: ``runtime.prefill_plan.RIDE_PIECES``): a budget that binds leaves later
           prompts for later steps. A row whose prompt ended joins the batch
           at the next step, as after a separate prefill (admitted ahead, ``Engine(admit_ahead=N)``:
           it waits ready until a slot frees). With no live row the step runs the smallest tier
           with no request (the region alone).

Rows of requests still filling sit after the live rows and the ready ones (row = live rows +
ready rows + index in ``Filling``), so the step's ``num_reqs`` leaves them out. On CUDA one graph
per (tier, verify, P), captured when first needed (``GraphPool.prepare_ride``, counted in
``RunResult.captures``); eager elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spectune.engine.prefill import Piece, PrefillRegion, next_forward
from spectune.engine.run_log import MarginTap
from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.kv_cache import PAD_SLOT, slot_mapping_for
from spectune.kernels.pack import PAD_POSITION, PAD_TOKEN_ID
from spectune.models.logit_rows import logits_at
from spectune.runtime.prefill_plan import RIDE_PIECES


class MixedPrefill:
    """The rider of the step's forward (``runtime.step.Rider``): a ``PrefillRegion`` whose tokens
    follow the tier's; ``first`` / ``margins`` are indexed by engine row."""

    def __init__(self, tap: MarginTap, block_tables: Tensor, *, max_rows: int, chunk: int, budget: int,
                 block_size: int, device: torch.device, max_pieces: int = RIDE_PIECES):
        self.tap, self.block_size = tap, block_size
        self.chunk, self.budget, self.max_pieces = chunk, budget, max_pieces
        self.region = PrefillRegion(block_tables, max_rows=max_rows, chunk=chunk, max_tokens=budget,
                                    device=device, max_pieces=max_pieces)
        self.buckets = self.region.buckets

    def clear(self) -> None:
        self.region.clear()

    def __call__(self, ride: int, input_ids: Tensor, positions: Tensor, meta: AttnMeta) -> Tensor:
        r, tier = self.region, input_ids.shape[0]
        pm = r.meta(ride)
        assert meta.block_tables is not None and meta.slot_mapping is not None and pm.block_tables is not None
        total = meta.cu_seqlens_q[-1:]  # [1] int32: the step's packed tokens (rows after it are padding)
        t = torch.arange(tier + ride, device=input_ids.device)  # [T + P] row of the forward
        j = t - total  # row in the region, for rows at or after the packed tokens
        decode, piece = t < total, (j >= 0) & (j < pm.cu_seqlens_q[-1:])
        tc, jc = t.clamp(max=tier - 1), j.clamp(0, ride - 1)

        def merge(tier_rows: Tensor, region_rows: Tensor, pad: int) -> Tensor:  # [T + P]
            return torch.where(decode, tier_rows[tc], torch.where(piece, region_rows[jc], pad))

        slots = slot_mapping_for(pm.block_tables, pm.context_lens, pm.cu_seqlens_q, ride, self.block_size)
        pieces = AttnMeta(cu_seqlens_q=pm.cu_seqlens_q + total, context_lens=pm.context_lens, max_q=pm.max_q,
                          block_tables=pm.block_tables)
        both = AttnMeta(cu_seqlens_q=torch.cat((meta.cu_seqlens_q, pieces.cu_seqlens_q[1:])),
                        context_lens=torch.cat((meta.context_lens, pm.context_lens)),
                        max_q=max(meta.max_q, pm.max_q),
                        block_tables=torch.cat((meta.block_tables, pm.block_tables)),
                        slot_mapping=merge(meta.slot_mapping, slots, PAD_SLOT),
                        # two attention launches: the step's rows tiled for their 1..K+1 tokens,
                        # the pieces for theirs (one launch tiles every row for the longest piece)
                        parts=(dataclasses.replace(meta, slot_mapping=None), pieces))
        # logits of the tier's rows (the step's; those after ``total`` are not read as its) and of
        # each piece slot's last token, not of every prompt token
        rows = torch.cat((torch.arange(tier, device=input_ids.device), r.last_rows_at(ride, offset=total)))
        logits = logits_at(self.tap.target, merge(input_ids, r.ids[:ride], PAD_TOKEN_ID),
                           merge(positions, r.pos[:ride], PAD_POSITION), both, rows)  # [T + slots, V]
        r.take(ride, logits[tier:])
        head = logits[:tier]
        if meta.max_q == 1:  # a decode step: its margins, as MarginTap writes them
            self.tap.record(head)
        return head

    # -- host side --------------------------------------------------------------------------------

    def plan(self, filling: Filling, prompts: Sequence[Sequence[int]]) -> tuple[list[Piece], int]:
        """This step's pieces of the ``filling`` requests (``prompts`` in the same order) and their
        bucket P (0: no piece)."""
        pieces = next_forward([len(p) for p in prompts], filling.done, self.chunk, self.budget, self.max_pieces)
        return pieces, self.region.bucket(sum(p.length for p in pieces)) if pieces else 0

    def load(self, pieces: Sequence[Piece], prompts: Sequence[Sequence[int]], row0: int, ride: int) -> None:
        """The pieces of the requests in rows row0.. into the region (host -> device, no wait)."""
        self.region.load(ride, [(prompts[p.index][p.start : p.start + p.length], p.start, row0 + p.index,
                                 row0 + p.index if p.last else None) for p in pieces])


def ride_shapes(tiers: Sequence[int], ks: Sequence[int], concurrency: int,
                buckets: Sequence[int], draft_shapes: Mapping[int, int] | None = None) -> list[tuple[int, bool, int]]:
    """(tier, verify, P) of the riding steps a run at ``concurrency`` with these K values is
    likely to use: every tier up to the one a full batch drafting max(ks) each needs, or a batch
    of ``draft_shapes`` (K -> the largest batch it may draft at, ``Planner.draft_shapes``: an
    adaptive policy's deeper K at smaller batches) drafting its K, whichever is larger; and the
    smallest tier's decode step (no live row)."""
    need = concurrency * (1 + max(ks, default=0))
    for k, b in (draft_shapes or {}).items():
        need = max(need, min(b, concurrency) * (1 + k))
    top = next((t for t in tiers if t >= need), tiers[-1])
    verify = sorted({k > 0 for k in ks})
    shapes = {(t, v, p) for t in tiers if t <= top for v in verify for p in buckets}
    shapes.update((tiers[0], False, p) for p in buckets)
    return sorted(shapes, reverse=True)  # largest first


@dataclass
class Filling:
    """Admitted requests whose prompts are still being cached, in admission order."""

    rids: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)  # prompt tokens cached so far
    marks: list[int] = field(default_factory=list)  # admission time mark (TTFT starts there)

    def __len__(self) -> int:
        return len(self.rids)

    def add(self, rid: int, mark: int) -> None:
        self.rids.append(rid)
        self.done.append(0)
        self.marks.append(mark)

    def advance(self, pieces: Sequence[Piece]) -> tuple[list[tuple[int, int, int]], list[int]]:
        """Count the step's pieces. Returns (index, request, admission mark) of each request whose
        prompt ended (they leave, in order) and the indices that stay (the rest, in order)."""
        for p in pieces:
            self.done[p.index] += p.length
        ended = [(p.index, self.rids[p.index], self.marks[p.index]) for p in pieces if p.last]
        gone = {j for j, _, _ in ended}
        stay = [j for j in range(len(self.rids)) if j not in gone]
        self.rids = [self.rids[j] for j in stay]
        self.done = [self.done[j] for j in stay]
        self.marks = [self.marks[j] for j in stay]
        return ended, stay
