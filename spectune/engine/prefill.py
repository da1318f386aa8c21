"""Prompt prefill over the paged KV cache, as CUDA graphs captured per token-count bucket.

An admission hands over the prompts of ``m`` new rows. ``schedule`` cuts them into forwards of at
most ``max_tokens`` tokens; a request adds one piece of at most ``chunk`` tokens to a forward
(later pieces go to later forwards, so each forward sees a request's earlier pieces cached). A
forward of ``n`` tokens replays the graph of the smallest bucket ``T >= n``: the pieces are packed
back to back, the ``T - n`` padding tokens write no KV slot (``slot_mapping`` marks them) and the
unused request slots have no query tokens. Where a piece ends its prompt, the argmax of its last
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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from spectune.engine.run_log import top2_margin
from spectune.kernels.attention_metadata import AttnMeta

# target forward: (input_ids [T] int64, positions [T] int64, meta) -> logits [T, V]
TargetFn = Callable[[Tensor, Tensor, AttnMeta], Tensor]


@dataclass(frozen=True)
class Piece:
    index: int  # request's index in the admission (its row is row0 + index)
    start: int  # first prompt position of the piece (tokens already cached)
    length: int
    last: bool  # the piece ends the prompt


def schedule(prompt_lens: Sequence[int], chunk: int, max_tokens: int) -> list[list[Piece]]:
    """Forwards of pieces: every forward holds <= ``max_tokens`` tokens and at most one piece per
    request; a request's pieces come in prompt order in successive forwards."""
    done = [0] * len(prompt_lens)
    forwards: list[list[Piece]] = []
    while any(d < n for d, n in zip(done, prompt_lens, strict=True)):
        room, pieces = max_tokens, []
        for i, n in enumerate(prompt_lens):
            if done[i] >= n or room == 0:
                continue
            take = min(chunk, n - done[i], room)
            pieces.append(Piece(i, done[i], take, done[i] + take == n))
            done[i] += take
            room -= take
        forwards.append(pieces)
    return forwards


def default_buckets(chunk: int, max_tokens: int) -> list[int]:
    """Token counts with a graph: powers of two to 256, then multiples of 256 (padding <= 50 %
    below 256 tokens and < 256 tokens above)."""
    out, t = set(), 16
    while t < min(256, max_tokens):
        out.add(t)
        t *= 2
    out.update(range(256, max_tokens + 1, 256))
    out.add(max_tokens)
    return sorted(out)


