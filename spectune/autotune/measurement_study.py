"""The measurement study: an Optuna study in which each trial is one measured point.

Design
- The points and their choice are :mod:`spectune.autotune.measurement_plan`'s; the storage and
  its claim lock :mod:`spectune.autotune.study_storage`'s; how workers claim points, fail a dead
  worker's trial and re-queue it once :mod:`spectune.autotune.study_claims`'.
- Trials carry the point as params (``kind``, ``batch``, ``size``; fixed distributions) and as
  user attrs; the result (ms, p20/p80, capture cost, NVML energy/power/clock/throttle, feasible)
  is user attr ``result``; ``worker`` and ``gpu`` say who measured it on which GPU (name, UUID,
  driver, clocks, power limit). Feasible points are COMPLETE with value = ms; infeasible ones (out
  of memory / resources) are PRUNED with ``feasible = False`` and never fitted.
- Timing: a worker that shares its GPU with others (local ``--workers``, another study, another
  ``spectune profile``) takes the GPU's timing lock around each whole point (building its inputs,
  capturing, warming up and timing it) and around building its models
  (:mod:`spectune.autotune.timing_lock`); claims and storage writes overlap. The NVML meter runs
  around the timed replays alone.
- Phases: ``open_study`` writes or checks the study's identity and enqueues the seed grid and the
  held-out points; ``work`` claims and measures points until none is waiting or running and the
  adaptive budget is spent (a worker that finds the queue empty while others still measure waits:
  each adaptive round is chosen from the finished points only, so N workers measure the same
  points as one; a held-out point found infeasible is first replaced, in rounds chosen the same
  way, up to ``held_out_budget`` held-out keys); ``collect`` fits the cost model on the finished
  points.
- Resume and sharing: every worker opens the study with ``load_if_exists=True``; any number of
  workers (processes, GPUs, hosts) may join at any time. The study name encodes GPU and workload
  (:func:`study_name_for`), so several GPUs can share one storage (a journal file on one host, a
  PostgreSQL URL across hosts).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from spectune.autotune.fit import fit_cost_model, held_out_error
from spectune.autotune.measurement_plan import (
    KINDS,
    PointSpec,
    StudyError,
    StudyPlan,
    best_k_by_batch,
    choose_adaptive,
    default_tiers,
    drafter_point,
    grid_batches,
    held_out_budget,
    held_out_points,
    held_out_replacements,
    seed_points,
    target_point,
)
from spectune.autotune.study_claims import (
    ACTIVE_RUNS,
    COMPLETE_ATTR,
    HARDWARE_ATTR,
    IDENTITY_ATTR,
    RequeueOnce,
    check_identity,
    claim,
    enqueue,
    finished_records,
    interrupted,
    key_states,
    reap_dead,
    spec_from_attrs,
    worker_identity,
)
from spectune.autotune.study_storage import GRACE_S, HEARTBEAT_S, ClaimLock, heartbeat, open_storage
from spectune.autotune.timing import InfeasiblePoint, free_device_memory, is_out_of_memory
from spectune.autotune.timing_lock import Hold, TimingLock
from spectune.runtime.costs import CostModel
from spectune.runtime.table import CostError, CostModelParams

__all__ = [
    "GRACE_S", "HEARTBEAT_S", "KINDS", "InfeasiblePoint", "PointSpec", "StudyError", "StudyHandle", "StudyPlan", "StudyResult",
    "best_k_by_batch", "choose_adaptive", "collect", "default_tiers", "drafter_point", "finished_records",
    "grid_batches", "held_out_points", "key_states", "measure", "open_storage", "open_study", "plan_identity", "run_study",
    "seed_points", "study_name_for", "target_point", "work", "load_for_collect", "stored_identity",
    "plan_from_identity",
]

POLL_S = 0.2  # how often a worker with nothing to claim looks again


@dataclass(frozen=True)
class StudyResult:
    study_name: str
    records: list[dict[str, Any]]  # one per measured point (feasible or not), seed order
    params: CostModelParams
    error: CostError
    measured_now: int  # points this call measured
    timer_mode: str | None = None
    kept: int = 0  # points already in the study when this call opened it (resumed)
    given_up: tuple[str, ...] = ()  # points whose worker died twice (re-queued once)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StudyHandle:
    study: optuna.Study
    plan: StudyPlan
    storage: optuna.storages.BaseStorage
    lock: ClaimLock
    requeue: RequeueOnce
    kept: int  # settled points when opened
    created: bool  # this call wrote the study's identity

    @property
    def name(self) -> str:
        return self.study.study_name


def study_name_for(gpu: str, target: str, drafter: str, dtype: str, context_len: int, max_k: int) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-")
    return f"spectune-{slug}-{target}-{drafter}-{dtype}-c{context_len}-k{max_k}"


def plan_identity(plan: StudyPlan) -> dict[str, Any]:
    """The plan's part of a study's identity: every setting that changes which points exist."""
    from spectune import __version__

    return {"spectune": __version__, "batch_sizes": _ranges(plan.batch_sizes), "max_k": plan.max_k,
            "context_len": plan.context_len, "seed": plan.seed, "trials": plan.adaptive_trials,
            "held_out": plan.held_out, "tiers": list(plan.tiers), "overhead_source": plan.overhead_source,
            "per_round": plan.per_round, "drafter_kind": plan.drafter_kind}


def _ranges(sizes: tuple[int, ...]) -> str:
    """(1, 2, 3, 8) -> '1-3,8'."""
    parts: list[str] = []
    start = prev = sizes[0]
    for s in (*sizes[1:], None):
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ",".join(parts)


# ---------------------------------------------------------------------------------------------
# opening


def open_study(plan: StudyPlan, *, storage: str | Path | optuna.storages.BaseStorage | None = None,
               study_name: str = "spectune", identity: dict[str, Any] | None = None,
               hardware: dict[str, Any] | None = None, heartbeat_s: int = HEARTBEAT_S,
               grace_s: int = GRACE_S) -> StudyHandle:
    """Create or load the study, check its identity, enqueue the seed and held-out points."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    requeue = RequeueOnce()
    st = open_storage(storage, heartbeat_s=heartbeat_s, grace_s=grace_s, on_stale=requeue)
    study = optuna.create_study(storage=st, study_name=study_name, load_if_exists=True, direction="minimize",
                                sampler=optuna.samplers.RandomSampler(seed=plan.seed))
    lock = ClaimLock(st, study_name)
    requeue.lock = lock
    created = check_identity(study, {**plan_identity(plan), **(identity or {})}, hardware, lock)
    with lock:
        kept = len(finished_records(study))
        enqueue(study, seed_points(plan), "seed", lock)
        enqueue(study, held_out_points(plan), "held_out", lock)
    return StudyHandle(study, plan, st, lock, requeue, kept, created)


