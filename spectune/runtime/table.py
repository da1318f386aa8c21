"""The spectune table: one versioned YAML file per GPU x model pair.

A *profile* has hardware/software/workload/costs; a *policy table* adds acceptance and policy.
Each section is a frozen dataclass; ``from_dict`` rejects unknown keys and ``validate`` checks
ranges, so every error names its field (``policy.rows[2].batch``). This is the one schema: the
CLI's ``validate``, ``tune``, ``bench``, ``export``, ``report`` and the runtime's ``load`` all read
tables through ``read_table``. What it guarantees of a table that loads:

- every number is finite; costs, times, watts and counts are >= 0, and a target step takes time
  (``weight_ms + token_ms > 0``), so nothing downstream divides by zero;
- every choice is a known one (``workload.dtype``, ``policy.objective``, ``costs.points[].kind``);
- sizes are capped with the reason (MAX_BATCH, MAX_K, MAX_CONTEXT, MAX_POINTS, MAX_TIERS): a
  table never makes a reader allocate per batch size or per token beyond them;
- a row's gain is physically possible: K drafts emit at most K + 1 tokens per step, and a step
  that verifies drafts is never cheaper than plain decoding of the same batch, so
  0 < gain <= K + 1 (K = 0: <= 1);
- a row's tier holds the row's tokens, its budget fits its drafts (``verify_budget <= hi * k``),
  the online controller's K range lies inside ``workload.max_k``, and the acceptance section is a
  well-formed mixture (weights sum to 1, rates in [0, 1]).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, get_args

from spectune.errors import TableError
from spectune.io import atomic_write_text
from spectune.runtime.schema import (
    dump_yaml,
    from_dict,
    read_yaml,
    require,
    to_dict,
)

SCHEMA = "spectune/1"
# conditional acceptance per draft position assumed where no prior is given (planner, step)
DEFAULT_ACCEPTANCE = 0.7

# caps, each with its reason (the error names it)
MAX_BATCH = 4096  # largest batch size a table covers (the planner keeps one entry per batch size)
MAX_K = 64  # largest draft length (deeper drafts are accepted with vanishing probability)
MAX_CONTEXT = 1 << 22  # tokens of KV context per request
MAX_POINTS = 100_000  # measured points in one profile (a GPU profile has ~130)
MAX_TIERS = 4096  # captured token tiers (each one is a CUDA graph)
GAIN_SLACK = 1e-3  # rounding slack on a row's gain bound (gains are written to 4 decimals)

DrafterKind = Literal["autoregressive", "parallel"]
PointKind = Literal["target", "tier", "drafter", "overhead"]
# fp8: the target's projections in e4m3 (per-channel weight, per-token activation scales), its
# activations, attention, KV cache and the drafter in bfloat16
Dtype = Literal["bfloat16", "float16", "float32", "fp8"]
DTYPES: tuple[str, ...] = get_args(Dtype)


@dataclass(frozen=True)
class Hardware:
    gpu: str  # torch.cuda.get_device_name(), or "cpu"
    capability: str | None = None  # "9.0"
    driver: str | None = None
    memory_gib: float | None = None
    power_limit_w: float | None = None
    sm_count: int | None = None

    def validate(self, path: str) -> None:
        require(bool(self.gpu.strip()), f"{path}.gpu", "must not be empty")
        for name in ("memory_gib", "power_limit_w"):
            v = getattr(self, name)
            require(v is None or v >= 0, f"{path}.{name}", f"must be >= 0, got {v}")
        require(self.sm_count is None or self.sm_count >= 1, f"{path}.sm_count", "must be >= 1")


@dataclass(frozen=True)
class Software:
    spectune: str
    torch: str
    triton: str | None = None
    python: str | None = None
    cuda: str | None = None


@dataclass(frozen=True)
class Workload:
    target: str  # preset name or checkpoint folder name
    drafter: str  # e.g. "eagle-1l", "dflash-1l"
    drafter_kind: DrafterKind
    drafter_layers: int
    dtype: Dtype
    context_len: int
    max_k: int
    max_batch: int
    device: Literal["cuda", "cpu"] = "cuda"
    attention: str | None = None  # attention the target was timed with: triton_paged / torch_folded

    def validate(self, path: str) -> None:
        require(bool(self.target.strip()), f"{path}.target", "must not be empty")
        require(bool(self.drafter.strip()), f"{path}.drafter", "must not be empty")
        require(1 <= self.drafter_layers <= 1024, f"{path}.drafter_layers", "must be in 1..1024")
        require(1 <= self.context_len <= MAX_CONTEXT, f"{path}.context_len",
                f"must be in 1..{MAX_CONTEXT} (tokens of KV per request), got {self.context_len}")
        require(0 <= self.max_k <= MAX_K, f"{path}.max_k", f"must be in 0..{MAX_K}, got {self.max_k}")
        require(1 <= self.max_batch <= MAX_BATCH, f"{path}.max_batch",
                f"must be in 1..{MAX_BATCH} (the planner keeps one entry per batch size), got {self.max_batch}")


@dataclass(frozen=True)
class TargetCost:
    """Target verification step, roofline-shaped in total step tokens ``n`` (padded to the tier):

    t(n, b, c) = weight_ms + token_ms * n + compute_ms * max(0, tile(n) - knee_tokens)
                 + (kv_ms_per_mtok + kv_verify_ms_per_mtok * [n > b]) * b * c / 1e6
    (b = real requests, c = context length; padded rows cost linear layers but read no KV).
    kv_verify_ms_per_mtok is the extra KV cost of a verification step (query length > 1) when the
    attention does not read each request's KV once (e.g. GQA heads expanded per query); 0 when it does.
    tile(n) = n rounded up to a multiple of ``tile_tokens``: past the knee the GEMMs are compute
    bound and run whole tiles of rows, so 290 tokens cost what 320 do (1 = no tiling; the fit
    chooses it by cross-validation).
    """

    weight_ms: float
    token_ms: float
    knee_tokens: float
    compute_ms: float
    kv_ms_per_mtok: float
    kv_verify_ms_per_mtok: float = 0.0
    tile_tokens: int = 1

    def validate(self, path: str) -> None:
        for name in ("weight_ms", "token_ms", "knee_tokens", "compute_ms", "kv_ms_per_mtok", "kv_verify_ms_per_mtok"):
            require(getattr(self, name) >= 0, f"{path}.{name}", "must be >= 0")
        require(1 <= self.tile_tokens <= 4096, f"{path}.tile_tokens", f"must be in 1..4096, got {self.tile_tokens}")
        require(self.weight_ms + self.token_ms > 0, f"{path}.weight_ms",
                "a target step takes time: weight_ms + token_ms must be > 0")


@dataclass(frozen=True)
class DrafterCost:
    """Drafter cost for K drafts at batch b, context c.

    autoregressive (EAGLE/MTP): K sequential steps of b tokens each;
    parallel (DFlash-style block): one forward over b*K tokens.
    t(b, K) = 0 if K == 0 else fixed_ms + steps * (step_ms + token_ms * tokens_per_step
                                                   + compute_ms * max(0, tokens_per_step - knee_tokens)
                                                   + kv_ms_per_mtok * b * c / 1e6)
    A parallel drafter's forward over b*K tokens turns compute bound past a knee as the target's
    does (compute_ms > 0); an autoregressive drafter's steps of b tokens stay below it (0).
    """

    fixed_ms: float
    step_ms: float
    token_ms: float
    kv_ms_per_mtok: float = 0.0
    compute_ms: float = 0.0
    knee_tokens: float = 0.0

    def validate(self, path: str) -> None:
        for name in ("fixed_ms", "step_ms", "token_ms", "kv_ms_per_mtok", "compute_ms", "knee_tokens"):
            require(getattr(self, name) >= 0, f"{path}.{name}", "must be >= 0")


@dataclass(frozen=True)
class OverheadCost:
    """Runtime overhead per step (allocation, packing, acceptance, stats): base_ms + token_ms * n.
    ``source`` says what was measured (e.g. "packing-metadata": building the packed metadata only)."""

    base_ms: float
    token_ms: float
    source: str | None = None

    def validate(self, path: str) -> None:
        for name in ("base_ms", "token_ms"):
            require(getattr(self, name) >= 0, f"{path}.{name}", "must be >= 0")


@dataclass(frozen=True)
class PowerModel:
    """Mean board power during a step: idle_w + (busy_w - idle_w) * min(1, n / saturate_tokens)."""

    idle_w: float
    busy_w: float
    saturate_tokens: float

    def validate(self, path: str) -> None:
        require(self.idle_w >= 0, f"{path}.idle_w", "must be >= 0")
        require(self.busy_w >= self.idle_w, f"{path}.busy_w", f"must be >= idle_w ({self.idle_w})")
        require(self.saturate_tokens > 0, f"{path}.saturate_tokens", "must be > 0")


@dataclass(frozen=True)
class CostModelParams:
    target: TargetCost
    drafter: DrafterCost
    overhead: OverheadCost
    power: PowerModel | None = None

    def scaled(self, *, weight: float = 1.0, token: float = 1.0, drafter: float = 1.0,
               overhead: float = 1.0) -> CostModelParams:
        """These costs with their time terms scaled: the target's weight read by ``weight`` and its
        per-token, compute and KV terms by ``token``; every time term of the drafter by
        ``drafter``; the overhead by ``overhead`` (a calibration's fit, or a what-if's GPU that
        runs one part faster or slower). Token counts (knees, tiles) and power stay."""
        t, d, o = self.target, self.drafter, self.overhead
        return replace(
            self,
            target=replace(t, weight_ms=weight * t.weight_ms, token_ms=token * t.token_ms,
                           compute_ms=token * t.compute_ms, kv_ms_per_mtok=token * t.kv_ms_per_mtok,
                           kv_verify_ms_per_mtok=token * t.kv_verify_ms_per_mtok),
            drafter=replace(d, fixed_ms=drafter * d.fixed_ms, step_ms=drafter * d.step_ms,
                            token_ms=drafter * d.token_ms, kv_ms_per_mtok=drafter * d.kv_ms_per_mtok,
                            compute_ms=drafter * d.compute_ms),
            overhead=replace(o, base_ms=overhead * o.base_ms, token_ms=overhead * o.token_ms))


@dataclass(frozen=True)
class CostError:
    held_out: int  # number of held-out points the error was measured on
    median_rel: float
    max_rel: float

    def validate(self, path: str) -> None:
        require(self.held_out >= 0, f"{path}.held_out", "must be >= 0")
        require(self.median_rel >= 0, f"{path}.median_rel", "must be >= 0")
        require(self.max_rel >= self.median_rel, f"{path}.max_rel", f"must be >= median_rel ({self.median_rel})")


@dataclass(frozen=True)
class CapturePoint:
    tokens: int  # tier (token count of the captured verification graph)
    seconds: float
    mib: float

    def validate(self, path: str) -> None:
        require(1 <= self.tokens <= MAX_BATCH * (MAX_K + 1), f"{path}.tokens",
                f"must be in 1..{MAX_BATCH * (MAX_K + 1)} (MAX_BATCH x (MAX_K + 1))")
        require(self.seconds >= 0, f"{path}.seconds", "must be >= 0")
        require(self.mib >= 0, f"{path}.mib", "must be >= 0")


@dataclass(frozen=True)
class Point:
    """One measured point. target: batch x q tokens/request (tokens = batch*q, all real);
    tier: `tokens` padded step tokens of which `batch` are real requests;
    drafter: batch x k drafts; overhead: batch requests, tokens step tokens."""

    kind: PointKind
    batch: int
    tokens: int
    ms: float | None  # None when infeasible (out of memory / resources)
    q: int | None = None
    k: int | None = None
    joules: float | None = None
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    throttle: int | None = None
    held_out: bool = False

    def validate(self, path: str) -> None:
        require(1 <= self.batch <= MAX_BATCH, f"{path}.batch", f"must be in 1..{MAX_BATCH}, got {self.batch}")
        top = MAX_BATCH * (MAX_K + 1)
        require(1 <= self.tokens <= top, f"{path}.tokens", f"must be in 1..{top}, got {self.tokens}")
        require(self.ms is None or self.ms > 0, f"{path}.ms", f"must be > 0 (or null: infeasible), got {self.ms}")
        require(self.q is None or 1 <= self.q <= MAX_K + 1, f"{path}.q", f"must be in 1..{MAX_K + 1}")
        require(self.k is None or 0 <= self.k <= MAX_K, f"{path}.k", f"must be in 0..{MAX_K}")
        for name in ("joules", "power_w", "sm_clock_mhz", "throttle"):
            v = getattr(self, name)
            require(v is None or v >= 0, f"{path}.{name}", f"must be >= 0, got {v}")
        if self.kind == "target" and self.q is not None:
            require(self.tokens == self.batch * self.q, f"{path}.tokens",
                    f"a target point has batch x q = {self.batch * self.q} tokens, got {self.tokens}")
        if self.kind == "tier":
            require(self.tokens >= self.batch, f"{path}.tokens", f"a tier holds its {self.batch} requests")


@dataclass(frozen=True)
class Costs:
    model: CostModelParams
    error: CostError
    timer: Literal["cuda-graph", "wall-clock", "fake"] = "cuda-graph"
    capture: list[CapturePoint] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    measurements: str | None = None  # path of the full CSV/parquet measurement table

    def validate(self, path: str) -> None:
        require(len(self.points) <= MAX_POINTS, f"{path}.points", f"more than {MAX_POINTS} points")
        require(len(self.capture) <= MAX_TIERS, f"{path}.capture", f"more than {MAX_TIERS} tiers")


@dataclass(frozen=True)
class Row:
    batch: tuple[int, int]  # inclusive [lo, hi]
    k: int  # 0 = plain decoding, drafter does not run
    verify_budget: int  # total draft tokens verified per step (<= batch * k)
    tier: int | None = None  # smallest captured tier >= hi + verify_budget
    gain: float | None = None  # simulated goodput / plain decoding, mean over the range
    # fixed: budget(b) = min(b*k, verify_budget), tier = smallest captured >= b + budget(b);
    # fill-tier: budget(b) = min(b*k, tier - b) -- every b of the range fills `tier`
    # (verify_budget then records the budget at hi).
    budget_mode: Literal["fixed", "fill-tier"] = "fixed"
    # expected emitted tokens per request per step at K = 0, 1, ..., max_k with the full budget,
    # as the tuner predicted them at this row (exact in-flight mixture model, mid-row batch);
    # the online controller calibrates its homogeneous model to them
    tokens: list[float] | None = None

    def validate(self, path: str) -> None:
        lo, hi = self.batch
        require(1 <= lo <= hi, f"{path}.batch", f"must be [lo, hi] with 1 <= lo <= hi, got [{lo}, {hi}]")
        require(hi <= MAX_BATCH, f"{path}.batch", f"must end at <= {MAX_BATCH} (MAX_BATCH), got {hi}")
        require(0 <= self.k <= MAX_K, f"{path}.k", f"must be in 0..{MAX_K}, got {self.k}")
        require(self.verify_budget >= 0, f"{path}.verify_budget", "must be >= 0")
        require(self.k > 0 or self.verify_budget == 0, f"{path}.verify_budget", "must be 0 when k is 0")
        if self.tokens is not None:
            require(len(self.tokens) >= 1 and abs(self.tokens[0] - 1.0) < 1e-6, f"{path}.tokens",
                    "must start with 1.0 (K = 0 emits one token per request)")
            require(all(self.tokens[i] <= self.tokens[i + 1] + 1e-9 <= self.tokens[i] + 1.0 + 1e-9
                        for i in range(len(self.tokens) - 1)), f"{path}.tokens",
                    "must grow by 0..1 per extra draft")
        require(self.verify_budget <= hi * self.k, f"{path}.verify_budget",
                f"{self.verify_budget} exceeds the {hi * self.k} drafts of {hi} requests x K={self.k}")
        if self.budget_mode == "fill-tier":
            require(self.tier is not None, f"{path}.tier", "required when budget_mode is fill-tier")
            require(self.tier is None or hi + self.verify_budget <= self.tier, f"{path}.verify_budget",
                    f"hi + verify_budget = {hi + self.verify_budget} exceeds tier {self.tier}")
        elif self.tier is not None:
            need = hi + min(hi * self.k, self.verify_budget)  # tokens of the row's largest step
            require(self.tier >= need, f"{path}.tier",
                    f"{self.tier} cannot hold the {need} tokens of batch {hi} (1 + its drafts per request)")
        if self.gain is not None:
            # K drafts emit <= K + 1 tokens per request and step, at no less than a plain step's cost
            top = (self.k + 1) * (1 + GAIN_SLACK)
            require(0 < self.gain <= top, f"{path}.gain",
                    f"{self.gain} vs plain is not possible with K={self.k} (must be in (0, {self.k + 1}])")


@dataclass(frozen=True)
class Online:
    """The online controller's settings (``runtime/planner.py`` states the maths)."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        key: "a setting of the spectune 0.1 online correction, replaced by window/margin/z: "
             "re-run `spectune tune` for this table" for key in ("ema", "hysteresis")}

    # observed steps the acceptance estimate covers: counts decay by 1 - 1/window per step
    window: float = 256.0
    # move K only when the lower confidence bound of the predicted goodput gain exceeds this
    margin: float = 0.01
    z: float = 1.64  # one-sided confidence (1.64: 95 %) of the rate bounds a move must clear
    min_k: int = 0
    max_k: int | None = None
    prior: list[float] | None = None  # conditional per-position acceptance tuned on, [max_k]
    # tested first-position drafts the estimate must hold before K leaves the table's value
    min_evidence: float = 8.0
    # every probe_every-th step runs the shape that is best if acceptance is at its upper bound,
    # when that could beat the current choice (K = 0 is left again, K climbs); 0 = never probe
    probe_every: int = 16
    # change detector: a fast window of this many steps is compared with the estimate;
    # a standardised difference above change_z empties the estimate (the traffic shifted)
    change_window: float = 32.0
    change_z: float = 5.0
    # the controller re-decides a batch size every decide_every observed steps (host time)
    decide_every: int = 8
    # acceptance range the captured tiers leave room for: the tuned conditional rates scaled by
    # [lo, hi] (recorded by the tuner; informative)
    adapt_range: tuple[float, float] | None = None
    # score each shape at its measured step time (``Planner.observe_time``) instead of the cost
    # model's alone, where the runtime reports step times
    time_feedback: bool = True

    def validate(self, path: str) -> None:
        require(self.window > 1.0, f"{path}.window", "must be > 1 (steps)")
        require(0.0 <= self.margin < 1.0, f"{path}.margin", "must be in [0, 1)")
        require(0.0 <= self.z <= 10.0, f"{path}.z", "must be in [0, 10]")
        require(self.min_evidence >= 0.0, f"{path}.min_evidence", "must be >= 0")
        require(self.probe_every >= 0, f"{path}.probe_every", "must be >= 0")
        require(self.change_window > 1.0, f"{path}.change_window", "must be > 1 (steps)")
        require(self.change_z > 0.0, f"{path}.change_z", "must be > 0")
        require(self.decide_every >= 1, f"{path}.decide_every", "must be >= 1")
        require(0 <= self.min_k <= MAX_K, f"{path}.min_k", f"must be in 0..{MAX_K}")
        require(self.max_k is None or self.min_k <= self.max_k <= MAX_K, f"{path}.max_k",
                f"must be in min_k..{MAX_K} ({self.min_k}..{MAX_K}), got {self.max_k}")
        if self.prior is not None:
            require(0 < len(self.prior) <= MAX_K, f"{path}.prior", f"must hold 1..{MAX_K} rates")
            require(all(0.0 <= a <= 1.0 for a in self.prior), f"{path}.prior", "must be in [0, 1]")
        if self.adapt_range is not None:
            lo, hi = self.adapt_range
            require(0.0 < lo <= 1.0 <= hi, f"{path}.adapt_range", f"must be [lo, hi] with 0 < lo <= 1 <= hi, got [{lo}, {hi}]")


