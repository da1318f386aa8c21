"""``spectune status``: where the measurement studies in one storage stand.

Per study: points done (settled: measured or infeasible), claimed (a worker measures them now),
waiting, given up (their worker died twice), remaining (the plan's total, plus any held-out
replacements, minus done and given up), not needed (adaptive budget left when the adaptive phase
found nothing more to choose: done + given up + remaining + not needed = total), per worker (points
done, the point it measures now, its last finished point), and an ETA: the median seconds per
finished point x remaining points / the workers measuring now. Reading writes nothing to the storage.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from spectune.autotune.measurement_plan import StudyError, StudyPlan, held_out_points
from spectune.autotune.measurement_study import plan_from_identity
from spectune.autotune.study_claims import COMPLETE_ATTR, IDENTITY_ATTR, key_states
from spectune.autotune.study_storage import open_storage


@dataclass
class WorkerStatus:
    id: str
    done: int = 0
    measuring: str | None = None  # key of the point it holds now
    last: datetime.datetime | None = None  # when it finished its last point


@dataclass
class StudyStatus:
    name: str
    gpu: str
    workload: str
    total: int
    done: int  # infeasible ones included
    claimed: int
    waiting: int
    given_up: list[str]
    workers: list[WorkerStatus] = field(default_factory=list)
    point_s: float | None = None  # median seconds per finished point
    eta_s: float | None = None  # None: nothing finished yet, or no worker measuring
    infeasible: int = 0  # of done: the points that did not fit (PRUNED)

    finished: bool = False  # a worker found nothing left to choose (the adaptive phase may end early)

    @property
    def remaining(self) -> int:
        if self.finished:
            return self.claimed + self.waiting
        return max(0, self.total - self.done - len(self.given_up))

    @property
    def not_needed(self) -> int:
        """The adaptive budget left unspent when the study finished early (0 until it finished)."""
        return max(0, self.total - self.done - len(self.given_up) - self.remaining)

    @property
    def complete(self) -> bool:
        return self.remaining == 0 and self.claimed == 0 and self.waiting == 0


def _workload(ident: dict[str, Any]) -> str:
    return (f"{ident.get('target')} + {ident.get('drafter')}, {ident.get('dtype')}, context {ident.get('context_len')}, "
            f"batch {ident.get('batch_sizes')}, K <= {ident.get('max_k')}, seed {ident.get('seed')}")


def _total(plan: StudyPlan, held_keys: int) -> int:
    """The plan's points plus the held-out replacements enqueued so far (for infeasible ones)."""
    return plan.total_points + max(0, held_keys - len(held_out_points(plan)))


def one_status(study: optuna.Study) -> StudyStatus:
    ident = study.user_attrs[IDENTITY_ATTR]
    states = key_states(study)
    workers: dict[str, WorkerStatus] = {}
    seconds = []
    for t in states.settled.values():
        wid = str((t.user_attrs.get("worker") or {}).get("id", "?"))
        w = workers.setdefault(wid, WorkerStatus(wid))
        w.done += 1
        if t.datetime_complete is not None:
            w.last = max(w.last or t.datetime_complete, t.datetime_complete)
            if t.datetime_start is not None:
                seconds.append((t.datetime_complete - t.datetime_start).total_seconds())
    for key, t in states.running.items():
        wid = str((t.user_attrs.get("worker") or {}).get("id", "?"))
        workers.setdefault(wid, WorkerStatus(wid)).measuring = key
    st = StudyStatus(name=study.study_name, gpu=str(ident.get("gpu")), workload=_workload(ident),
                     total=_total(plan_from_identity(ident), states.count("held_out")), done=len(states.settled),
                     claimed=len(states.running), waiting=len(states.waiting), given_up=sorted(states.given_up),
                     workers=sorted(workers.values(), key=lambda w: w.id),
                     finished=COMPLETE_ATTR in study.user_attrs,
                     infeasible=sum(t.state == TrialState.PRUNED for t in states.settled.values()))
    if seconds:
        st.point_s = statistics.median(seconds)
        if st.claimed:
            st.eta_s = st.point_s * st.remaining / st.claimed
    return st


def study_status(storage: str | Path, study_name: str | None = None) -> list[StudyStatus]:
    """Every spectune measurement study in the storage (or the named one)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = open_storage(storage, create=False)
    names = [s.study_name for s in st.get_all_studies()]
    if study_name is not None:
        if study_name not in names:
            raise StudyError(f"--study-name: no study {study_name!r} in {storage} (there: {', '.join(names) or 'none'})")
        names = [study_name]
    out = []
    for name in names:
        study = optuna.load_study(study_name=name, storage=st)
        if IDENTITY_ATTR in study.user_attrs:
            out.append(one_status(study))
    return out

