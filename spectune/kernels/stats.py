"""Acceptance counters kept on the device and read by the host one step late.

All counters live in one int64 buffer so that one non-blocking copy moves them to pinned host
memory. They only ever grow (the acceptance kernels add to them with atomics); the host takes the
difference of two snapshots, so nothing is reset and no step is lost or counted twice.

Per draft position j = 0..K-1 (position j + 1 in the survival words), over live requests:
  accepted_per_pos[j]: drafts at position j that were accepted
  offered_per_pos[j]:  drafts at position j that were tested: granted, and position j - 1 accepted
                       (accepted / offered is the conditional acceptance, what the planner wants)
  granted_per_pos[j]:  requests granted more than j drafts (accepted / granted is unconditional)
and per step: steps (acceptance launches), requests (live requests), emitted (accepted + bonus).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectune.kernels.kv_cache import check

N_TOTALS = 3  # steps, requests, emitted
STEPS, REQUESTS, EMITTED = range(N_TOTALS)


def stats_size(max_k: int) -> int:
    return 3 * max_k + N_TOTALS


@dataclass(frozen=True)
class StatsCounters:
    counters: torch.Tensor  # [3 * max_k + 3] int64: accepted | offered | granted | totals
    max_k: int

    @classmethod
    def zeros(cls, max_k: int, device: torch.device | str) -> StatsCounters:
        check(max_k >= 0, "max_k", f"must be >= 0, got {max_k}")
        return cls(torch.zeros(stats_size(max_k), dtype=torch.int64, device=device), max_k)

    def __post_init__(self) -> None:
        check(self.counters.shape == (stats_size(self.max_k),) and self.counters.dtype == torch.int64,
              "stats.counters", f"must be [{stats_size(self.max_k)}] int64, got "
              f"{list(self.counters.shape)} {self.counters.dtype}")
        check(self.counters.is_contiguous(), "stats.counters", "must be contiguous")

    @property
    def accepted_per_pos(self) -> torch.Tensor:  # [max_k]
        return self.counters[: self.max_k]

    @property
    def offered_per_pos(self) -> torch.Tensor:  # [max_k]
        return self.counters[self.max_k : 2 * self.max_k]

    @property
    def granted_per_pos(self) -> torch.Tensor:  # [max_k]
        return self.counters[2 * self.max_k : 3 * self.max_k]

    @property
    def totals(self) -> torch.Tensor:  # [3]: steps, requests, emitted
        return self.counters[3 * self.max_k :]


@dataclass(frozen=True)
class StatsSnapshot:
    """Host-side counts (plain python ints) over some span of steps."""

    accepted_per_pos: tuple[int, ...]
    offered_per_pos: tuple[int, ...]
    granted_per_pos: tuple[int, ...]
    steps: int
    requests: int
    emitted: int

    @classmethod
    def from_counters(cls, values: list[int], max_k: int) -> StatsSnapshot:
        k = max_k
        return cls(
            accepted_per_pos=tuple(values[:k]),
            offered_per_pos=tuple(values[k : 2 * k]),
            granted_per_pos=tuple(values[2 * k : 3 * k]),
            steps=values[3 * k + STEPS],
            requests=values[3 * k + REQUESTS],
            emitted=values[3 * k + EMITTED],
        )

    def minus(self, earlier: StatsSnapshot) -> StatsSnapshot:
        """Counts of the steps between ``earlier`` and this snapshot."""
        def sub(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(x - y for x, y in zip(a, b, strict=True))

        return StatsSnapshot(
            accepted_per_pos=sub(self.accepted_per_pos, earlier.accepted_per_pos),
            offered_per_pos=sub(self.offered_per_pos, earlier.offered_per_pos),
            granted_per_pos=sub(self.granted_per_pos, earlier.granted_per_pos),
            steps=self.steps - earlier.steps,
            requests=self.requests - earlier.requests,
            emitted=self.emitted - earlier.emitted,
        )


def update_stats_ref(
    stats: StatsCounters,
    accepted: torch.Tensor,  # [B] int32, accepted drafts per request
    grant: torch.Tensor,  # [B] int32, drafts tested per request
    live: torch.Tensor,  # [B] bool, request took part in the step
) -> None:
    """Add one step's counts (torch reference of the kernels' atomics)."""
    device = stats.counters.device
    pos = torch.arange(stats.max_k, device=device)[None, :]
    a = accepted.to(device).long()[:, None]
    g = grant.to(device).long()[:, None]
    on = live.to(device)[:, None]
    stats.accepted_per_pos.add_(((pos < a) & on).sum(0))
    stats.offered_per_pos.add_(((pos < g) & (pos <= a) & on).sum(0))
    stats.granted_per_pos.add_(((pos < g) & on).sum(0))
    stats.totals[STEPS] += 1
    stats.totals[REQUESTS] += int(live.sum())
    stats.totals[EMITTED] += int(((accepted.long() + 1) * live.long()).sum())