@dataclass(frozen=True)
class Policy:
    tiers: list[int]
    rows: list[Row]
    online: Online
    objective: Literal["goodput", "energy", "latency", "pareto"] = "goodput"
    # mean context (tokens in the KV cache per request) of the traffic the policy was tuned for;
    # None: the profile's workload.context_len
    context_len: int | None = None

    def validate(self, path: str) -> None:
        require(self.context_len is None or self.context_len >= 1, f"{path}.context_len", "must be >= 1")
        require(self.context_len is None or self.context_len <= MAX_CONTEXT, f"{path}.context_len",
                f"must be <= {MAX_CONTEXT}")
        require(0 < len(self.tiers) <= MAX_TIERS, f"{path}.tiers", f"must hold 1..{MAX_TIERS} tiers")
        top = MAX_BATCH * (MAX_K + 1)
        require(all(1 <= t <= top for t in self.tiers), f"{path}.tiers",
                f"must be in 1..{top} tokens (MAX_BATCH x (MAX_K + 1))")
        require(list(self.tiers) == sorted(set(self.tiers)), f"{path}.tiers", "must be strictly increasing")
        require(len(self.rows) > 0, f"{path}.rows", "must not be empty")
        expect = 1
        for i, row in enumerate(self.rows):
            lo, hi = row.batch
            if lo != expect:
                what = "gap" if lo > expect else "overlap"
                raise TableError(f"{path}.rows[{i}].batch", f"{what}: starts at {lo}, expected {expect}")
            expect = hi + 1
            need = hi + row.verify_budget
            if row.tier is not None:
                require(row.tier in self.tiers, f"{path}.rows[{i}].tier", f"{row.tier} is not a captured tier")
            require(
                self.tiers[-1] >= need,
                f"{path}.rows[{i}]",
                f"needs {need} tokens but the largest tier is {self.tiers[-1]}",
            )


