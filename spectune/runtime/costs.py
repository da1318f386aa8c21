"""Cost model evaluation: predicted step times (ms) and power from fitted parameters.

The parameter dataclasses live in :mod:`spectune.runtime.table` (they are part of the YAML);
this module evaluates them (pure arithmetic, cheap enough for the runtime planner); fitting lives in
:mod:`spectune.autotune.fit`.

Words: b = real requests in the step, n = step tokens (padded to the captured tier when the
runtime pads), c = context length, K = draft length.
"""

from __future__ import annotations

from dataclasses import dataclass

from spectune.runtime.table import (
    CostModelParams,
    DrafterCost,
    DrafterKind,
    OverheadCost,
    PowerModel,
    TargetCost,
)


def target_ms(p: TargetCost, tokens: float, batch: float, context: float, *, verify: bool | None = None) -> float:
    # weight-bound floor, then compute-bound past the knee, plus KV read of b x c;
    # verify (default: tokens > batch) adds the extra KV cost of query length > 1
    kv = p.kv_ms_per_mtok + (p.kv_verify_ms_per_mtok if (tokens > batch if verify is None else verify) else 0.0)
    return (
        p.weight_ms
        + p.token_ms * tokens
        + p.compute_ms * max(0.0, tokens - p.knee_tokens)
        + kv * batch * context / 1e6
    )


def drafter_ms(p: DrafterCost, kind: DrafterKind, batch: float, k: int, context: float) -> float:
    if k <= 0:
        return 0.0  # K = 0: the drafter does not run
    steps, per_step = (k, batch) if kind == "autoregressive" else (1, batch * k)
    return p.fixed_ms + steps * (p.step_ms + p.token_ms * per_step + p.kv_ms_per_mtok * batch * context / 1e6)


def overhead_ms(p: OverheadCost, tokens: float) -> float:
    return p.base_ms + p.token_ms * tokens


def power_w(p: PowerModel | None, tokens: float) -> float | None:
    if p is None:
        return None
    frac = min(1.0, tokens / p.saturate_tokens) if p.saturate_tokens > 0 else 1.0
    return p.idle_w + (p.busy_w - p.idle_w) * frac


@dataclass(frozen=True)
class CostModel:
    """Evaluates one GPU's fitted costs for one workload (drafter kind and context fixed)."""

    params: CostModelParams
    drafter_kind: DrafterKind
    context_len: int

    def target_ms(self, tokens: float, batch: float, context: float | None = None) -> float:
        return target_ms(self.params.target, tokens, batch, self.context_len if context is None else context)

    def drafter_ms(self, batch: float, k: int, context: float | None = None) -> float:
        c = self.context_len if context is None else context
        return drafter_ms(self.params.drafter, self.drafter_kind, batch, k, c)

    def overhead_ms(self, tokens: float) -> float:
        return overhead_ms(self.params.overhead, tokens)

    def step_ms(self, batch: int, k: int, tokens: float, context: float | None = None) -> float:
        """One speculative step: drafter(b, K) + target(n) + overhead(n); n includes padding."""
        return self.drafter_ms(batch, k, context) + self.target_ms(tokens, batch, context) + self.overhead_ms(tokens)

    def power_w(self, tokens: float) -> float | None:
        return power_w(self.params.power, tokens)
