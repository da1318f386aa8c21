"""``spectune profile --workers N``: N local processes measuring one study.

The parent opens the study (identity, seed and held-out points), starts N workers and
waits; each worker joins the study on its own device and measures until the study is complete
(:func:`spectune.autotune.profiler.measure_for_study`). On CUDA, worker i runs on visible GPU
``i mod count`` (its ``CUDA_VISIBLE_DEVICES`` names that one GPU) unless ``--device cuda:N`` pins
them all; the visible GPUs must be one model. On CPU the workers are N processes of one thread.
A worker that dies loses only its claimed point (another worker fails and re-queues it); the
parent reports a study left incomplete when every worker has exited.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
from dataclasses import replace
from typing import Any

import torch

from spectune.autotune.measurement_study import StudyHandle, key_states, open_study
from spectune.errors import SpectuneError


class WorkersError(SpectuneError):
    """Local workers could not run or left the study incomplete."""


def worker_count(requested: int, device: torch.device) -> int:
    """0 (auto): one per visible GPU on CUDA, one on CPU."""
    if requested > 0:
        return requested
    return max(1, torch.cuda.device_count()) if device.type == "cuda" else 1


def visible_gpus(device: torch.device) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries the workers spread over (one entry when pinned by cuda:N)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in env.split(",") if e.strip()] if env else [
        str(i) for i in range(torch.cuda.device_count())]
    if device.index is not None:
        entries, names = entries[device.index:device.index + 1], {torch.cuda.get_device_name(device.index)}
    else:
        names = {torch.cuda.get_device_name(i) for i in range(len(entries))}
    if len(names) > 1:
        raise WorkersError(f"--workers: the visible GPUs are different models ({', '.join(sorted(names))}): a study "
                           f"is one GPU model's; set CUDA_VISIBLE_DEVICES to GPUs of one model")
    return entries


def worker_main(s: Any, index: int, gpu: str | None, timer: Any, measure_point: Any,
                heartbeat_s: int, grace_s: int) -> None:
    """One spawned worker (module-level so it pickles)."""
    from spectune.autotune.profiler import measure_for_study

    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before CUDA initialises in this process
    try:
        measure_for_study(s, timer=timer, measure_point=measure_point, heartbeat_s=heartbeat_s, grace_s=grace_s)
    except SpectuneError as exc:
        print(f"spectune profile: worker {index}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def run_local_workers(s: Any, *, timer: Any = None, measure_point: Any = None, heartbeat_s: int,
                      grace_s: int) -> tuple[StudyHandle, int]:
    """Start the workers, wait for them, return the study and how many points they measured."""
    r = s.r
    n = worker_count(r.config.workers, r.device)
    gpus: list[str | None] = [None] * n
    if r.device.type == "cuda":
        entries = visible_gpus(r.device)
        gpus = [entries[i % len(entries)] for i in range(n)]
        s = replace(s, r=replace(r, device=torch.device("cuda", 0)))  # each worker sees its one GPU
    h = open_study(s.plan, storage=r.storage, study_name=s.name, identity=s.identity,
                   hardware=_hardware(s), heartbeat_s=heartbeat_s, grace_s=grace_s)
    before = h.kept
    # a fork server imports spectune (and torch) once and forks each worker from it: no worker pays
    # the imports again, and none inherits an initialised CUDA context (each picks its own GPU)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["spectune.autotune.profile_workers", "spectune.autotune.profiler"])
    procs = [ctx.Process(target=worker_main, args=(s, i, gpus[i], timer, measure_point, heartbeat_s, grace_s),
                         name=f"spectune-worker-{i}") for i in range(n)]
    for p in procs:
        p.start()
    try:
        _wait(h, procs, r.config.progress)
    except BaseException:
        for p in procs:
            p.join(30)
        raise
    states = key_states(h.study)
    codes = [p.exitcode for p in procs]
    if states.waiting or states.running:
        raise WorkersError(f"--workers: every worker exited (codes {codes}) with {len(states.waiting)} points "
                           f"waiting and {len(states.running)} claimed: run the same command again to resume")
    if not any(c == 0 for c in codes):
        raise WorkersError(f"--workers: no worker finished (exit codes {codes})")
    return h, len(states.settled) - before


def _hardware(s: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(s.hardware)


def _wait(h: StudyHandle, procs: list[Any], progress: bool) -> None:
    from tqdm.auto import tqdm

    total = h.plan.total_points
    with tqdm(total=total, initial=min(total, h.kept), disable=not progress, desc="measuring", unit="pt",
              leave=False) as bar:
        while any(p.is_alive() for p in procs):
            done = min(total, len(key_states(h.study).settled))
            bar.update(done - bar.n)
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
