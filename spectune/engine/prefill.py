"""Prompt prefill over the paged KV cache, as CUDA graphs captured per token-count bucket.

An admission hands over the prompts of ``m`` new rows. ``schedule`` cuts them into forwards of at
most ``max_tokens`` tokens; a request adds one piece of at most ``chunk`` tokens to a forward
(later pieces go to later forwards, so each forward sees a request's earlier pieces cached). A
forward of ``n`` tokens replays the graph of the smallest bucket ``T >= n``: the pieces are packed
back to back, the ``T - n`` padding tokens write no KV slot (``slot_mapping`` marks them) and the
unused attention slots have no query tokens. Attention sees each piece as consecutive slots of at
most ``SPAN`` tokens (slot j of a piece starting at position s: queries s + SPAN j .., context
s + SPAN j; causal attention over them is the piece's, key for key): the attention launch has a
program per slot, kv head and query tile, so a bucket's launch is sized by its tokens (<=
ceil(T / SPAN) + pieces slots of one query tile each) instead of pieces x ``chunk``, and no slot
reads keys past its own last query. Where a piece ends its prompt, the argmax of its last
token (the request's first output) and its ``top2_margin`` are written at the row's index in
``first`` / ``margins``; other pieces write a trash row.

Why graphs: an eager forward of the reference decoder costs tens of milliseconds of launches,
paid once per admission. Continuous batching admits a few requests at a time whenever earlier
ones finish; speculative arms finish requests at staggered steps, so they pay it far more often
than plain decoding, whose requests of one length finish together.

Without CUDA the same bodies run eagerly (tests on CPU go through the same packing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from spectune.engine.run_log import top2_margin
from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.logit_rows import logits_at
from spectune.runtime.prefill_plan import Piece, bucket_for, default_buckets, next_forward, schedule

__all__ = ["Piece", "PrefillGraphs", "PrefillRegion", "default_buckets", "next_forward", "schedule"]

# target forward: (input_ids [T] int64, positions [T] int64, meta) -> logits [T, V]
TargetFn = Callable[[Tensor, Tensor, AttnMeta], Tensor]


# prompt tokens of one attention slot: 32 tokens x G = 4 query heads per kv head (qwen3-8b,
# llama-3.1-8b) is one 128-row query tile of the attention kernel
SPAN = 32


class PrefillRegion:
    """Static device buffers of one forward's prompt pieces, for ``buckets`` of token counts.

    Per attention slot (<= ``span`` tokens of one piece): its query offsets ``cu``, cached length
    ``ctx``, engine row ``rows`` (its block table), the packed index of its last token and
    ``dest``: the index of ``first`` / ``margins`` where the last slot of a piece that ends its
    prompt writes its last token's argmax and ``top2_margin`` (others write the trash index).
    A forward holds at most ``max_pieces`` pieces. Device work in ``meta`` and ``take`` only: a
    graph body may call them."""

    def __init__(self, block_tables: Tensor, *, max_rows: int, chunk: int, max_tokens: int,
                 device: torch.device, buckets: Sequence[int] | None = None, max_pieces: int | None = None,
                 span: int | None = None):
        self.engine_tables, self.device, self.chunk, self.span = block_tables, device, chunk, span or SPAN
        self.buckets = sorted(set(buckets or default_buckets(chunk, max_tokens)))
        self.max_pieces = min(max_rows, max_tokens, max_pieces or max_tokens)  # pieces of one forward
        self.max_slots = self.slots(self.buckets[-1])
        self.trash = max_rows  # index of ``first`` that pieces not ending a prompt write

        def zeros(n: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        top = self.buckets[-1]
        self.ids, self.pos = zeros(top), zeros(top)  # [top] int64
        self.cu = zeros(self.max_slots + 1, torch.int32)
        self.ctx = zeros(self.max_slots, torch.int32)
        self.rows = zeros(self.max_slots)  # engine row of each slot (its block table)
        self.last_rows = zeros(self.max_slots)  # packed index of each slot's last token
        self.dest = torch.full((self.max_slots,), self.trash, dtype=torch.int64, device=device)
        self.first = zeros(max_rows + 1)  # [max_rows + trash] int64
        self.margins = torch.zeros(max_rows + 1, 2, dtype=torch.float32, device=device)

    def slots(self, bucket: int) -> int:
        """Attention slots of a forward of ``bucket`` tokens: its pieces cut at ``span`` tokens
        (sum of ceil(L_i / span) <= ceil(bucket / span) + pieces - 1)."""
        return min(bucket, -(-bucket // self.span) + min(self.max_pieces, bucket) - 1)

    def bucket(self, tokens: int) -> int:
        return bucket_for(self.buckets, tokens)

    def meta(self, bucket: int) -> AttnMeta:
        """The pieces' attention metadata, one entry per attention slot (block tables gathered from
        the engine's; no KV slot mapping: the model derives it)."""
        r = self.slots(bucket)
        return AttnMeta(cu_seqlens_q=self.cu[: r + 1], context_lens=self.ctx[:r],
                        max_q=min(self.chunk, self.span, bucket),
                        block_tables=self.engine_tables.index_select(0, self.rows[:r]))

    def last_rows_at(self, bucket: int, offset: Tensor | None = None) -> Tensor:
        """[slots] the packed row of each slot's last token, shifted by ``offset`` ([1] int64
        device value: the pieces' first row in the forward)."""
        r = self.slots(bucket)
        return self.last_rows[:r] if offset is None else self.last_rows[:r] + offset

    def take(self, bucket: int, last: Tensor) -> None:
        """``last`` [slots, V]: the logits at ``last_rows_at``: the prompt-ending pieces' outputs
        (argmax, ``top2_margin``) to ``dest``."""
        r = self.slots(bucket)
        self.first.index_copy_(0, self.dest[:r], last.argmax(dim=-1))
        self.margins.index_copy_(0, self.dest[:r], top2_margin(last))

    def clear(self) -> None:
        """No slot has tokens: a forward on these buffers writes nothing."""
        self.cu.zero_()
        self.ctx.zero_()
        self.rows.zero_()
        self.last_rows.zero_()
        self.dest.fill_(self.trash)

    def load(self, bucket: int, pieces: Sequence[tuple[Sequence[int], int, int, int | None]]) -> None:
        """Host -> static buffers without waiting: per piece (tokens, start, engine row, dest or
        None); padding tokens and unused slots after them."""
        r, n = self.slots(bucket), sum(len(t) for t, _, _, _ in pieces)
        if len(pieces) > self.max_pieces:
            raise ValueError(f"{len(pieces)} pieces in one forward: at most {self.max_pieces}")
        ids: list[int] = []
        pos: list[int] = []
        cu, ctx, rows, last_rows, dest = [0], [], [], [], []
        for tokens, start, row, d in pieces:
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            for j in range(0, len(tokens), self.span):  # the piece's attention slots
                length = min(self.span, len(tokens) - j)
                cu.append(cu[-1] + length)
                ctx.append(start + j)
                rows.append(row)
                last_rows.append(cu[-1] - 1)
                dest.append(self.trash if d is None or j + length < len(tokens) else d)
        pad_slots = r - len(ctx)
        row0 = pieces[0][2] if pieces else 0
        self._load(self.ids, ids + [0] * (bucket - n))
        self._load(self.pos, pos + [0] * (bucket - n))
        self._load(self.cu, cu + [n] * pad_slots)
        self._load(self.ctx, ctx + [0] * pad_slots)
        self._load(self.rows, rows + [row0] * pad_slots)
        self._load(self.last_rows, last_rows + [0] * pad_slots)
        self._load(self.dest, dest + [self.trash] * pad_slots)

    def _load(self, buf: Tensor, values: list[int]) -> None:
        host = torch.tensor(values, dtype=buf.dtype)
        if self.device.type == "cuda":  # pinned + non_blocking: the host does not wait
            host = host.pin_memory()
        buf[: len(values)].copy_(host, non_blocking=self.device.type == "cuda")


