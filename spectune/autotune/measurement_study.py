"""The measurement study: an Optuna study in which each trial is one measured point.

Design
- A point is a :class:`PointSpec` (kind, batch, tokens, q | k) with a deterministic ``key``
  (``target:b=4:q=2``). Trials carry it as params (``kind``, ``batch``, ``size``; fixed
  distributions) and as user attrs; the result (ms, p20/p80, capture cost, NVML energy/power/clock/
  throttle, feasible) is stored as user attrs too. Feasible points are COMPLETE with value = ms;
  infeasible ones (out of memory / resources) are PRUNED with ``feasible = False`` and never fitted.
- Optuna is the durable queue and record; the choice of points is the planner's. Points are
  enqueued with ``study.enqueue_trial`` and measured through ``study.ask(fixed_distributions)``.
  Phases: ``seed`` (sparse grid: log-spaced batch sizes x a few q / K, every tier, a few overhead
  sizes), ``held_out`` (>= 10 seeded random batch sizes off the grid, measured but not fitted; they
  give the reported error) and ``adaptive``: rounds of a few points each, chosen by refitting the
  cost model on bootstrap resamples and taking the candidates (any allowed batch x q / K) with the
  largest relative spread of predictions, doubled near batch sizes where the best K under a default
  geometric acceptance curve changes.
- Resume and sharing: every worker opens the study with ``load_if_exists=True``; a point whose key
  already has a finished trial is never measured again, and the adaptive phase counts the adaptive
  points already in the study. The study name encodes GPU and workload (:func:`study_name_for`), so
  several GPUs can share one storage (a journal file on one host, an RDB URL across hosts).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from spectune.autotune.fit import FitError, fit_cost_model, fit_drafter, fit_target, held_out_error
from spectune.autotune.timing import InfeasiblePoint, free_device_memory, is_out_of_memory
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel, drafter_ms, target_ms
from spectune.runtime.table import CostError, CostModelParams, DrafterKind, PointKind

DEFAULT_ACCEPT = 0.7  # survival s_i = DEFAULT_ACCEPT**i, only to find where the best K changes
BOOTSTRAPS = 8
KINDS: tuple[PointKind, ...] = ("target", "tier", "drafter", "overhead")


class StudyError(SpectuneError):
    """The measurement study cannot run (storage, plan)."""


@dataclass(frozen=True)
class PointSpec:
    kind: PointKind
    batch: int  # real requests
    tokens: int  # step tokens (target: batch*q; tier: the tier; drafter: batch*k; overhead: tokens)
    q: int | None = None  # target: tokens per request, 1..max_k+1
    k: int | None = None  # drafter: draft length, 1..max_k
    held_out: bool = False

    @property
    def size(self) -> int:
        return self.q if self.kind == "target" else self.k if self.kind == "drafter" else self.tokens  # type: ignore[return-value]

    @property
    def key(self) -> str:
        name = {"target": "q", "drafter": "k"}.get(self.kind, "n")
        return f"{self.kind}:b={self.batch}:{name}={self.size}" + (":held" if self.held_out else "")


def target_point(batch: int, q: int, held_out: bool = False) -> PointSpec:
    return PointSpec("target", batch, batch * q, q=q, held_out=held_out)


def drafter_point(batch: int, k: int, held_out: bool = False) -> PointSpec:
    return PointSpec("drafter", batch, batch * k, k=k, held_out=held_out)


@dataclass(frozen=True)
class StudyPlan:
    batch_sizes: tuple[int, ...]  # allowed batch sizes, increasing
    max_k: int
    drafter_kind: DrafterKind
    context_len: int
    adaptive_trials: int = 16
    held_out: int = 12
    per_round: int = 4
    seed: int = 0
    tiers: tuple[int, ...] = ()  # default: powers of two up to max_batch * (max_k + 1)
    overhead_source: str | None = "packing-metadata"

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise StudyError("batch_sizes: must be a non-empty list of sizes >= 1")
        if self.max_k < 1:
            raise StudyError(f"max_k: must be >= 1, got {self.max_k}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(set(self.batch_sizes))))
        if not self.tiers:
            object.__setattr__(self, "tiers", default_tiers(self.max_batch, self.max_k))

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]


@dataclass(frozen=True)
class StudyResult:
    study_name: str
    records: list[dict[str, Any]]  # one per measured point (feasible or not), seed order
    params: CostModelParams
    error: CostError
    measured_now: int  # points this call measured
    timer_mode: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# plan


def default_tiers(max_batch: int, max_k: int) -> tuple[int, ...]:
    top = max_batch * (max_k + 1)
    tiers, t = [], 1
    while t < top:
        tiers.append(t)
        t *= 2
    return tuple(tiers + [top])


def grid_batches(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Log-spaced batch sizes (powers of two snapped to the allowed ones, plus both ends)."""
    sizes = sorted(set(batch_sizes))
    if len(sizes) <= 6:
        return tuple(sizes)
    want = [2**i for i in range(int(math.log2(sizes[-1])) + 1)] + [sizes[0], sizes[-1]]

    def nearest(w: int) -> int:
        return min(sizes, key=lambda s: (abs(math.log(s / w)), s))

    return tuple(sorted({nearest(w) for w in want}))


