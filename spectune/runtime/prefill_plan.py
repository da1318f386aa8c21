"""How prompts are cut into prefill forwards, and what those forwards cost by a profile.

The engine's separate prefill (``spectune.engine.prefill``) and its mixed prefill
(``spectune.engine.mixed``) cut prompts with ``schedule`` / ``next_forward``; a forward of n tokens
replays the graph of the smallest bucket >= n (``default_buckets``). ``prefill_ms`` prices an
admission of n prompts the same way at a cost model's target step time, for the simulator's end
to end (``spectune.autotune.simulator.simulate(prefill=...)``). Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spectune.runtime.costs import CostModel

PREFILL_CHUNK = 512  # tokens of one request in one forward (the engine's default)
PREFILL_TOKENS = 4096  # tokens of one forward (the engine's default)


@dataclass(frozen=True)
class Piece:
    index: int  # request's index in the admission (its row is row0 + index)
    start: int  # first prompt position of the piece (tokens already cached)
    length: int
    last: bool  # the piece ends the prompt


def next_forward(prompt_lens: Sequence[int], done: Sequence[int], chunk: int, max_tokens: int) -> list[Piece]:
    """The pieces of one forward: requests in order, each its next <= ``chunk`` tokens after the
    ``done`` already cached, <= ``max_tokens`` in all."""
    room, pieces = max_tokens, []
    for i, (n, d) in enumerate(zip(prompt_lens, done, strict=True)):
        if d >= n or room == 0:
            continue
        take = min(chunk, n - d, room)
        pieces.append(Piece(i, d, take, d + take == n))
        room -= take
    return pieces


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