# ---------------------------------------------------------------------------------------------
# measuring


def measure(spec: PointSpec, measure_point: Callable[[PointSpec], Any], timer: Callable[..., Any],
            power: Any = None, gpu_lock: TimingLock | None = None) -> dict[str, Any]:
    """Time one point; out-of-memory / out-of-resources becomes ``feasible: False``.

    The whole point runs under the GPU's timing lock (when there is one): building its inputs and
    capturing its graph run kernels too (random fills, the capture's warm-up), and on an H200 two
    workers that overlapped those with each other's timed replays fitted a model 4.9 % off one
    worker's. A timer with ``phased = True`` gets a ``Hold`` that runs the NVML meter around its
    timed stretch; any other timer is metered whole."""
    reason = None
    hold = Hold(None, power)  # the lock is taken here, around the whole point
    held = gpu_lock.held() if gpu_lock is not None else contextlib.nullcontext(0.0)
    try:
        with held as waited:
            hold.waited_s = waited
            step = measure_point(spec)
            if getattr(timer, "phased", False):
                timing = timer(step, hold)
            else:
                with hold("timed"):
                    timing = timer(step)
            reading = hold.reading
            del step
    except Exception as exc:  # building the step can run out of memory too, outside the timer
        if not isinstance(exc, InfeasiblePoint | MemoryError) and not is_out_of_memory(exc):
            raise
        text = str(exc).strip()
        reason = text.splitlines()[0][:200] if text else type(exc).__name__
    if reason is not None:
        free_device_memory()  # outside the except block: the failed frames are gone by now
        return {"feasible": False, "error": reason, "ms": None}
    res: dict[str, Any] = {"feasible": True, "error": None,
                           "lock_wait_s": round(hold.waited_s, 4) if gpu_lock is not None else None}
    for name in ("median_ms", "p20_ms", "p80_ms", "reps", "mode", "capture_s", "capture_mib"):
        res[name] = getattr(timing, name, None)
    res["ms"] = float(res.pop("median_ms"))
    for src, dst in (("energy_j", "joules"), ("mean_power_w", "power_w"), ("max_power_w", "max_power_w"),
                     ("sm_clock_mhz", "sm_clock_mhz"), ("throttle_reasons", "throttle"), ("throttle_names", "throttle_names")):
        val = getattr(reading, src, None)
        res[dst] = list(val) if isinstance(val, list | tuple) else val
    return res


