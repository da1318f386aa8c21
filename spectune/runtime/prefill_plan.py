"""How prompts are cut into prefill forwards, and what those forwards cost by a profile.

The engine's separate prefill (``spectune.engine.prefill``) and its mixed prefill
(``spectune.engine.mixed``) cut prompts with ``schedule`` / ``next_forward``; a forward of n tokens
replays the graph of the smallest bucket >= n (``default_buckets``). ``prefill_ms`` prices an
admission of n prompts the same way at a cost model's target step time, for the simulator's end
to end (``spectune.autotune.simulator.simulate(prefill=...)``). ``Riding`` describes mixed
prefill (pieces riding in the decode steps), and ``Riding.carried`` what a step's pieces add to
its forward (``planner.step_ms(..., ride, piece_kv)``; ``simulate(ride=...)``). Pure Python: no
torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spectune.runtime.costs import CostModel

PREFILL_CHUNK = 512  # tokens of one request in one forward (the engine's default)
PREFILL_TOKENS = 4096  # tokens of one forward (the engine's default)
RIDE_BUDGET = 256  # prompt tokens one decode step carries under mixed prefill (the bench's default)
# prompt pieces one decode step carries at most under mixed prefill: the pieces' attention launch
# is sized statically per bucket, a program per slot (``engine.prefill``: <= 32 prompt tokens a
# slot, so ceil(P / 32) + pieces - 1 slots) and kv head, used or not. Before the slots and this cap
# the launch had a slot per engine row, each tiled for the whole chunk: at 64 rows and 256 prompt
# tokens, ~145 000 empty programs a step over 36 layers; the H200 riding runs took 3.2 ms a
# riding step (P = 256) and 3.7-5.0 ms (P = 512) more than the cost model prices their tokens at
# (``benchmarks/predict_e2e.py``). 16 pieces fill a 256-token budget with 16-token prompts
RIDE_PIECES = 16


@dataclass(frozen=True)
class Piece:
    index: int  # request's index in the admission (its row is row0 + index)
    start: int  # first prompt position of the piece (tokens already cached)
    length: int
    last: bool  # the piece ends the prompt


def next_forward(prompt_lens: Sequence[int], done: Sequence[int], chunk: int, max_tokens: int,
                 max_pieces: int | None = None) -> list[Piece]:
    """The pieces of one forward: requests in order, each its next <= ``chunk`` tokens after the
    ``done`` already cached, <= ``max_tokens`` in all, at most ``max_pieces`` pieces (None: no cap)."""
    room, pieces = max_tokens, list[Piece]()
    for i, (n, d) in enumerate(zip(prompt_lens, done, strict=True)):
        if room == 0 or (max_pieces is not None and len(pieces) >= max_pieces):
            break
        if d >= n:
            continue
        take = min(chunk, n - d, room)
        pieces.append(Piece(i, d, take, d + take == n))
        room -= take
    return pieces


def ends_next_forward(prompt_lens: Sequence[int], done: Sequence[int], chunk: int, max_tokens: int,
                      max_pieces: int | None = None) -> bool:
    """Whether the last request's prompt ends in the next forward (``next_forward``), the ones
    before it taking their pieces first: what admitting it ahead needs (it joins the batch as the
    request it replaces leaves, not a step later)."""
    last = len(prompt_lens) - 1
    return any(p.index == last and p.last for p in next_forward(prompt_lens, done, chunk, max_tokens, max_pieces))


def schedule(prompt_lens: Sequence[int], chunk: int, max_tokens: int) -> list[list[Piece]]:
    """Forwards of pieces: every forward holds <= ``max_tokens`` tokens and at most one piece per
    request; a request's pieces come in prompt order in successive forwards."""
    done = [0] * len(prompt_lens)
    forwards: list[list[Piece]] = []
    while any(d < n for d, n in zip(done, prompt_lens, strict=True)):
        pieces = next_forward(prompt_lens, done, chunk, max_tokens)
        for p in pieces:
            done[p.index] += p.length
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


def bucket_for(buckets: Sequence[int], tokens: int) -> int:
    """The smallest bucket holding ``tokens``."""
    for b in buckets:
        if b >= tokens:
            return b
    raise ValueError(f"{tokens} prefill tokens exceed the largest bucket {buckets[-1]}")