def _draft_lengths(max_k: int) -> tuple[int, ...]:
    return tuple(sorted({1, max(1, (max_k + 1) // 4), max_k}))


def _q_values(max_k: int) -> tuple[int, ...]:
    qs = [1]
    while qs[-1] * 2 <= max_k + 1:
        qs.append(qs[-1] * 2)
    return tuple(sorted(set(qs + [max_k + 1])))


def seed_points(plan: StudyPlan) -> list[PointSpec]:
    grid = grid_batches(plan.batch_sizes)
    pts = [target_point(b, q) for b in grid for q in _q_values(plan.max_k)]
    pts += [drafter_point(b, k) for b in grid for k in _draft_lengths(plan.max_k)]
    pts += [PointSpec("tier", max(1, min(plan.max_batch, t // 2)), t) for t in plan.tiers]
    pts += [PointSpec("overhead", b, n) for b in grid for n in sorted({b, b * (plan.max_k + 1)})]
    return pts


def held_out_points(plan: StudyPlan) -> list[PointSpec]:
    """Seeded random target/drafter points at batch sizes off the grid (grid sizes only if none)."""
    rng = np.random.default_rng(plan.seed + 7919)
    grid = set(grid_batches(plan.batch_sizes))
    off = [b for b in plan.batch_sizes if b not in grid] or list(plan.batch_sizes)
    seen: set[str] = set()
    pts: list[PointSpec] = []
    for _ in range(plan.held_out * 20):
        if len(pts) >= plan.held_out:
            break
        b = int(rng.choice(off))
        if len(pts) % 3 == 2:
            p = drafter_point(b, int(rng.integers(1, plan.max_k + 1)), held_out=True)
        else:
            p = target_point(b, int(rng.integers(1, plan.max_k + 2)), held_out=True)
        if p.key not in seen:
            seen.add(p.key)
            pts.append(p)
    return pts


# ---------------------------------------------------------------------------------------------
# adaptive choice


def _candidates(plan: StudyPlan) -> list[PointSpec]:
    sizes = plan.batch_sizes
    if len(sizes) > 96:  # thin very long ranges: ~96 log-spaced candidates are plenty
        sizes = tuple(sorted({sizes[int(i)] for i in np.geomspace(1, len(sizes), 96) - 1}))
    pts = [target_point(b, q) for b in sizes for q in range(1, plan.max_k + 2)]
    return pts + [drafter_point(b, k) for b in sizes for k in range(1, plan.max_k + 1)]


def _fit_parts(recs: Sequence[dict[str, Any]], plan: StudyPlan) -> tuple[Any, Any]:
    tgt = [r for r in recs if r["kind"] in ("target", "tier")]
    dft = [r for r in recs if r["kind"] == "drafter"]
    t = fit_target([r["tokens"] for r in tgt], [r["batch"] for r in tgt], [r["ms"] for r in tgt], plan.context_len)
    d = fit_drafter([r["batch"] for r in dft], [r["k"] for r in dft], [r["ms"] for r in dft],
                    plan.drafter_kind, plan.context_len)
    return t, d


def _predict(parts: tuple[Any, Any], p: PointSpec, plan: StudyPlan) -> float:
    t, d = parts
    if p.kind == "drafter":
        return drafter_ms(d, plan.drafter_kind, p.batch, p.k or 0, plan.context_len)
    return target_ms(t, p.tokens, p.batch, plan.context_len)


def best_k_by_batch(parts: tuple[Any, Any], plan: StudyPlan, accept: float = DEFAULT_ACCEPT) -> dict[int, int]:
    """argmax_K of predicted goodput b * (1 + sum accept^i) / step_ms for each allowed batch size."""
    out = {}
    for b in plan.batch_sizes:
        def goodput(k: int, b: int = b) -> float:
            step = _predict(parts, drafter_point(b, k), plan) if k else 0.0
            step += _predict(parts, target_point(b, k + 1), plan)
            return b * sum(accept**i for i in range(k + 1)) / max(step, 1e-9)
        out[b] = max(range(plan.max_k + 1), key=goodput)
    return out


def choose_adaptive(plan: StudyPlan, records: Sequence[dict[str, Any]], exclude: set[str], n: int) -> list[PointSpec]:
    """Up to ``n`` unmeasured candidates where bootstrap fits disagree most (x2 near a K switch)."""
    recs = [r for r in records if r.get("feasible") and not r.get("held_out") and r["kind"] != "overhead"]
    cands = [p for p in _candidates(plan) if p.key not in exclude]
    if not cands or n <= 0:
        return []
    rng = np.random.default_rng(plan.seed + len(recs))
    preds = []
    for _ in range(BOOTSTRAPS):
        sample = [recs[i] for i in rng.integers(0, len(recs), len(recs))]
        with contextlib.suppress(FitError):
            parts = _fit_parts(sample, plan)
            preds.append([_predict(parts, p, plan) for p in cands])
    if len(preds) < 2:
        return cands[:: max(1, len(cands) // n)][:n]
    arr = np.asarray(preds)  # [bootstraps, candidates]
    score = arr.std(axis=0) / np.maximum(arr.mean(axis=0), 1e-9)
    with contextlib.suppress(FitError):
        best = best_k_by_batch(_fit_parts(recs, plan), plan)
        sizes = plan.batch_sizes
        near: set[int] = set()
        for lo, hi in zip(sizes[:-1], sizes[1:], strict=True):
            if best[lo] != best[hi]:
                near.update((lo, hi))
        score = score * np.array([2.0 if p.batch in near else 1.0 for p in cands])
    picks: list[PointSpec] = []
    used: set[tuple[str, int]] = set()
    for i in np.argsort(-score, kind="stable"):
        p = cands[int(i)]
        if (p.kind, p.batch) not in used:
            picks.append(p)
            used.add((p.kind, p.batch))
        if len(picks) >= n:
            break
    return picks


# ---------------------------------------------------------------------------------------------
# storage and study


def open_storage(storage: str | Path | optuna.storages.BaseStorage | None) -> optuna.storages.BaseStorage:
    """None -> in memory; sqlite:/postgresql:/mysql: URL -> RDBStorage; a path -> journal file."""
    if storage is None:
        return optuna.storages.InMemoryStorage()
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage
    text = str(storage)
    try:
        if "://" in text:
            if not text.startswith(("sqlite:", "postgresql", "mysql")):
                raise StudyError(f"storage: unsupported URL {text!r} (sqlite:///, postgresql://, mysql:// or a file)")
            return optuna.storages.RDBStorage(text)
        from optuna.storages.journal import JournalFileBackend

        Path(text).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(text))
    except StudyError:
        raise
    except Exception as exc:  # driver missing, unreachable database, unwritable folder
        raise StudyError(f"storage: cannot open {text!r}: {exc}".splitlines()[0]) from None


def study_name_for(gpu: str, target: str, drafter: str, dtype: str, context_len: int, max_k: int) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-")
    return f"spectune-{slug}-{target}-{drafter}-{dtype}-c{context_len}-k{max_k}"


_DISTS = {
    "kind": CategoricalDistribution(KINDS),
    "batch": IntDistribution(1, 1 << 20),
    "size": IntDistribution(0, 1 << 24),
}


def _spec_attrs(p: PointSpec, phase: str) -> dict[str, Any]:
    return {"key": p.key, "phase": phase, "kind": p.kind, "batch": p.batch, "tokens": p.tokens,
            "q": p.q, "k": p.k, "held_out": p.held_out}


def _spec_from_attrs(a: dict[str, Any]) -> PointSpec:
    return PointSpec(a["kind"], a["batch"], a["tokens"], q=a["q"], k=a["k"], held_out=a["held_out"])


def _trials(study: optuna.Study, *states: TrialState) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=states)


def finished_records(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """key -> result attrs of the first finished trial of that key (feasible or not)."""
    out: dict[str, dict[str, Any]] = {}
    for t in _trials(study, TrialState.COMPLETE, TrialState.PRUNED):
        a = t.user_attrs
        if "result" in a and a["key"] not in out:
            out[a["key"]] = {**a, **a["result"]}
            del out[a["key"]]["result"]
    return out


def _enqueue(study: optuna.Study, points: Sequence[PointSpec], phase: str) -> int:
    done = set(finished_records(study))
    waiting = {t.user_attrs.get("key") for t in _trials(study, TrialState.WAITING)}
    new = 0
    for p in points:
        if p.key not in done and p.key not in waiting:
            study.enqueue_trial({"kind": p.kind, "batch": p.batch, "size": p.size}, user_attrs=_spec_attrs(p, phase))
            waiting.add(p.key)
            new += 1
    return new


# ---------------------------------------------------------------------------------------------
# measuring


def measure(spec: PointSpec, measure_point: Callable[[PointSpec], Any], timer: Callable[[Any], Any],
            power: Any = None) -> dict[str, Any]:
    """Time one point; out-of-memory / out-of-resources becomes ``feasible: False``."""
    reason = None
    try:
        step = measure_point(spec)
        meter = power.measure() if power is not None and getattr(power, "available", False) else contextlib.nullcontext()
        with meter as reading:
            timing = timer(step)
        del step
    except Exception as exc:  # building the step can run out of memory too, outside the timer
        if not isinstance(exc, InfeasiblePoint | MemoryError) and not is_out_of_memory(exc):
            raise
        text = str(exc).strip()
        reason = text.splitlines()[0][:200] if text else type(exc).__name__
    if reason is not None:
        free_device_memory()  # outside the except block: the failed frames are gone by now
        return {"feasible": False, "error": reason, "ms": None}
    res: dict[str, Any] = {"feasible": True, "error": None}
    for name in ("median_ms", "p20_ms", "p80_ms", "reps", "mode", "capture_s", "capture_mib"):
        res[name] = getattr(timing, name, None)
    res["ms"] = float(res.pop("median_ms"))
    for src, dst in (("energy_j", "joules"), ("mean_power_w", "power_w"), ("max_power_w", "max_power_w"),
                     ("sm_clock_mhz", "sm_clock_mhz"), ("throttle_reasons", "throttle"), ("throttle_names", "throttle_names")):
        val = getattr(reading, src, None)
        res[dst] = list(val) if isinstance(val, list | tuple) else val
    return res


def _drain(study: optuna.Study, measure_point: Callable[[PointSpec], Any], timer: Callable[[Any], Any],
           power: Any, gpu: str, bar: Any) -> int:
    """Measure enqueued points until none wait; returns how many this worker measured."""
    count = 0
    done = set(finished_records(study))
    while _trials(study, TrialState.WAITING):
        trial = study.ask(_DISTS)
        attrs = trial.user_attrs
        if "key" not in attrs or attrs["key"] in done:
            study.tell(trial, state=TrialState.PRUNED)  # another worker took the point first
            continue
        try:
            res = measure(_spec_from_attrs(attrs), measure_point, timer, power)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("result", {**res, "gpu": gpu})  # one write per point
        done.add(attrs["key"])
        if res["feasible"]:
            study.tell(trial, res["ms"])
        else:
            study.tell(trial, state=TrialState.PRUNED)
        count += 1
        bar.update(1)
    return count


@contextlib.contextmanager
def _progress(total: int, initial: int, enabled: bool) -> Iterator[Any]:
    from tqdm.auto import tqdm

    with tqdm(total=total, initial=initial, disable=not enabled, desc="measuring", unit="pt", leave=False) as bar:
        yield bar


def run_study(
    plan: StudyPlan,
    measure_point: Callable[[PointSpec], Any],
    timer: Callable[[Any], Any],
    *,
    storage: str | Path | optuna.storages.BaseStorage | None = None,
    study_name: str = "spectune",
    power: Any = None,
    gpu: str = "cpu",
    progress: bool = True,
) -> StudyResult:
    """Seed grid + held-out points, then adaptive rounds; fit the cost model on the result.

    ``measure_point(spec)`` builds the step to time, ``timer(step)`` returns a Timing; ``power`` is
    an NVML sampler (``available``, ``measure()``) or None.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=open_storage(storage), study_name=study_name, load_if_exists=True, direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=plan.seed),
    )
    first = seed_points(plan) + held_out_points(plan)
    done = finished_records(study)
    adaptive_done = sum(1 for r in done.values() if r.get("phase") == "adaptive")
    total = len(first) + plan.adaptive_trials
    measured = 0
    with _progress(total, min(total, len(done)), progress) as bar:
        _enqueue(study, seed_points(plan), "seed")
        _enqueue(study, held_out_points(plan), "held_out")
        measured += _drain(study, measure_point, timer, power, gpu, bar)
        while adaptive_done < plan.adaptive_trials:
            done = finished_records(study)
            waiting = {str(t.user_attrs.get("key")) for t in _trials(study, TrialState.WAITING)}
            n = min(plan.per_round, plan.adaptive_trials - adaptive_done)
            picks = choose_adaptive(plan, list(done.values()), set(done) | waiting, n)
            if not picks:
                break
            _enqueue(study, picks, "adaptive")
            measured += _drain(study, measure_point, timer, power, gpu, bar)
            adaptive_done = sum(1 for r in finished_records(study).values() if r.get("phase") == "adaptive")
    return _result(study, plan, study_name, measured)


def _result(study: optuna.Study, plan: StudyPlan, name: str, measured: int) -> StudyResult:
    order = {p.key: i for i, p in enumerate(seed_points(plan) + held_out_points(plan))}
    done = finished_records(study)
    records = sorted(done.values(), key=lambda r: (order.get(r["key"], len(order)), r["key"]))
    params = fit_cost_model(records, drafter_kind=plan.drafter_kind, context_len=plan.context_len,
                            overhead_source=plan.overhead_source)
    model = CostModel(params, plan.drafter_kind, plan.context_len)
    modes = {r.get("mode") for r in records if r.get("feasible")}
    return StudyResult(
        study_name=name, records=records, params=params, error=held_out_error(model, records),
        measured_now=measured, timer_mode=modes.pop() if len(modes) == 1 else None,
    )
