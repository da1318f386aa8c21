"""Suffix drafter (SuffixDecoding-style): drafts from counted continuations of repeated text.

Structure: a depth-limited suffix trie. Every substring of length <= ``depth`` of the sequences
added to it is a path from the root; a node's ``count`` is how often its substring occurs. Two
tries serve one request:

- the *request* trie over the request's own context (prompt + output so far), grown as tokens
  are emitted and rebuilt when the request starts;
- the *shared* trie over the outputs of earlier requests (``remember``), kept across requests.

Drafting at context x (length n), in each trie and for every match length m = 1..max_match whose
suffix x[n-m:] is a path with a continuation:

    follow the most frequent child k times (or until the path ends):  t_1 .. t_k
    conf_j = count(child_j) / (sum of counts of node_{j-1}'s children + PRIOR)

``conf_j`` is the drafter's probability that t_j continues the text given t_1..t_{j-1} (a
conditional, as trace ``conf`` is): the continuation frequency, shrunk by PRIOR unseen
continuations so that a continuation seen once scores 1 / (1 + PRIOR), not 1. Among the
candidates the one with the largest expected accepted length ``sum_j prod_{i<=j} conf_i`` wins
(ties: the longer match, then the request trie).

Per-request draft length from the probabilities (``draft_length``): keep the longest prefix whose
survival ``prod_{i<=j} conf_i`` stays >= ``min_survival``; 0 keeps every drafted token (the
recording setting, so that a replay can cut the drafts at any K).

Pure Python: no torch, no numpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from spectune.errors import SpectuneError
from spectune.models.specdecode import Draft

DEPTH = 24  # longest substring counted
MAX_MATCH = 16  # longest context suffix matched (DEPTH - MAX_MATCH tokens can follow it)
PRIOR = 1.0  # unseen-continuation mass in conf_j's denominator


class SuffixDrafterError(SpectuneError):
    """Bad suffix drafter settings; the message names the field."""


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None

    def child(self, token: int) -> _Node:
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = _Node()
        return node


class SuffixTrie:
    """Counts of every substring of length <= ``depth`` of the sequences added to it."""

    def __init__(self, depth: int = DEPTH):
        if depth < 1:
            raise SuffixDrafterError(f"depth: must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: Iterable[int]) -> None:
        """Add one whole sequence (its substrings do not join those of other sequences)."""
        grower = TrieGrower(self)
        grower.extend(tokens)

    def find(self, path: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for t in path:
            if node is None or node.children is None:
                return None
            node = node.children.get(t)
        return node

    def count(self, path: Sequence[int]) -> int:
        """Occurrences of ``path`` as a substring (0 when absent or longer than ``depth``)."""
        node = self.find(path)
        return 0 if node is None else node.count


class TrieGrower:
    """Appends tokens to one sequence of a trie: after each token the substrings ending there."""

    def __init__(self, trie: SuffixTrie):
        self.trie = trie
        self.active: list[_Node] = []  # nodes of the current suffixes of length 1..depth-1

    def extend(self, tokens: Iterable[int]) -> None:
        depth = self.trie.depth
        for t in tokens:
            grown = [self.trie.root.child(int(t))]
            grown += [node.child(int(t)) for node in self.active]
            for node in grown:
                node.count += 1
            self.active = grown[: depth - 1]


@dataclass(frozen=True)
class Candidate:
    match: int  # length of the matched context suffix
    tokens: tuple[int, ...]  # [<= k]
    conf: tuple[float, ...]  # [<= k] conditional probability of each token
    shared: bool  # found in the shared trie (earlier requests' outputs)

    @property
    def score(self) -> float:
        # expected accepted drafts if conf were the true conditional rates: sum_j prod_{i<=j} conf_i
        total, surv = 0.0, 1.0
        for c in self.conf:
            surv *= c
            total += surv
        return total


def follow(node: _Node, k: int, prior: float = PRIOR) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The most frequent path of up to ``k`` tokens below ``node`` and each step's conf."""
    tokens: list[int] = []
    conf: list[float] = []
    while len(tokens) < k and node.children:
        total = sum(c.count for c in node.children.values())
        tok, nxt = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
        tokens.append(tok)
        conf.append(nxt.count / (total + prior))
        node = nxt
    return tuple(tokens), tuple(conf)


def candidates(trie: SuffixTrie, context: Sequence[int], k: int, *, max_match: int, prior: float,
               shared: bool) -> list[Candidate]:
    """One candidate per match length m = 1..max_match whose suffix has a continuation."""
    out = []
    n = len(context)
    node: _Node | None
    for m in range(1, min(max_match, n) + 1):
        node = trie.find(context[n - m:])
        if node is None:
            break  # a longer suffix contains this one: absent too
        if node.children:
            tokens, conf = follow(node, k, prior)
            out.append(Candidate(m, tokens, conf, shared))
    return out


def draft_length(conf: Sequence[float], min_survival: float) -> int:
    """Longest prefix whose survival prod_{i<=j} conf_i stays >= min_survival."""
    surv, n = 1.0, 0
    for c in conf:
        surv *= c
        if surv < min_survival:
            break
        n += 1
    return n


class SuffixDrafter:
    """Drafter protocol of ``specdecode``: a request trie over the context plus a shared trie over
    earlier requests' outputs (``remember``)."""

    def __init__(self, *, depth: int = DEPTH, max_match: int = MAX_MATCH, prior: float = PRIOR,
                 min_survival: float = 0.0, shared: SuffixTrie | None = None):
        if not 1 <= max_match < depth:
            raise SuffixDrafterError(f"max_match: must be in 1..depth-1 ({depth - 1}), got {max_match}")
        if prior <= 0.0:
            raise SuffixDrafterError(f"prior: must be > 0, got {prior}")
        if not 0.0 <= min_survival <= 1.0:
            raise SuffixDrafterError(f"min_survival: must be in [0, 1], got {min_survival}")
        self.max_match = max_match
        self.prior = prior
        self.min_survival = min_survival
        self.shared = shared if shared is not None else SuffixTrie(depth)
        if self.shared.depth != depth:
            raise SuffixDrafterError(f"shared: trie depth {self.shared.depth} differs from depth {depth}")
        self.depth = depth
        self.name = "suffix"
        self._reset()

    def _reset(self) -> None:
        self.request = SuffixTrie(self.depth)
        self._grower = TrieGrower(self.request)
        self._seen: list[int] = []  # context tokens already in the request trie

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self._seen)
        if len(context) < n or list(context[:n]) != self._seen:
            self._reset()
            n = 0
        new = [int(t) for t in context[n:]]
        self._grower.extend(new)
        self._seen += new

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft(tokens=(), conf=())
        self._sync(context)
        found = candidates(self.request, context, k, max_match=self.max_match, prior=self.prior, shared=False)
        found += candidates(self.shared, context, k, max_match=self.max_match, prior=self.prior, shared=True)
        if not found:
            return Draft(tokens=(), conf=())
        best = max(found, key=lambda c: (c.score, c.match, not c.shared))
        n = draft_length(best.conf, self.min_survival) if self.min_survival > 0 else len(best.tokens)
        return Draft(tokens=best.tokens[:n], conf=best.conf[:n])

    def rollback(self, valid: int) -> None:
        if valid <= 0:
            self._reset()
        elif valid < len(self._seen):
            self._sync(self._seen[:valid])

    def remember(self, output: Sequence[int]) -> None:
        """Add a finished request's output to the shared trie (later requests draft from it)."""
        self.shared.add(int(t) for t in output)
