"""What a profile's out-of-memory points rule out: a table never schedules a step that did not fit.

A target or tier point recorded infeasible (``ms: null``: out of memory or out of kernel
resources) at ``b`` requests and ``n`` tokens rules out every step with at least ``b`` requests
and at least ``n`` tokens: a step's memory (the requests' KV cache, the activations) grows with
both. From those points:

- the **batch cap**: plain decoding at batch ``b`` (``b`` tokens) is ruled out from the smallest
  ``b0 = max(b', n')`` over the infeasible points on; the table serves up to the largest batch
  *measured* feasible below ``b0`` (sizes between that and ``b0`` were not shown to fit);
- the **tiers**: a tier ``T`` is dropped when an infeasible point with ``b' <= cap`` and
  ``n' <= T`` exists, so no captured shape can run a ruled-out step at a batch the table serves —
  neither a row nor the online controller's choice among the captured tiers;
- ``fits(b, n)`` for the candidate steps and the fixed-K references of the policy search.

A profile without infeasible points changes nothing. The limits are measured at the profile's
context length; a table tuned for another mean context (``spectune tune --context-len``) takes
them scaled by ``at_context``: a step's KV cache holds about batch x context tokens, so a batch
that ran out of memory at context ``C_p`` runs out at context ``C`` from ``C_p / C`` times that
batch on (rounded up), and a batch that fit, down to ``C_p / C`` times it (rounded down). A
shorter context serves more requests than the profile could measure (qwen3-32b at 2048: out of
memory from batch ~137; at 320 the same memory holds 6.4x the requests); a longer one fewer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spectune.errors import SpectuneError
from spectune.runtime.table import Point


@dataclass(frozen=True)
class Feasibility:
    infeasible: tuple[
        tuple[int, int], ...
    ]  # (batch, tokens) of target / tier points that did not fit
    feasible_batches: tuple[int, ...]  # batches of target points that fit, sorted

    @classmethod
    def of(cls, points: Sequence[Point]) -> Feasibility:
        steps = [p for p in points if p.kind in ("target", "tier")]
        bad = tuple(sorted({(p.batch, p.tokens) for p in steps if p.ms is None}))
        good = tuple(sorted({p.batch for p in steps if p.ms is not None and p.kind == "target"}))
        return cls(bad, good)

    def at_context(self, profile_context: int, context: int | None) -> Feasibility:
        """These limits for traffic of mean context ``context`` (None: the profile's own)."""
        if context is None or context == profile_context or not self.infeasible:
            return self
        if profile_context < 1 or context < 1:
            raise SpectuneError(f"context_len: must be >= 1 to scale the memory limits, got "
                                f"{profile_context} (profile) and {context}")
        r = profile_context / context
        bad = tuple(sorted({(max(1, math.ceil(b * r - 1e-9)), n) for b, n in self.infeasible}))
        good = tuple(sorted({max(1, math.floor(b * r + 1e-9)) for b in self.feasible_batches}))
        return Feasibility(bad, good)

    def fits(self, batch: int, tokens: int) -> bool:
        return not any(b <= batch and n <= tokens for b, n in self.infeasible)

    def batch_cap(self, max_batch: int) -> int:
        """The largest batch size a table may serve (``max_batch`` when nothing was infeasible)."""
        if not self.infeasible:
            return max_batch
        first_out = min(max(b, n) for b, n in self.infeasible)
        below = [b for b in self.feasible_batches if b < first_out]
        if not below:
            raise SpectuneError(
                f"costs.points: plain decoding did not fit at any measured batch size "
                f"(out of memory from batch {first_out}); nothing to tune"
            )
        return min(max_batch, below[-1])

    def tiers(self, universe: Sequence[int], cap: int) -> list[int]:
        """The tiers of ``universe`` no infeasible point at a batch <= ``cap`` rules out."""
        return [t for t in universe if not any(b <= cap and n <= t for b, n in self.infeasible)]
