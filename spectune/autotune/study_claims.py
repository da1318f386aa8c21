"""Claiming points among many workers: identity, the point queue, dead workers.

Every trial is one point; its ``key`` (``target:b=4:q=2``) is a user attr. A key is
- **settled** when one of its trials is COMPLETE (feasible) or PRUNED (infeasible),
- **live** when one is WAITING (enqueued) or RUNNING (claimed by a worker),
- **given up** when a dead worker's re-queued trial failed again (re-queued once, never twice).
Under the claim lock (:class:`~spectune.autotune.study_storage.ClaimLock`) a key is enqueued only
when it is none of these, and a worker claims (``study.ask``) only while a WAITING trial exists —
so a key has at most one live trial and no point is measured twice, however many workers start
at the same instant. A clean interruption (Ctrl-C, an error) fails the trial and puts the point
back at once; a worker that dies (SIGKILL, a lost host) leaves a RUNNING trial that another worker
fails — by process id on the same host, by Optuna's heartbeat on an RDB — and re-queues once with
``RetryHeartbeatStaleTrialCallback(max_retry=1)``.

The study's identity (study user attr ``spectune``: every option that changes the points, the
spectune version and the GPU model) is written by the first worker; a worker whose identity
differs is refused with the differing options named.
"""

from __future__ import annotations

import copy
import os
import socket
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from spectune.autotune.measurement_plan import KINDS, PointSpec, StudyError
from spectune.autotune.study_storage import ClaimLock

IDENTITY_ATTR = "spectune"
HARDWARE_ATTR = "spectune_hardware"

DISTS = {
    "kind": CategoricalDistribution(KINDS),
    "batch": IntDistribution(1, 1 << 20),
    "size": IntDistribution(0, 1 << 24),
}

DERIVED = ("tiers", "drafter_kind", "per_round", "overhead_source", "attention")
COMPLETE_ATTR = "spectune_complete"  # set when a worker found nothing left to measure

# identity key -> the option a person sets it with (for the refusal line)
OPTION_NAMES = {
    "gpu": "the GPU model", "spectune": "the spectune version", "target": "--target", "drafter": "--drafter",
    "dtype": "--dtype", "context_len": "--context-len", "batch_sizes": "--batch-sizes", "max_k": "--max-k",
    "seed": "--seed", "trials": "--trials", "held_out": "held-out points", "device": "the device type",
    "tiers": "the tier list", "overhead_source": "the overhead source", "fused": "--fused",
}


# ---------------------------------------------------------------------------------------------
# who is measuring


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (Linux), None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        if not os.path.exists("/proc/self/stat"):  # no procfs: the pid alone must do
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                return 0
            return 0
        return None


ACTIVE_RUNS: set[str] = set()  # run tokens of the ``work`` calls alive in this process


def worker_identity() -> dict[str, Any]:
    """Host (``$SPECTUNE_HOST`` or the host name), boot id, pid, process start and a token of this
    run (a trial left RUNNING by an earlier run in this same process is a dead worker's too)."""
    pid = os.getpid()
    host = os.environ.get("SPECTUNE_HOST") or socket.gethostname()
    return {"id": f"{host}:{pid}", "host": host, "boot": _boot_id(), "pid": pid, "start": process_start(pid),
            "run": uuid.uuid4().hex[:12]}


def _worker_dead(worker: dict[str, Any], me: dict[str, Any]) -> bool:
    """Judged by process id only for a worker on this host (same boot); else the heartbeat decides."""
    if worker.get("host") != me["host"] or worker.get("boot") != me["boot"]:
        return False
    if worker.get("pid") == me["pid"] and worker.get("start") == me["start"]:
        return worker.get("run") not in ACTIVE_RUNS
    start = process_start(int(worker["pid"]))
    return start is None or (worker.get("start") is not None and start != worker["start"])


# ---------------------------------------------------------------------------------------------
# the state of every key


@dataclass
class KeyStates:
    settled: dict[str, FrozenTrial] = field(default_factory=dict)  # key -> first COMPLETE/PRUNED trial
    waiting: dict[str, FrozenTrial] = field(default_factory=dict)
    running: dict[str, FrozenTrial] = field(default_factory=dict)
    given_up: set[str] = field(default_factory=set)
    phases: dict[str, str] = field(default_factory=dict)  # key -> phase, every key ever enqueued

    def eligible(self, key: str) -> bool:
        return not (key in self.settled or key in self.waiting or key in self.running or key in self.given_up)

    def count(self, phase: str) -> int:
        return sum(1 for p in self.phases.values() if p == phase)