def _measure_trial(h: StudyHandle, trial: optuna.Trial, measure_point: Callable[[PointSpec], Any],
                   timer: Callable[..., Any], power: Any, gpu_name: str, gpu_lock: TimingLock | None) -> None:
    try:
        with heartbeat(h.storage, trial._trial_id):  # the id Optuna's own heartbeat thread uses
            res = measure(spec_from_attrs(trial.user_attrs), measure_point, timer, power, gpu_lock)
    except BaseException as exc:
        with contextlib.suppress(Exception):  # storage gone too: the next worker finds the trial dead
            interrupted(h.study, trial, f"{type(exc).__name__}: {exc}", h.lock)
        raise
    trial.set_user_attr("result", {**res, "gpu": gpu_name})  # one write per point
    if res["feasible"]:
        h.study.tell(trial, res["ms"])
    else:
        h.study.tell(trial, state=TrialState.PRUNED)


def _next_round(h: StudyHandle) -> str:
    """'more' (points wait), 'wait' (others still measure), or 'done'; enqueues an adaptive round
    when the previous one has finished."""
    plan = h.plan
    with h.lock:
        states = key_states(h.study)
        if states.waiting:
            return "more"
        if states.running:
            return "wait"
        records = list(finished_records(h.study).values())
        held = held_out_replacements(plan, records, set(states.phases))
        if held and enqueue(h.study, held, "held_out", h.lock, budget=held_out_budget(plan)):
            return "more"
        spent = states.count("adaptive")
        picks = []
        if spent < plan.adaptive_trials:
            picks = choose_adaptive(plan, records, set(states.phases), min(plan.per_round, plan.adaptive_trials - spent))
        if picks and enqueue(h.study, picks, "adaptive", h.lock, budget=plan.adaptive_trials):
            return "more"
        if COMPLETE_ATTR not in h.study.user_attrs:
            h.study.set_user_attr(COMPLETE_ATTR, len(states.settled))
        return "done"


def work(h: StudyHandle, measure_point: Callable[[PointSpec], Any], timer: Callable[..., Any], *,
         power: Any = None, gpu: str = "cpu", gpu_info: dict[str, Any] | None = None, progress: bool = True,
         poll_s: float = POLL_S, gpu_lock: TimingLock | None = None) -> int:
    """Claim and measure points until the study is complete; returns how many this worker measured.

    ``measure_point(spec)`` builds the step to time, ``timer(step)`` returns a Timing; ``power`` is
    an NVML sampler (``available``, ``measure()``) or None; ``gpu_info`` is recorded on every trial;
    ``gpu_lock`` is the GPU's timing lock (:mod:`spectune.autotune.timing_lock`) or None.
    """
    me = worker_identity()
    info = gpu_info or {"name": gpu}
    measured = 0
    ACTIVE_RUNS.add(me["run"])
    with contextlib.ExitStack() as stack:
        stack.callback(ACTIVE_RUNS.discard, me["run"])
        bar = stack.enter_context(_progress(h.plan.total_points, h.kept, progress))
        while True:
            reap_dead(h.study, h.lock, me, h.requeue)
            trial = claim(h.study, h.lock, me, info)
            if trial is not None:
                _measure_trial(h, trial, measure_point, timer, power, gpu, gpu_lock)
                measured += 1
                bar.update(1)
                continue
            step = _next_round(h)
            if step == "done":
                break
            if step == "wait":
                time.sleep(poll_s)
    return measured


@contextlib.contextmanager
def _progress(total: int, initial: int, enabled: bool) -> Iterator[Any]:
    from tqdm.auto import tqdm

    with tqdm(total=total, initial=min(total, initial), disable=not enabled, desc="measuring", unit="pt",
              leave=False) as bar:
        yield bar


# ---------------------------------------------------------------------------------------------
# result


