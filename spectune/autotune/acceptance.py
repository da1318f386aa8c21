"""Acceptance models: how many drafts a target accepts, as a distribution over requests.

Words (see docs/ARCHITECTURE): for one request, ``a_i`` is the *conditional* acceptance rate of
draft position i (P(draft i accepted | drafts 1..i-1 accepted)); its *survival* is
``s_i = a_1 * ... * a_i`` (non-increasing). A step that verifies K drafts emits
``1 + s_1 + ... + s_K`` tokens on average (the 1 is the bonus/corrected token).

Requests differ (easy prompts, hard prompts), so a model is a *mixture* of components, each a class
of requests with its own conditional rates. Sources (``load_acceptance``):

    curve:0.78,0.58,0.43                     survival s_1..s_n
    mixture:0.5*curve(0.95,0.9)+0.5*curve(0.5,0.2)
    public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench      rows of the shipped published figures
    metrics:FILE[#model=NAME], FILE.prom, FILE.txt, http(s)://...   a vLLM Prometheus scrape
    trtllm-stats:FILE,...                    TensorRT-LLM iteration stats (acceptance_engines.py)
    sglang-metrics:S0,S1,...                 SGLang Prometheus scrapes in time order (acceptance_engines.py)
    FILE.jsonl, FILE.jsonl.gz, traces:FILE   per-step traces (see acceptance_sources.py)

Extrapolation: positions past the data's last one continue the last conditional rate with a mild
geometric decay, ``a_{n+j} = a_n * EXTRAPOLATION_DECAY**j``: deeper drafts drift further from the
target, so assuming a flat rate would overstate long drafts.
"""

from __future__ import annotations

import csv
import functools
import importlib.resources
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spectune.errors import SpectuneError, TableError
from spectune.runtime.schema import from_dict
from spectune.runtime.table import check_mixture

EXTRAPOLATION_DECAY = 0.95  # per position past the data, applied to the last conditional rate
DEFAULT_PUBLIC = "EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench"
PUBLIC_CSV = "acceptance_public.csv"


class AcceptanceError(SpectuneError):
    """An acceptance source cannot be read; the message names the source, file, line or field."""


class AcceptanceWarning(UserWarning):
    """An acceptance source was read, but with an estimate the user should know about."""


# ---------------------------------------------------------------------------------------------
# curves: survival <-> conditional rates


def extend_conditional(accept: list[float] | tuple[float, ...], max_k: int) -> tuple[float, ...]:
    """Truncate or extend conditional rates to ``max_k`` positions (extrapolation: module doc)."""
    rates = [min(1.0, max(0.0, float(a))) for a in accept[:max_k]]
    if not rates:
        raise AcceptanceError("no acceptance positions to extend")
    last = rates[-1]
    for j in range(1, max_k - len(rates) + 1):
        rates.append(last * EXTRAPOLATION_DECAY**j)
    return tuple(rates)


def survival_to_conditional(survival: list[float] | tuple[float, ...]) -> list[float]:
    # a_i = s_i / s_{i-1} with s_0 = 1; once survival reaches 0 every later rate is 0
    rates, prev = [], 1.0
    for s in survival:
        rates.append(s / prev if prev > 0 else 0.0)
        prev = s
    return [min(1.0, max(0.0, a)) for a in rates]


def conditional_to_survival(accept: list[float] | tuple[float, ...]) -> list[float]:
    out, s = [], 1.0
    for a in accept:
        s *= a
        out.append(s)
    return out


def check_survival(values: list[float], where: str) -> None:
    """Survival must lie in [0, 1] and be non-increasing; the error names the 1-based position."""
    prev = 1.0
    for i, s in enumerate(values, start=1):
        if not (isinstance(s, int | float) and math.isfinite(s)):
            raise AcceptanceError(f"{where}: position {i}: {s!r} is not a number")
        if not 0.0 <= s <= 1.0:
            raise AcceptanceError(f"{where}: position {i}: survival {s} is outside [0, 1]")
        if s > prev + 1e-9:
            raise AcceptanceError(
                f"{where}: position {i}: survival {s} exceeds position {i - 1}'s {prev} "
                "(survival s_i = P(first i drafts accepted) cannot increase)"
            )
        prev = s


# ---------------------------------------------------------------------------------------------
# the model


@dataclass(frozen=True)
class Component:
    """One class of requests."""

    weight: float  # mixture weight; a model's weights sum to 1
    accept: tuple[float, ...]  # [max_k] conditional rates a_1..a_max_k

    def survival(self, k: int) -> list[float]:
        # s_i = a_1 * ... * a_i for i = 1..k (extrapolated past max_k)
        rates = self.accept if k <= len(self.accept) else extend_conditional(self.accept, k)
        return conditional_to_survival(rates[:k])