MAX_CLASSES = 64  # request classes in an acceptance mixture
WEIGHT_SLACK = 1e-3  # mixture weights must sum to 1 within this


def check_mixture(weights: Sequence[float], rates: Sequence[Sequence[float]], max_k: int,
                  calibration: Sequence[Sequence[float]] | None, path: str) -> None:
    """An acceptance mixture: weights in (0, 1] summing to 1, per class ``max_k`` conditional rates
    in [0, 1], calibration bins with increasing edges in (0, 1] and probabilities in [0, 1].
    The acceptance section of a table and ``autotune.acceptance.AcceptanceModel`` both check here."""

    def at(name: str) -> str:
        return f"{path}.{name}" if path else name

    require(1 <= max_k <= MAX_K, at("max_k"), f"must be in 1..{MAX_K}, got {max_k}")
    require(0 < len(weights) <= MAX_CLASSES, at("components"), f"must hold 1..{MAX_CLASSES} classes")
    for i, (w, accept) in enumerate(zip(weights, rates, strict=True)):
        require(math.isfinite(w) and 0.0 < w <= 1.0 + WEIGHT_SLACK, at(f"components[{i}].weight"),
                f"must be in (0, 1], got {w}")
        require(len(accept) == max_k, at(f"components[{i}].accept"),
                f"has {len(accept)} positions, max_k is {max_k}")
        for j, a in enumerate(accept):
            require(math.isfinite(a) and 0.0 <= a <= 1.0, at(f"components[{i}].accept[{j}]"),
                    f"must be in [0, 1], got {a}")
    total = math.fsum(weights)
    require(abs(total - 1.0) <= WEIGHT_SLACK, at("components"), f"weights sum to {total:.6f}, must sum to 1")
    prev = 0.0
    for i, (edge, prob) in enumerate(calibration or ()):
        require(prev < edge <= 1.0, at(f"calibration[{i}]"), "bin edges must increase within (0, 1]")
        require(0.0 <= prob <= 1.0, at(f"calibration[{i}]"), f"probability {prob} is outside [0, 1]")
        prev = edge


