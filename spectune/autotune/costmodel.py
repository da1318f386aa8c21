"""Cost model for tuning: evaluation re-exported from the runtime (fitting: :mod:`.fit`)."""

from spectune.runtime.costs import CostModel, drafter_ms, overhead_ms, power_w, target_ms

__all__ = ["CostModel", "drafter_ms", "overhead_ms", "power_w", "target_ms"]