@dataclass(frozen=True)
class AcceptanceModel:
    """A distribution over requests of per-position acceptance (1 component = homogeneous)."""

    source: str  # human description: "curve:0.78,...", "vllm-metrics:x.prom", "traces:x.jsonl (412 requests)"
    components: tuple[Component, ...]
    max_k: int  # every component has max_k conditional rates
    calibration: tuple[tuple[float, float], ...] | None = None  # (confidence bin upper edge, P(accept | bin))
    # a trace set's recorded steps per request (``spectune.models.trace_steps.RequestSteps``), which
    # the simulator replays token by token as the bench's engine does; not part of the table
    replay: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate("")

    def validate(self, path: str) -> None:
        # the table's acceptance section and this model share one check
        check_mixture([c.weight for c in self.components], [c.accept for c in self.components], self.max_k,
                      self.calibration, path)

    # -- evaluation -----------------------------------------------------------------------------

    def mean_survival(self, k: int) -> list[float]:
        # mixture mean of s_1..s_k: sum_c w_c * s_{c,i}
        out = [0.0] * k
        for comp in self.components:
            for i, s in enumerate(comp.survival(k)):
                out[i] += comp.weight * s
        return out

    def expected_tokens(self, k: int) -> float:
        """Acceptance length of a K-draft step, bonus token included: 1 + sum_i mean s_i."""
        return 1.0 + sum(self.mean_survival(k))

    def mean_conditional(self) -> tuple[float, ...]:
        """Conditional rates of the mean survival curve (a homogeneous summary), [max_k]."""
        return tuple(survival_to_conditional(self.mean_survival(self.max_k)))

    def widened(self, max_k: int) -> AcceptanceModel:
        """The same model over at least ``max_k`` positions (each class's rates extrapolated)."""
        if self.max_k >= max_k:
            return self
        comps = tuple(Component(c.weight, extend_conditional(c.accept, max_k)) for c in self.components)
        return AcceptanceModel(self.source, comps, max_k, self.calibration, self.replay)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, max_k] conditional acceptance rows, one per sampled request (component by weight)."""
        weights = np.array([c.weight for c in self.components], dtype=float)
        rows = np.array([c.accept for c in self.components], dtype=float)  # [C, max_k]
        picks = rng.choice(len(self.components), size=n, p=weights / weights.sum())
        return rows[picks]

    # -- YAML -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "source": self.source,
            "max_k": self.max_k,
            "components": [
                {"weight": float(c.weight), "accept": [float(a) for a in c.accept]} for c in self.components
            ],
        }
        if self.calibration is not None:
            data["calibration"] = [[float(e), float(p)] for e, p in self.calibration]
        return data

    @classmethod
    def from_dict(cls, data: Any, path: str = "acceptance") -> AcceptanceModel:
        """Build from the table's ``acceptance`` mapping; errors are TableError naming the field."""
        try:
            return from_dict(cls, data, path)
        except TableError as exc:
            if path and not exc.field.startswith(path):
                raise TableError(f"{path}.{exc.field}" if exc.field else path, exc.reason) from None
            raise

    # -- constructors -----------------------------------------------------------------------------

    @classmethod
    def from_survival(cls, survival: list[float], *, max_k: int, source: str) -> AcceptanceModel:
        check_survival(list(survival), source)
        accept = extend_conditional(survival_to_conditional(survival), max_k)
        return cls(source=source, components=(Component(1.0, accept),), max_k=max_k)

    @classmethod
    def mixture_with_same_mean(
        cls,
        survival: list[float],
        *,
        max_k: int,
        spread: float = 0.5,
        easy_weight: float = 0.5,
        source: str | None = None,
    ) -> AcceptanceModel:
        """Easy and hard requests whose mixture mean survival equals ``survival`` (extended to max_k).

        With w = easy_weight and d_i = spread * min(s_i / w, (1 - s_i) / (1 - w)):
        easy e_i = s_i + (1 - w) d_i, hard h_i = s_i - w d_i, so w e_i + (1 - w) h_i = s_i exactly,
        both stay in [0, 1] and non-increasing (each is a non-decreasing function of s_i).
        spread = 0 gives two identical components; spread = 1 the widest split.
        """
        if not 0.0 <= spread <= 1.0:
            raise AcceptanceError(f"mixture_with_same_mean: spread must be in [0, 1], got {spread}")
        if not 0.0 < easy_weight < 1.0:
            raise AcceptanceError(f"mixture_with_same_mean: easy_weight must be in (0, 1), got {easy_weight}")
        check_survival(list(survival), source or "mixture_with_same_mean")
        w = easy_weight
        mean = conditional_to_survival(extend_conditional(survival_to_conditional(survival), max_k))
        easy, hard = [], []
        for s in mean:
            d = spread * min(s / w, (1.0 - s) / (1.0 - w))
            easy.append(min(1.0, s + (1.0 - w) * d))
            hard.append(max(0.0, s - w * d))
        comps = (
            Component(w, tuple(survival_to_conditional(easy))),
            Component(1.0 - w, tuple(survival_to_conditional(hard))),
        )
        text = source or f"same-mean mixture (spread {spread:g}, easy weight {w:g}) of curve:" + ",".join(
            f"{s:.4g}" for s in survival
        )
        return cls(source=text, components=comps, max_k=max_k)