def prefill_ms(cost: CostModel, prompt_len: int, chunk: int = PREFILL_CHUNK,
               max_tokens: int = PREFILL_TOKENS) -> Callable[[int], float]:
    """ms of admitting n prompts of ``prompt_len`` tokens at once by separate prefill forwards, as
    the engine schedules them (``schedule``; each forward padded to its bucket of
    ``default_buckets(chunk, max_tokens)``), each at the cost model's target step time for its
    tokens and pieces, with the pieces' KV read at their mean position."""
    buckets = default_buckets(chunk, max_tokens)
    memo: dict[int, float] = {}

    def ms(n: int) -> float:
        if n not in memo:
            total = 0.0
            for pieces in schedule([prompt_len] * n, chunk, max_tokens):
                tokens = bucket_for(buckets, sum(p.length for p in pieces))
                context = sum(p.start + p.length / 2 for p in pieces) / len(pieces)
                total += cost.target_ms(tokens, len(pieces), context)
            memo[n] = total
        return memo[n]

    return ms


@dataclass(frozen=True)
class Riding:
    """Mixed prefill as the engine runs it (``Engine(mixed_prefill=True, prefill_budget=budget,
    ride_limit=limit)``, ``spectune.engine.mixed``): an admission of at most ``ride_limit`` prompt
    tokens, or any admission while prompts are still filling, waits in a queue; each step's
    forward carries the queue's next pieces (``next_forward``: <= ``chunk`` tokens a request, <=
    ``budget`` in all, <= ``max_pieces`` pieces, padded to a bucket of ``default_buckets(chunk,
    budget)``); a request joins the batch at the step after its last piece, whose logits give its
    first token. A larger admission (a burst) takes separate prefill forwards. With ``ahead``
    (``Engine(admit_ahead=N)``) a row that may be done after the next step (its tokens seen plus
    K + 1 for the step in flight and for the next one reach its length) lends its slot to a
    successor before that step, when the successor's whole prompt fits that step's pieces
    (``ends_next_forward``). The prompt rides beside the row's last steps. The successor joins
    as a slot frees, waiting ready (prompt cached, first token known) where the row has not ended
    yet. A prompt that would fill over several steps waits (admitted ahead it would only keep
    later admissions riding: a queue that fills one prompt a step starves the batch)."""

    prompt_len: int
    budget: int = RIDE_BUDGET
    limit: int | None = None  # the ride limit; None: the budget (the engine's default)
    chunk: int = PREFILL_CHUNK
    max_pieces: int = RIDE_PIECES  # pieces one step carries at most
    ahead: bool = False  # admit for the rows that may end by the next step (riding only); ready ones wait
    buckets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in (("prompt_len", self.prompt_len), ("budget", self.budget), ("chunk", self.chunk),
                            ("limit", 1 if self.limit is None else self.limit), ("max_pieces", self.max_pieces)):
            if value < 1:
                raise ValueError(f"Riding.{name} must be >= 1, got {value}")
        object.__setattr__(self, "buckets", tuple(default_buckets(self.chunk, self.budget)))

    @property
    def ride_limit(self) -> int:
        return self.budget if self.limit is None else self.limit

    def rides(self, admitted: int, filling: int) -> bool:
        """Whether ``admitted`` requests admitted at once, with ``filling`` requests still filling,
        ride in the steps (else: separate prefill forwards)."""
        return filling > 0 or admitted * self.prompt_len <= self.ride_limit

    def ends_next(self, done: Sequence[int]) -> bool:
        """Whether the last of the requests filling (``done`` prompt tokens cached each) ends its
        prompt in the next step (``ends_next_forward``)."""
        return ends_next_forward([self.prompt_len] * len(done), done, self.chunk, self.budget, self.max_pieces)

    def pieces(self, done: Sequence[int]) -> list[Piece]:
        """The next step's pieces of the requests filling, ``done`` prompt tokens cached each."""
        return next_forward([self.prompt_len] * len(done), done, self.chunk, self.budget, self.max_pieces)

    def carried(self, pieces: Sequence[Piece]) -> tuple[int, float]:
        """What ``pieces`` add to a step's forward: the tokens of their bucket, and the keys they
        read at their mean positions, summed (as ``prefill_ms``); (0, 0.0) without pieces. The
        step's time is ``planner.step_ms(cost, b, K, tier, *carried)``."""
        if not pieces:
            return 0, 0.0
        return (bucket_for(self.buckets, sum(p.length for p in pieces)),
                float(sum(p.start + p.length / 2 for p in pieces)))