def key_states(study: optuna.Study) -> KeyStates:
    s = KeyStates()
    for t in study.get_trials(deepcopy=False):
        key = t.user_attrs.get("key")
        if key is None:
            continue
        s.phases.setdefault(key, t.user_attrs.get("phase", "seed"))
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "result" in t.user_attrs:
            s.settled.setdefault(key, t)
        elif t.state == TrialState.WAITING:
            s.waiting.setdefault(key, t)
        elif t.state == TrialState.RUNNING:
            s.running.setdefault(key, t)
        elif (t.state == TrialState.FAIL and t.system_attrs.get("retry_history")
              and "interrupted" not in t.user_attrs and "duplicate_of" not in t.user_attrs):
            s.given_up.add(key)
    for key in list(s.given_up):
        if key in s.settled or key in s.waiting or key in s.running:
            s.given_up.discard(key)
    return s


def spec_attrs(p: PointSpec, phase: str) -> dict[str, Any]:
    return {"key": p.key, "phase": phase, "kind": p.kind, "batch": p.batch, "tokens": p.tokens,
            "q": p.q, "k": p.k, "held_out": p.held_out}


def spec_from_attrs(a: dict[str, Any]) -> PointSpec:
    return PointSpec(a["kind"], a["batch"], a["tokens"], q=a["q"], k=a["k"], held_out=a["held_out"])


