"""Several worker processes on one study: journal file and a real PostgreSQL server.

No point measured twice (also when every worker starts at the same instant), no point lost, a
SIGKILLed worker's point failed and re-queued once, the budget never overshot. Assertions are on
point sets and counts, never on time.
"""

import json
import multiprocessing
import os
import signal
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from spectune.autotune.measurement_study import run_study
from tests.autotune import study_workers
from tests.autotune.study_workers import LoggingTimer, same_step, small_plan

SPAWN = multiprocessing.get_context("spawn")
NAME = "shared"
HANG = "target:b=1:q=1"  # the first seed point


@pytest.fixture(params=["journal", pytest.param("postgres", marks=pytest.mark.postgres)])
def shared_storage(request, tmp_path):
    if request.param == "journal":
        return str(tmp_path / "study.journal")
    return request.getfixturevalue("postgres_url")


def expected_phases(tmp_path, **plan_kw):
    """key -> phase of the points one worker measures alone (in memory)."""
    log = str(tmp_path / "alone.log")
    res = run_study(small_plan(**plan_kw), same_step, LoggingTimer(log, 0.0), study_name=NAME, progress=False)
    return {r["key"]: r["phase"] for r in res.records}


def expected_keys(tmp_path, **plan_kw):
    return set(expected_phases(tmp_path, **plan_kw))


def start(storage, log, **kw):
    p = SPAWN.Process(target=study_workers.worker, args=(storage, NAME, str(log), kw.pop("plan_kw", {})), kwargs=kw)
    p.start()
    return p


def wait_for(path, procs, timeout=300):
    deadline = time.monotonic() + timeout  # a guard against a hung test, not a timing assertion
    while not Path(path).exists():
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def join(procs, timeout=600):
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"worker exit code {p.exitcode}"


def measured(logs):
    return Counter(k for log in logs for k in Path(log).read_text().split())


def trials_by_key(storage):
    from spectune.autotune.study_storage import open_storage

    study = optuna.load_study(study_name=NAME, storage=open_storage(storage))
    out: dict[str, list] = {}
    for t in study.get_trials(deepcopy=False):
        out.setdefault(t.user_attrs.get("key"), []).append(t)
    return out


def settled(trials):
    return [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def test_workers_starting_together_measure_each_point_once(shared_storage, tmp_path):
    want = expected_keys(tmp_path)
    barrier = SPAWN.Barrier(3)
    logs = [tmp_path / f"w{i}.log" for i in range(3)]
    procs = [start(shared_storage, log, barrier=barrier) for log in logs]
    join(procs)
    counts = measured(logs)
    assert set(counts) == want and max(counts.values()) == 1  # same point set as one worker, none twice
    assert sum(1 for log in logs if Path(log).read_text()) >= 2  # the work was shared
    by_key = trials_by_key(shared_storage)
    assert set(by_key) == want and all(len(settled(ts)) == 1 for ts in by_key.values())
    assert not [t for ts in by_key.values() for t in ts if t.state == TrialState.FAIL]
    done = [json.loads(Path(f"{log}.done").read_text()) for log in logs]
    assert all(d["points"] == len(want) for d in done) and sum(d["measured"] for d in done) == len(want)


def test_sigkilled_worker_point_is_requeued_once(shared_storage, tmp_path):
    want = expected_keys(tmp_path)
    logs = [tmp_path / f"w{i}.log" for i in range(3)]
    procs = [start(shared_storage, logs[0], hang_key=HANG)]
    wait_for(f"{logs[0]}.hang", procs)  # worker 0 holds the point
    procs += [start(shared_storage, log) for log in logs[1:]]
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join()
    join(procs[1:])
    counts = measured(logs)
    assert set(counts) == want and max(counts.values()) == 1 and HANG not in Path(logs[0]).read_text()
    trials = trials_by_key(shared_storage)
    hang = trials[HANG]
    failed = [t for t in hang if t.state == TrialState.FAIL]
    (retry,) = settled(hang)
    assert len(failed) == 1 and failed[0].user_attrs["worker"]["pid"] == procs[0].pid
    assert retry.system_attrs["retry_history"] == [failed[0].number]
    assert sum(len(settled(ts)) for ts in trials.values()) == small_plan().total_points == len(want)


def test_point_that_kills_its_worker_twice_is_given_up(tmp_path):
    storage = str(tmp_path / "study.journal")
    want = expected_keys(tmp_path)
    logs = [tmp_path / f"w{i}.log" for i in range(3)]
    for log in logs[:2]:  # each worker dies on the point: the first death re-queues it, the second not
        p = start(storage, log, hang_key=HANG)
        wait_for(f"{log}.hang", [p])
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    join([start(storage, logs[2], hang_key=HANG)])
    done = json.loads(Path(f"{logs[2]}.done").read_text())
    assert done["given_up"] == [HANG] and done["points"] == len(want) - 1  # the budget is still spent
    phases = {k: ts[0].user_attrs["phase"] for k, ts in trials_by_key(storage).items()}
    alone = expected_phases(tmp_path)
    # the grid and held-out points are the lone worker's; the adaptive rounds differ (one point is missing)
    assert {k for k, ph in phases.items() if ph != "adaptive"} == {k for k, ph in alone.items() if ph != "adaptive"}
    assert sum(1 for ph in phases.values() if ph == "adaptive") == small_plan().adaptive_trials
    counts = measured(logs)
    assert set(counts) == set(phases) - {HANG} and max(counts.values()) == 1
    hang = trials_by_key(storage)[HANG]
    assert [t.state for t in hang] == [TrialState.FAIL, TrialState.FAIL]


@pytest.mark.postgres
def test_worker_on_another_host_is_failed_by_the_heartbeat(postgres_url, tmp_path):
    want = expected_keys(tmp_path)
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    a = start(postgres_url, logs[0], hang_key=HANG, host="host-a")
    wait_for(f"{logs[0]}.hang", [a])
    b = start(postgres_url, logs[1], host="host-b")  # cannot judge host-a's process: waits for its heartbeat
    os.kill(a.pid, signal.SIGKILL)
    a.join()
    join([b])
    counts = measured(logs)
    assert set(counts) == want and max(counts.values()) == 1
    (retry,) = settled(trials_by_key(postgres_url)[HANG])
    assert retry.user_attrs["worker"]["host"] == "host-b" and len(retry.system_attrs["retry_history"]) == 1


def test_worker_killed_between_ask_and_naming_itself_is_reaped_at_once(tmp_path):
    from spectune.autotune.measurement_study import open_study
    from spectune.autotune.study_claims import DISTS, key_states, reap_dead, worker_identity

    h = open_study(small_plan(), storage=str(tmp_path / "s.journal"), study_name=NAME)
    trial = h.study.ask(DISTS)  # what ``claim`` does before it names the worker: then SIGKILL
    key = trial.user_attrs["key"]
    assert reap_dead(h.study, h.lock, worker_identity(), h.requeue) == [key]
    states = key_states(h.study)
    assert key in states.waiting and key not in states.running
    assert reap_dead(h.study, h.lock, worker_identity(), h.requeue) == []  # re-queued once, not again