def collect(h: StudyHandle, measured: int = 0) -> StudyResult:
    """Fit the cost model on the finished points; refuses a study still measuring or mixing GPUs."""
    states = key_states(h.study)
    if states.waiting or states.running:
        raise StudyError(f"study {h.name!r} is not complete: {len(states.running)} points claimed, "
                         f"{len(states.waiting)} waiting (`spectune status` shows the workers)")
    plan = h.plan
    order = {p.key: i for i, p in enumerate(seed_points(plan) + held_out_points(plan))}
    done = finished_records(h.study)
    # the planned points, then held-out replacements, then adaptive points
    records = sorted(done.values(), key=lambda r: (order.get(r["key"], len(order) + (r.get("phase") != "held_out")),
                                                   r["key"]))
    gpus: dict[str, int] = {}
    for r in records:
        gpus[str(r.get("gpu"))] = gpus.get(str(r.get("gpu")), 0) + 1
    if len(gpus) > 1:
        seen = ", ".join(f"{g}: {n} points" for g, n in sorted(gpus.items()))
        raise StudyError(f"study {h.name!r} mixes GPU models ({seen}): a profile is one GPU's, never an average")
    params = fit_cost_model(records, drafter_kind=plan.drafter_kind, context_len=plan.context_len,
                            overhead_source=plan.overhead_source)
    model = CostModel(params, plan.drafter_kind, plan.context_len)
    modes = {r.get("mode") for r in records if r.get("feasible")}
    return StudyResult(
        study_name=h.name, records=records, params=params, error=held_out_error(model, records),
        measured_now=measured, timer_mode=modes.pop() if len(modes) == 1 else None, kept=h.kept,
        given_up=tuple(sorted(states.given_up)),
    )


def run_study(
    plan: StudyPlan,
    measure_point: Callable[[PointSpec], Any],
    timer: Callable[..., Any],
    *,
    storage: str | Path | optuna.storages.BaseStorage | None = None,
    study_name: str = "spectune",
    power: Any = None,
    gpu: str = "cpu",
    gpu_info: dict[str, Any] | None = None,
    identity: dict[str, Any] | None = None,
    hardware: dict[str, Any] | None = None,
    progress: bool = True,
    heartbeat_s: int = HEARTBEAT_S,
    grace_s: int = GRACE_S,
    gpu_lock: TimingLock | None = None,
) -> StudyResult:
    """One worker: open (or join) the study, measure until it is complete, fit the cost model."""
    h = open_study(plan, storage=storage, study_name=study_name, identity=identity, hardware=hardware,
                   heartbeat_s=heartbeat_s, grace_s=grace_s)
    n = work(h, measure_point, timer, power=power, gpu=gpu, gpu_info=gpu_info, progress=progress, gpu_lock=gpu_lock)
    return collect(h, n)


# ---------------------------------------------------------------------------------------------
# an existing study


def _parse_ranges(text: str) -> tuple[int, ...]:
    sizes: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        sizes.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(sizes))


def plan_from_identity(ident: dict[str, Any]) -> StudyPlan:
    return StudyPlan(batch_sizes=_parse_ranges(ident["batch_sizes"]), max_k=ident["max_k"],
                     drafter_kind=ident["drafter_kind"], context_len=ident["context_len"],
                     adaptive_trials=ident["trials"], held_out=ident["held_out"], per_round=ident["per_round"],
                     seed=ident["seed"], tiers=tuple(ident["tiers"]), overhead_source=ident["overhead_source"])


def _load(storage: str | Path | optuna.storages.BaseStorage, study_name: str) -> tuple[optuna.Study, optuna.storages.BaseStorage] | None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = open_storage(storage)
    if study_name not in {s.study_name for s in st.get_all_studies()}:
        return None
    return optuna.load_study(study_name=study_name, storage=st), st


def stored_identity(storage: str | Path | optuna.storages.BaseStorage, study_name: str) -> dict[str, Any] | None:
    """The identity of an existing study (None when there is no such study)."""
    loaded = _load(storage, study_name)
    return None if loaded is None else loaded[0].user_attrs.get(IDENTITY_ATTR)


def load_for_collect(storage: str | Path | optuna.storages.BaseStorage,
                     study_name: str) -> tuple[StudyHandle, dict[str, Any], dict[str, Any] | None]:
    """An existing study to fit, its identity and the hardware facts of the GPU it measured (a
    storage that does not exist is an error: nothing is created)."""
    if isinstance(storage, str | Path):
        open_storage(storage, create=False)  # a missing journal or SQLite file: one line, no file made
    loaded = _load(storage, study_name)
    if loaded is None:
        raise StudyError(f"--study-name: no study {study_name!r} in {storage} (`spectune status --storage "
                         f"{storage}` lists them)")
    study, st = loaded
    ident = study.user_attrs.get(IDENTITY_ATTR)
    if ident is None:
        raise StudyError(f"study {study_name!r} has no spectune identity: not a spectune measurement study")
    lock = ClaimLock(st, study_name)
    h = StudyHandle(study, plan_from_identity(ident), st, lock, RequeueOnce(lock), len(finished_records(study)),
                    False)
    return h, ident, study.user_attrs.get(HARDWARE_ATTR)


def hardware_dict(hardware: Any) -> dict[str, Any]:
    return asdict(hardware)