class PrefillGraphs:
    """A ``PrefillRegion`` and one prefill forward per token bucket (captured on CUDA)."""

    def __init__(self, target: TargetFn, block_tables: Tensor, *, max_rows: int, chunk: int,
                 max_tokens: int, device: torch.device, capture: bool,
                 buckets: Sequence[int] | None = None):
        self.target, self.device = target, device
        self.chunk, self.max_tokens, self.capture = chunk, max_tokens, capture
        self.region = PrefillRegion(block_tables, max_rows=max_rows, chunk=chunk, max_tokens=max_tokens,
                                    device=device, buckets=buckets)
        self.buckets = self.region.buckets
        self.graphs: dict[int, Any] = {}
        self.captures = 0
        self.forwards = 0  # prefill forwards run (replays or eager)
        self._pool: Any = None

    def bucket(self, tokens: int) -> int:
        return self.region.bucket(tokens)

    # -- the body of a graph ----------------------------------------------------------------------

    def _body(self, bucket: int) -> None:
        r = self.region
        r.take(bucket, logits_at(self.target, r.ids[:bucket], r.pos[:bucket], r.meta(bucket),
                                 r.last_rows_at(bucket)))  # [slots, V]

    def prepare(self, buckets: Sequence[int] | None = None, warmup: int = 2) -> None:
        """Capture the graphs of ``buckets`` (all by default), largest first, in one memory pool.
        Warm-up forwards run on padding only (no request slot has tokens: nothing is written)."""
        if not self.capture:
            return
        todo = sorted({self.bucket(b) for b in (buckets or self.buckets)} - set(self.graphs), reverse=True)
        if not todo:
            return
        self.region.clear()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in todo:
                for _ in range(warmup):
                    self._body(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for b in todo:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._body(b)
            self.graphs[b] = graph
            self.captures += 1
        torch.cuda.synchronize(self.device)

    # -- host side --------------------------------------------------------------------------------

    def run(self, prompts: Sequence[Sequence[int]], row0: int) -> tuple[Tensor, Tensor]:
        """Prefill the prompts of rows row0.. (their block tables are in the engine's table);
        returns views ``first`` [m] int64 and ``margins`` [m, 2] float32, valid until the next run."""
        m = len(prompts)
        for pieces in schedule([len(p) for p in prompts], self.chunk, self.max_tokens):
            bucket = self.bucket(sum(p.length for p in pieces))
            if self.capture and bucket not in self.graphs:
                self.prepare([bucket])  # before the loads: warm-up clears the buffers
            self.region.load(bucket, [(prompts[p.index][p.start : p.start + p.length], p.start, row0 + p.index,
                                       p.index if p.last else None) for p in pieces])
            graph = self.graphs.get(bucket)
            if graph is not None:
                graph.replay()
            else:
                self._body(bucket)
            self.forwards += 1
        return self.region.first[:m], self.region.margins[:m]