class PrefillGraphs:
    """Static input buffers and one prefill forward per token bucket (captured on CUDA)."""

    def __init__(self, target: TargetFn, block_tables: Tensor, *, max_rows: int, chunk: int,
                 max_tokens: int, device: torch.device, capture: bool,
                 buckets: Sequence[int] | None = None):
        self.target, self.engine_tables, self.device = target, block_tables, device
        self.chunk, self.max_tokens, self.capture = chunk, max_tokens, capture
        self.buckets = sorted(set(buckets or default_buckets(chunk, max_tokens)))
        self.max_slots = min(max_rows, max_tokens)  # request slots of one forward
        self.trash = max_rows  # row index of ``first`` that pieces not ending a prompt write

        def zeros(n: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        top = self.buckets[-1]
        self.ids, self.pos = zeros(top), zeros(top)
        self.cu = zeros(self.max_slots + 1, torch.int32)
        self.ctx = zeros(self.max_slots, torch.int32)
        self.rows = zeros(self.max_slots)  # engine row of each slot (its block table)
        self.last_rows = zeros(self.max_slots)  # packed index of each slot's last token
        self.dest = torch.full((self.max_slots,), self.trash, dtype=torch.int64, device=device)
        self.first = zeros(max_rows + 1)  # [rows + trash] first output token of each admitted row
        self.margins = torch.zeros(max_rows + 1, 2, dtype=torch.float32, device=device)
        self.graphs: dict[int, Any] = {}
        self.captures = 0
        self._pool: Any = None

    def slots(self, bucket: int) -> int:
        return min(self.max_slots, bucket)

    def bucket(self, tokens: int) -> int:
        for b in self.buckets:
            if b >= tokens:
                return b
        raise ValueError(f"{tokens} prefill tokens exceed the largest bucket {self.buckets[-1]}")

    # -- the body of a graph ----------------------------------------------------------------------

    def _body(self, bucket: int) -> None:
        r = self.slots(bucket)
        meta = AttnMeta(cu_seqlens_q=self.cu[: r + 1], context_lens=self.ctx[:r],
                        max_q=min(self.chunk, bucket),
                        block_tables=self.engine_tables.index_select(0, self.rows[:r]))
        logits = self.target(self.ids[:bucket], self.pos[:bucket], meta)  # [T, V]
        last = logits.index_select(0, self.last_rows[:r])  # [r, V]
        self.first.index_copy_(0, self.dest[:r], last.argmax(dim=-1))
        self.margins.index_copy_(0, self.dest[:r], top2_margin(last))

    def prepare(self, buckets: Sequence[int] | None = None, warmup: int = 2) -> None:
        """Capture the graphs of ``buckets`` (all by default), largest first, in one memory pool.
        Warm-up forwards run on padding only (no request slot has tokens: nothing is written)."""
        if not self.capture:
            return
        todo = sorted({self.bucket(b) for b in (buckets or self.buckets)} - set(self.graphs), reverse=True)
        if not todo:
            return
        self._clear()
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

    def _clear(self) -> None:
        self.cu.zero_()
        self.ctx.zero_()
        self.rows.zero_()
        self.last_rows.zero_()
        self.dest.fill_(self.trash)

    # -- host side --------------------------------------------------------------------------------

    def run(self, prompts: Sequence[Sequence[int]], row0: int) -> tuple[Tensor, Tensor]:
        """Prefill the prompts of rows row0.. (their block tables are in the engine's table);
        returns views ``first`` [m] int64 and ``margins`` [m, 2] float32, valid until the next run."""
        m = len(prompts)
        for pieces in schedule([len(p) for p in prompts], self.chunk, self.max_tokens):
            n = sum(p.length for p in pieces)
            bucket = self.bucket(n)
            if self.capture and bucket not in self.graphs:
                self.prepare([bucket])  # before the loads: warm-up clears the buffers
            r = self.slots(bucket)
            ids: list[int] = []
            pos: list[int] = []
            cu, last_rows = [0], []
            for p in pieces:
                ids.extend(prompts[p.index][p.start : p.start + p.length])
                pos.extend(range(p.start, p.start + p.length))
                cu.append(cu[-1] + p.length)
                last_rows.append(cu[-1] - 1)
            pad_slots = r - len(pieces)
            self._load(self.ids, ids + [0] * (bucket - n))
            self._load(self.pos, pos + [0] * (bucket - n))
            self._load(self.cu, cu + [n] * pad_slots)
            self._load(self.ctx, [p.start for p in pieces] + [0] * pad_slots)
            self._load(self.rows, [row0 + p.index for p in pieces] + [row0] * pad_slots)
            self._load(self.last_rows, last_rows + [0] * pad_slots)
            self._load(self.dest, [p.index if p.last else self.trash for p in pieces] + [self.trash] * pad_slots)
            graph = self.graphs.get(bucket)
            if graph is not None:
                graph.replay()
            else:
                self._body(bucket)
        return self.first[:m], self.margins[:m]

    def _load(self, buf: Tensor, values: list[int]) -> None:
        host = torch.tensor(values, dtype=buf.dtype)
        if self.device.type == "cuda":  # pinned + non_blocking: the host does not wait
            host = host.pin_memory()
        buf[: len(values)].copy_(host, non_blocking=self.device.type == "cuda")