# ---------------------------------------------------------------------------------------------
# inline sources: curve:, mixture:


def _parse_floats(text: str, where: str) -> list[float]:
    values = []
    for i, item in enumerate(text.split(","), start=1):
        item = item.strip()
        try:
            v = float(item)
        except ValueError:
            raise AcceptanceError(f"{where}: position {i}: {item!r} is not a number") from None
        if not math.isfinite(v):
            raise AcceptanceError(f"{where}: position {i}: {item!r} is not a finite number")
        values.append(v)
    return values


def parse_curve(spec: str, *, max_k: int) -> AcceptanceModel:
    body = spec[len("curve:"):].strip()
    if not body:
        raise AcceptanceError(f"{spec}: no survival values (e.g. curve:0.78,0.58,0.43)")
    survival = _parse_floats(body, spec)
    return AcceptanceModel.from_survival(survival, max_k=max_k, source=spec)


_TERM = re.compile(r"^\s*([0-9.eE+-]+)\s*\*\s*curve\(([^)]*)\)\s*$")


def parse_mixture(spec: str, *, max_k: int) -> AcceptanceModel:
    body = spec[len("mixture:"):]
    terms = [t for t in re.split(r"\)\s*\+", body)]
    comps = []
    for j, term in enumerate(terms, start=1):
        term = term if term.rstrip().endswith(")") else term + ")"
        m = _TERM.match(term)
        if m is None:
            raise AcceptanceError(f"{spec}: term {j}: expected WEIGHT*curve(s1,s2,...), got {term.strip()!r}")
        try:
            weight = float(m.group(1))
        except ValueError:
            raise AcceptanceError(f"{spec}: term {j}: weight {m.group(1)!r} is not a number") from None
        if not 0.0 < weight <= 1.0:
            raise AcceptanceError(f"{spec}: term {j}: weight {weight} must be in (0, 1]")
        survival = _parse_floats(m.group(2), f"{spec}: term {j}")
        check_survival(survival, f"{spec}: term {j}")
        comps.append(Component(weight, extend_conditional(survival_to_conditional(survival), max_k)))
    total = sum(c.weight for c in comps)
    if abs(total - 1.0) > 1e-3:
        raise AcceptanceError(f"{spec}: weights sum to {total:g}, must sum to 1")
    comps = [Component(c.weight / total, c.accept) for c in comps]
    return AcceptanceModel(source=spec, components=tuple(comps), max_k=max_k)


# ---------------------------------------------------------------------------------------------
# published figures: public:<drafter>/<target>/<dataset>


@dataclass(frozen=True)
class PublicRow:
    source: str
    target: str
    drafter: str
    dataset: str
    temperature: float
    kind: str  # "mean_accept_len_by_k" | "per_position"
    index: int  # K or position
    value: float


@functools.lru_cache(maxsize=1)
def public_rows() -> tuple[PublicRow, ...]:
    text = importlib.resources.files("spectune").joinpath("data", PUBLIC_CSV).read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    rows = []
    for rec in csv.DictReader(lines):
        rows.append(
            PublicRow(
                source=rec["source"],
                target=rec["target"],
                drafter=rec["drafter"],
                dataset=rec["dataset"],
                temperature=float(rec["temperature"]),
                kind=rec["kind"],
                index=int(rec["k_or_position"]),
                value=float(rec["value"]),
            )
        )
    return tuple(rows)


def public_selectors() -> list[str]:
    return sorted({f"{r.drafter}/{r.target}/{r.dataset}" for r in public_rows()})


def fit_geometric_conditional(lengths: dict[int, float]) -> tuple[float, float, float]:
    """Fit a_i = min(1, a * r**(i-1)) to mean acceptance lengths L(K) = 1 + sum_{i<=K} s_i.

    Least squares on L over a coarse grid then a local refinement (two parameters, a few hundred
    evaluations). Returns (a, r, max relative residual of L).
    """
    ks = sorted(lengths)
    target = np.array([lengths[k] for k in ks])
    kmax = ks[-1]

    def predict(a: float, r: float) -> np.ndarray:
        rates = np.minimum(1.0, a * r ** np.arange(kmax))
        cum = np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(rates))])  # L(0..kmax)
        return cum[ks]

    def loss(a: float, r: float) -> float:
        return float(np.sum((predict(a, r) - target) ** 2))

    grid = [(loss(a, r), a, r) for a in np.linspace(0.05, 1.0, 39) for r in np.linspace(0.5, 1.2, 36)]
    _, a, r = min(grid)
    step_a, step_r = 0.025, 0.02
    for _ in range(60):
        cands = [(loss(a + da, r + dr), a + da, r + dr) for da in (-step_a, 0, step_a) for dr in (-step_r, 0, step_r)]
        best = min(cands)
        if best[1] == a and best[2] == r:
            step_a, step_r = step_a / 2, step_r / 2
        _, a, r = best
        a = min(1.0, max(1e-3, a))
    residual = float(np.max(np.abs(predict(a, r) - target) / target))
    return a, r, residual