def finished_records(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """key -> result attrs of the settled trial of that key (feasible or not)."""
    out: dict[str, dict[str, Any]] = {}
    for key, t in key_states(study).settled.items():
        rec = {**t.user_attrs, **t.user_attrs["result"]}
        del rec["result"]
        gpu, worker = t.user_attrs.get("gpu"), t.user_attrs.get("worker")
        rec["gpu_uuid"] = gpu.get("uuid") if isinstance(gpu, dict) else None
        rec["worker"] = worker.get("id") if isinstance(worker, dict) else None
        rec["seconds"] = ((t.datetime_complete - t.datetime_start).total_seconds()
                          if t.datetime_complete and t.datetime_start else None)
        out[key] = rec
    return out


# ---------------------------------------------------------------------------------------------
# identity


def check_identity(study: optuna.Study, identity: dict[str, Any], hardware: dict[str, Any] | None,
                   lock: ClaimLock) -> bool:
    """Write the identity on a new study; refuse a study whose identity differs. True if new."""
    with lock:
        stored = study.user_attrs.get(IDENTITY_ATTR)
        if stored is None:
            if any(t.user_attrs.get("key") for t in study.get_trials(deepcopy=False)):
                raise StudyError(f"study {study.study_name!r} holds points but no spectune identity (an older "
                                 f"spectune wrote it): use another --study-name")
            study.set_user_attr(IDENTITY_ATTR, identity)
            if hardware is not None:
                study.set_user_attr(HARDWARE_ATTR, hardware)
            return True
    if stored.get("gpu") != identity.get("gpu"):
        raise StudyError(f"study {study.study_name!r} is measured on {stored.get('gpu')}; this worker's GPU is "
                         f"{identity.get('gpu')}: a study never mixes GPU models (leave --study-name out for one "
                         f"per GPU)")
    diff = [k for k in sorted(set(stored) | set(identity)) if stored.get(k) != identity.get(k)]
    primary = [k for k in diff if k not in DERIVED]
    diff = primary or diff  # the tiers follow from --batch-sizes: name the option, not its consequence
    if diff:
        parts = "; ".join(f"{OPTION_NAMES.get(k, k)} {stored.get(k)!r} there, {identity.get(k)!r} here" for k in diff)
        raise StudyError(f"study {study.study_name!r} was measured with other settings ({parts}): use another "
                         f"--study-name or --out for a new study, or the same settings to resume")
    return False


# ---------------------------------------------------------------------------------------------
# queue


def enqueue(study: optuna.Study, points: Sequence[PointSpec], phase: str, lock: ClaimLock,
            budget: int | None = None) -> int:
    """Enqueue the eligible points (at most ``budget`` keys of this phase in all); returns how many."""
    new = 0
    with lock:
        states = key_states(study)
        room = None if budget is None else budget - states.count(phase)
        for p in points:
            if room is not None and new >= room:
                break
            if states.eligible(p.key):
                study.enqueue_trial({"kind": p.kind, "batch": p.batch, "size": p.size},
                                    user_attrs=spec_attrs(p, phase), skip_if_exists=False)
                states.waiting[p.key] = None  # type: ignore[assignment]
                states.phases.setdefault(p.key, phase)
                new += 1
    return new


def claim(study: optuna.Study, lock: ClaimLock, me: dict[str, Any], gpu: dict[str, Any]) -> optuna.Trial | None:
    """Claim one waiting point (None if none waits). A trial whose key is settled or claimed
    elsewhere (only a study written without this lock has such) is failed as a duplicate."""
    with lock:
        while True:
            states = key_states(study)
            if not states.waiting:
                return None
            with warnings.catch_warnings():  # we run the heartbeat around ask/tell ourselves
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                trial = study.ask(DISTS)
            key = trial.user_attrs.get("key")
            if key is None:  # the queue emptied under a process that ignores the lock
                trial.set_user_attr("duplicate_of", "no point")
                study.tell(trial, state=TrialState.FAIL)
                return None
            other = states.settled.get(key) or states.running.get(key)
            if other is not None:
                trial.set_user_attr("duplicate_of", other.number)
                study.tell(trial, state=TrialState.FAIL)
                continue
            trial.set_user_attr("worker", me)
            trial.set_user_attr("gpu", gpu)
            return trial


def interrupted(study: optuna.Study, trial: optuna.Trial, reason: str, lock: ClaimLock) -> None:
    """A clean stop of this worker mid-point: fail the trial and put its point back at once."""
    with lock:
        trial.set_user_attr("interrupted", reason[:200])
        study.tell(trial, state=TrialState.FAIL)
        enqueue(study, [spec_from_attrs(trial.user_attrs)], trial.user_attrs.get("phase", "seed"), lock)


class RequeueOnce:
    """``heartbeat_stale_trial_callback``: re-queue a dead worker's point once, under the lock."""

    def __init__(self, lock: ClaimLock | None = None) -> None:
        self.lock = lock
        self.requeued: list[str] = []

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        key = trial.user_attrs.get("key")
        if key is None or self.lock is None:
            return
        with self.lock:
            states = key_states(study)
            if key in states.settled or key in states.waiting or key in states.running:
                return
            point = copy.copy(trial)
            point.user_attrs = {k: v for k, v in trial.user_attrs.items() if k in spec_attrs_keys()}
            before = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                RetryHeartbeatStaleTrialCallback(max_retry=1)(study, point)
            if len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,))) > before:
                self.requeued.append(key)


def spec_attrs_keys() -> tuple[str, ...]:
    return ("key", "phase", "kind", "batch", "tokens", "q", "k", "held_out")


def reap_dead(study: optuna.Study, lock: ClaimLock, me: dict[str, Any], requeue: RequeueOnce) -> list[str]:
    """Fail the RUNNING trials of dead workers and re-queue each point once; returns their keys."""
    from optuna.storages import fail_stale_trials

    reaped: list[str] = []
    with lock:
        before = len(requeue.requeued)
        with warnings.catch_warnings():  # experimental since Optuna 2.9, stable in use
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            fail_stale_trials(study)  # RDB heartbeat: calls ``requeue`` for each trial it failed
        reaped += requeue.requeued[before:]
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            worker = t.user_attrs.get("worker")
            if worker is None:
                # ``claim`` asks and names the worker under this lock, so a RUNNING trial without a
                # worker seen here was claimed by a process that died in between (a SIGKILL landed
                # between the two journal appends); any process that joined the study checked its
                # identity (the spectune version) and uses the same lock
                if t.user_attrs.get("key") is None:
                    continue
            elif worker.get("run") == me["run"] or not _worker_dead(worker, me):
                continue
            try:
                study.tell(t.number, state=TrialState.FAIL)
            except (ValueError, RuntimeError):  # finished meanwhile
                continue
            requeue(study, study.get_trials(deepcopy=False)[t.number])
            reaped.append(str(t.user_attrs.get("key")))
    return reaped