@dataclass(frozen=True)
class AcceptanceClass:
    weight: float
    accept: list[float]  # [max_k] conditional rates a_1..a_max_k


@dataclass(frozen=True)
class AcceptanceSection:
    """What a policy was tuned on (``autotune.acceptance.AcceptanceModel.to_dict``)."""

    source: str
    max_k: int
    components: list[AcceptanceClass]
    calibration: list[tuple[float, float]] | None = None  # (confidence bin upper edge, P(accept | bin))

    def validate(self, path: str) -> None:
        check_mixture([c.weight for c in self.components], [c.accept for c in self.components], self.max_k,
                      self.calibration, path)


def check_acceptance_section(data: Any, path: str = "acceptance") -> AcceptanceSection:
    return from_dict(AcceptanceSection, data, path)


@dataclass(frozen=True)
class Table:
    schema: str
    hardware: Hardware
    software: Software
    workload: Workload
    costs: Costs
    acceptance: dict[str, Any] | None = None
    policy: Policy | None = None
    created: str | None = None

    def validate(self, path: str) -> None:
        require(self.schema == SCHEMA, "schema", f"unsupported version {self.schema!r} (this spectune reads {SCHEMA!r})")
        if self.policy is not None:
            require(
                self.policy.rows[-1].batch[1] >= self.workload.max_batch,
                "policy.rows",
                f"cover batch 1..{self.policy.rows[-1].batch[1]}, workload.max_batch is {self.workload.max_batch}",
            )
            for i, row in enumerate(self.policy.rows):
                require(row.k <= self.workload.max_k, f"policy.rows[{i}].k", f"exceeds workload.max_k={self.workload.max_k}")
            online, top = self.policy.online, self.workload.max_k
            require(online.max_k is None or online.max_k <= top, "policy.online.max_k",
                    f"{online.max_k} exceeds workload.max_k={top} (the drafter was measured up to it)")
            require(online.min_k <= max(top, 0), "policy.online.min_k", f"{online.min_k} exceeds workload.max_k={top}")
            if online.prior is not None:
                require(len(online.prior) <= max(top, 1), "policy.online.prior",
                        f"has {len(online.prior)} rates, workload.max_k is {top}")
        if self.acceptance is not None:
            check_acceptance_section(self.acceptance, "acceptance")

    @property
    def is_policy(self) -> bool:
        return self.policy is not None


def table_from_dict(data: Any, file: str | os.PathLike[str] | None = None) -> Table:
    try:
        return from_dict(Table, data)
    except TableError as exc:
        raise TableError(exc.field, exc.reason, file) from None
    except RecursionError:  # a self-referencing YAML alias where a section was expected
        raise TableError("", "not a spectune table: nested too deeply", file) from None


def read_table(path: str | os.PathLike[str]) -> Table:
    return table_from_dict(read_yaml(path), path)


def table_to_yaml(table: Table) -> str:
    data = to_dict(table)
    if data.get("policy") is None:
        data.pop("policy", None)
    if data.get("acceptance") is None:
        data.pop("acceptance", None)
    return dump_yaml(data)


def write_table(table: Table, path: str | os.PathLike[str]) -> None:
    """Validate by round trip, then write atomically (temporary file + rename)."""
    text = table_to_yaml(table)
    import yaml

    table_from_dict(yaml.safe_load(text), path)
    atomic_write_text(path, text)