def parse_public(spec: str, *, max_k: int) -> AcceptanceModel:
    selector = spec[len("public:"):].strip()
    parts = selector.split("/")
    available = public_selectors()
    if len(parts) != 3:
        raise AcceptanceError(f"{spec}: expected public:<drafter>/<target>/<dataset>; available: {', '.join(available)}")
    drafter, target, dataset = parts
    rows = [r for r in public_rows() if (r.drafter, r.target, r.dataset) == (drafter, target, dataset)]
    if not rows:
        raise AcceptanceError(f"{spec}: no such published figures; available: {', '.join(available)}")
    cited = ", ".join(sorted({r.source for r in rows}))
    per_position = sorted((r.index, r.value) for r in rows if r.kind == "per_position")
    if per_position:
        # unconditional per-position acceptance is the survival curve itself
        survival = [v for _, v in per_position]
        return AcceptanceModel.from_survival(survival, max_k=max_k, source=f"{spec} (per-position, {cited})")
    lengths = {r.index: r.value for r in rows if r.kind == "mean_accept_len_by_k"}
    a, r, residual = fit_geometric_conditional(lengths)
    accept = [min(1.0, a * r**i) for i in range(max(max_k, max(lengths)))]
    model_accept = extend_conditional(accept[: max(lengths)], max_k)
    source = f"{spec} (L(K) fit a={a:.3f} r={r:.3f}, max residual {residual * 100:.1f}%, {cited})"
    return AcceptanceModel(source=source, components=(Component(1.0, model_accept),), max_k=max_k)


@functools.lru_cache(maxsize=16)
def default_acceptance(max_k: int) -> AcceptanceModel:
    """The fallback when the user gives none: EAGLE-3 on Llama-3.1-8B-Instruct, MT-Bench, fitted."""
    return parse_public(f"public:{DEFAULT_PUBLIC}", max_k=max_k)


# ---------------------------------------------------------------------------------------------
# dispatch


def load_acceptance(source: str, *, max_k: int) -> AcceptanceModel:
    """Read any acceptance source (forms in the module doc); AcceptanceError on bad input."""
    if max_k < 1:
        raise AcceptanceError(f"max_k must be >= 1, got {max_k}")
    spec = source.strip()
    lower = spec.lower()
    if lower.startswith("curve:"):
        return parse_curve(spec, max_k=max_k)
    if lower.startswith("mixture:"):
        return parse_mixture(spec, max_k=max_k)
    if lower.startswith("public:"):
        return parse_public(spec, max_k=max_k)
    from spectune.autotune import acceptance_sources as sources

    if lower.startswith(("trtllm-stats:", "sglang-metrics:")):
        from spectune.autotune import acceptance_engines as engines

        load = engines.load_trtllm if lower.startswith("trtllm-stats:") else engines.load_sglang
        return load(spec, max_k=max_k)
    if lower.startswith(("metrics:", "http://", "https://")) or lower.split("#")[0].endswith((".prom", ".txt")):
        return sources.load_metrics(spec, max_k=max_k)
    if lower.startswith("traces:") or lower.split("#")[0].endswith((".jsonl", ".jsonl.gz")):
        return sources.load_traces(spec, max_k=max_k)
    raise AcceptanceError(
        f"{source!r}: unknown acceptance source; use curve:S1,S2,..., mixture:W*curve(...)+..., "
        "public:<drafter>/<target>/<dataset>, metrics:FILE (or .prom/.txt/http URL), trtllm-stats:FILE, "
        "sglang-metrics:S0,S1,..., or FILE.jsonl[.gz]"
    )




def resolve_acceptance(acceptance: str | AcceptanceModel | None, max_k: int) -> AcceptanceModel:
    if acceptance is None:
        return default_acceptance(max_k)
    if isinstance(acceptance, str):
        return load_acceptance(acceptance, max_k=max_k)
    return acceptance


__all__ = [
    "AcceptanceError",
    "AcceptanceModel",
    "AcceptanceWarning",
    "Component",
    "EXTRAPOLATION_DECAY",
    "default_acceptance",
    "load_acceptance",
    "resolve_acceptance",
    "public_selectors",
]
