"""Reliability on one GPU, in one call: two workers with the timing lock, an out-of-memory sweep,
a profile SIGKILLed twice.

Sections (each independent: an error is recorded and the others run):
  lock  two workers sharing the GPU with the per-GPU timing lock (and, for contrast, without it)
        vs one worker, same settings: point sets, per-point median / p90 differences, the fitted
        model's difference, held-out errors (``profile_two_workers.two_workers_vs_one``).
  oom   a profile whose batch sizes go past what fits (qwen3-8b at context 32768: a request's KV
        cache is 4.5 GiB, so batch 32 needs ~144 GiB) completes with those points infeasible; then
        ``spectune tune`` on it, and a check that no (batch, tier) the table can run contains a
        step the profile could not fit (rows, and every captured tier at every batch size).
  kill  the lock section's one-worker settings profiled again, SIGKILLed twice while a point is
        claimed (after 1/4 and 1/2 of the points), then resumed to completion: compared with the
        uninterrupted run (the lock section's, or its own): same point set, no point settled
        twice, per-point time differences against the replay spread, the trial budget kept.

    PYTHONPATH=. python benchmarks/gpu_reliability.py --out-dir $OUT           # one H200, ~5 min
    PYTHONPATH=. python benchmarks/gpu_reliability.py --device cpu --target tiny --out-dir /tmp/r   # dry run

On CPU nothing runs out of memory: the dry run's oom section refuses target and tier points
from batch 8 on with a simulated out-of-memory error (labelled so in the JSON), which exercises the
same recording, tune and check. Writes ``gpu_reliability.json`` and the oom section's profile,
measurements and policy table (4 files).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_runs import (  # noqa: E402
    compare,
    fmt_pct,
    journal_trials,
    load_only_study,
    log,
    out_dir,
    profile_command,
    run_command,
    run_profile,
    run_section,
    write_json,
)
from profile_two_workers import print_table, two_workers_vs_one  # noqa: E402

GPU = {
    "lock": {"batch_sizes": "1-8", "max_k": 3, "trials": 2},
    "oom": {"batch_sizes": "1,2,4,8,16,32", "max_k": 3, "trials": 0, "context_len": 32768},
}
CPU = {
    "lock": {"batch_sizes": "1-4", "max_k": 2, "trials": 0},
    "oom": {"batch_sizes": "1,2,4,8,16", "max_k": 1, "trials": 0, "context_len": 256},
}
SIMULATED_OOM_BATCH = 8  # CPU dry run: target / tier points from this batch on "run out of memory"
ACCEPTANCE = "public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench"
RUN_TIMEOUT_S = 240  # one profile subprocess


# ---------------------------------------------------------------------------------------------
# oom


class SimulatedOom:
    """CPU dry run only: the real tiny steps, but target and tier points at ``batch >= limit``
    raise the error a GPU raises when a step does not fit."""

    def __init__(self, config: Any, limit: int):
        self.config, self.limit, self.inner = config, limit, None

    def __call__(self, spec: Any) -> Any:
        import torch

        if spec.kind in ("target", "tier") and spec.batch >= self.limit:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (simulated on CPU: batch {spec.batch} >= {self.limit})"
            )
        if self.inner is None:
            from spectune.autotune.profiler import model_point_factory, resolve

            self.inner = model_point_factory(resolve(self.config))
        return self.inner(spec)


def oom_profile(folder: Path, args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    out = folder / "oom.yaml"
    if args.device.startswith("cuda"):
        return run_profile(
            folder, "oom", target=args.target, device=args.device, timeout=RUN_TIMEOUT_S, **settings
        )
    from spectune.autotune.profiler import ProfileConfig
    from spectune.autotune.profiler import run_profile as run_in_process

    config = ProfileConfig(
        target=args.target,
        device="cpu",
        batch_sizes=settings["batch_sizes"],
        max_k=settings["max_k"],
        trials=settings["trials"],
        context_len=settings["context_len"],
        out=str(out),
        progress=False,
    )
    start = time.perf_counter()
    run_in_process(config, measure_point=SimulatedOom(config, SIMULATED_OOM_BATCH))
    return {
        "label": "oom",
        "yaml": str(out),
        "csv": str(out.with_suffix(".csv")),
        "rc": 0,
        "wall_s": round(time.perf_counter() - start, 1),
        "simulated_oom": f"target/tier points at batch >= {SIMULATED_OOM_BATCH} (CPU dry run)",
    }


def schedule_check(profile_yaml: Path | str, policy_yaml: Path | str) -> dict[str, Any]:
    """Every (batch, tier) the policy table can run, against the profile's infeasible points."""
    from spectune.autotune.feasibility import Feasibility
    from spectune.runtime.table import read_table

    prof, pol = read_table(profile_yaml), read_table(policy_yaml)
    feas = Feasibility.of(prof.costs.points)
    assert pol.policy is not None
    top = pol.policy.rows[-1].batch[1]
    runnable = [(b, t) for b in range(1, top + 1) for t in pol.policy.tiers if t >= b]
    bad = [(b, t) for b, t in runnable if not feas.fits(b, t)]
    rows = [(r.batch[0], r.batch[1], r.k, r.tier) for r in pol.policy.rows]
    return {
        "infeasible_points": [list(p) for p in feas.infeasible],
        "profile_max_batch": prof.workload.max_batch,
        "expected_cap": feas.batch_cap(prof.workload.max_batch),
        "rows_end_at": top,
        "tiers": list(pol.policy.tiers),
        "rows": rows,
        "shapes_checked": len(runnable),
        "shapes_that_do_not_fit": bad[:20],
        "never_schedules_infeasible": not bad,
    }


def section_oom(
    folder: Path, args: argparse.Namespace, settings: dict[str, Any], dest: Path
) -> dict[str, Any]:
    import pandas as pd

    prof = oom_profile(folder, args, settings)
    frame = pd.read_csv(prof["csv"])
    bad = frame[~frame["feasible"].astype(bool)]
    log(
        f"  oom profile: {len(frame)} points, {len(bad)} infeasible "
        f"(batches {sorted(set(bad['batch'].astype(int)))})"
    )
    policy = folder / "oom.policy.yaml"
    tune = run_command(
        [
            sys.executable,
            "-m",
            "spectune.cli",
            "tune",
            prof["yaml"],
            "--acceptance",
            ACCEPTANCE,
            "--out",
            str(policy),
            "--trials",
            "10",
            "--no-progress",
        ],
        timeout=RUN_TIMEOUT_S,
    )
    log(f"  tune: rc {tune['rc']}, {tune['wall_s']} s")
    res: dict[str, Any] = {
        "settings": settings,
        "profile": {k: v for k, v in prof.items() if k != "stdout"},
        "points": len(frame),
        "infeasible": len(bad),
        "infeasible_keys": sorted(bad["key"]),
        "infeasible_errors": sorted(set(bad["error"]))[:5],
        "tune": tune,
    }
    for path in (prof["yaml"], prof["csv"]):
        shutil.copy(path, dest / f"gpu_reliability_{Path(path).name}")
    if tune["rc"] != 0:
        return {**res, "ok": False}
    shutil.copy(policy, dest / "gpu_reliability_oom.policy.yaml")
    res["check"] = schedule_check(prof["yaml"], policy)
    res["ok"] = bool(len(bad)) and res["check"]["never_schedules_infeasible"]
    c = res["check"]
    log(
        f"  table: rows end at batch {c['rows_end_at']} (expected {c['expected_cap']}), tiers {c['tiers']}; "
        f"{c['shapes_checked']} (batch, tier) shapes checked, {len(c['shapes_that_do_not_fit'])} do not fit"
    )
    return res


# ---------------------------------------------------------------------------------------------
# kill


def settled_and_running(journal: Path) -> tuple[int, int]:
    from spectune.autotune.study_claims import key_states

    try:
        study = load_only_study(journal)
        if study is None:
            return 0, 0
        s = key_states(study)
        return len(s.settled), len(s.running)
    except Exception:  # the first worker is still creating the study
        return 0, 0


def kill_when(cmd: list[str], journal: Path, settled_at: int, timeout_s: float) -> dict[str, Any]:
    """Start ``cmd``; SIGKILL it once ``settled_at`` points are settled and one is claimed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    start = time.perf_counter()
    settled = running = 0
    while proc.poll() is None:
        if time.perf_counter() - start > timeout_s:
            proc.kill()
            break
        settled, running = settled_and_running(journal)
        if settled >= settled_at and running:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.1)
    _, err = proc.communicate()
    killed = proc.returncode == -signal.SIGKILL
    log(
        f"  run until {settled_at} settled: {'SIGKILLed' if killed else f'exited {proc.returncode}'} with "
        f"{settled} settled, {running} claimed, after {time.perf_counter() - start:.1f} s"
    )
    return {
        "killed": killed,
        "rc": proc.returncode,
        "settled_at_kill": settled,
        "claimed_at_kill": running,
        "wall_s": round(time.perf_counter() - start, 1),
        "stderr": (err or "")[-1500:],
    }


def section_kill(
    folder: Path,
    args: argparse.Namespace,
    settings: dict[str, Any],
    reference: dict[str, Any] | None,
) -> dict[str, Any]:
    from spectune.runtime.table import read_table

    common = {"target": args.target, "device": args.device, **settings}
    if reference is None:
        reference = run_profile(folder, "uninterrupted", timeout=RUN_TIMEOUT_S, **common)
    total = len(journal_trials(reference["yaml"] + ".journal")["settled_per_key"])
    out = folder / "killed.yaml"
    journal = Path(str(out) + ".journal")
    cmd = profile_command(out, **common)
    kills = [kill_when(cmd, journal, max(1, total * frac // 4), RUN_TIMEOUT_S) for frac in (1, 2)]
    resumed = run_command(cmd, timeout=RUN_TIMEOUT_S)
    log(
        f"  resumed: rc {resumed['rc']}, {resumed['wall_s']} s: {resumed['stdout'].splitlines()[:1]}"
    )
    if resumed["rc"] != 0:
        return {"ok": False, "kills": kills, "resumed": resumed}
    trials = journal_trials(journal)
    twice = {k: n for k, n in trials["settled_per_key"].items() if n > 1}
    cmp = compare(reference["yaml"], out, reference["csv"], out.with_suffix(".csv"))
    import pandas as pd

    frame = pd.read_csv(out.with_suffix(".csv"))
    adaptive = int((frame["phase"] == "adaptive").sum())
    res = {
        "reference": {k: v for k, v in reference.items() if k != "stdout"},
        "kills": kills,
        "resumed": {k: v for k, v in resumed.items() if k != "stderr"},
        "trial_states": trials["states"],
        "points_settled_twice": twice,
        "compare": cmp,
        "adaptive_points": adaptive,
        "adaptive_budget": settings["trials"],
        "points": len(read_table(out).costs.points),
    }
    res["ok"] = (
        all(k["killed"] for k in kills)
        and not twice
        and cmp["point_sets_equal"]
        and adaptive <= settings["trials"]
        and cmp["duplicates"] == [0, 0]
    )
    log(
        f"  killed twice ({[k['killed'] for k in kills]}), resumed: {cmp['points'][1]} points vs "
        f"{cmp['points'][0]} uninterrupted, same set {cmp['point_sets_equal']}, settled twice {len(twice)}, "
        f"adaptive {adaptive}/{settings['trials']}; per-point |diff| median "
        f"{fmt_pct(cmp['point_rel_diff_median'])}, p90 {fmt_pct(cmp['point_rel_diff_p90'])} "
        f"(replay spread {fmt_pct(cmp['replay_spread_median'])})"
    )
    return res


# ---------------------------------------------------------------------------------------------


def summary(results: dict[str, Any]) -> None:
    log("\nsection  ok     s  result")
    lock = results.get("lock", {})
    for label in ("one_again", "two_lock_on", "two_lock_off"):
        c = lock.get(label)
        what = "one worker again" if label == "one_again" else f"two workers, lock {label[9:]}"
        if c:
            log(
                f"lock     {lock['ok']!s:5} {lock['section_s']:>5}  {what}: per point median "
                f"{fmt_pct(c['point_rel_diff_median'])}, p90 {fmt_pct(c['point_rel_diff_p90'])}; fit median "
                f"{fmt_pct(c['model_target_rel_diff_median'])}, max {fmt_pct(c['model_target_rel_diff_max'])}; "
                f"held-out {fmt_pct(c['held_out_error'][1])} (one worker {fmt_pct(c['held_out_error'][0])})"
            )
    if "lock" in results and not lock.get("two_lock_on"):
        log(f"lock     False {lock.get('section_s', '-'):>5}  {lock.get('error', '')[:150]}")
    oom = results.get("oom", {})
    if oom:
        c = oom.get("check", {})
        _line(
            "oom",
            oom,
            f"{oom.get('infeasible', '-')} of {oom.get('points', '-')} points infeasible; rows end at "
            f"{c.get('rows_end_at', '-')} (cap {c.get('expected_cap', '-')}); never schedules them: "
            f"{c.get('never_schedules_infeasible', '-')}",
        )
    kill = results.get("kill", {})
    if kill:
        c = kill.get("compare", {})
        _line(
            "kill",
            kill,
            f"same point set {c.get('point_sets_equal', '-')}, settled twice "
            f"{len(kill.get('points_settled_twice', {}))}, per point median "
            f"{fmt_pct(c.get('point_rel_diff_median'))}, p90 {fmt_pct(c.get('point_rel_diff_p90'))}",
        )


def _line(name: str, res: dict[str, Any], text: str) -> None:
    error = f"  {res['error'][:150]}" if "error" in res else ""
    log(f"{name:<8} {res['ok']!s:5} {res['section_s']:>5}  {text}{error}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--sections", default="lock,oom,kill")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    sizes = GPU if args.device.startswith("cuda") else CPU
    dest = out_dir(args.out_dir)
    folder = Path(tempfile.mkdtemp(prefix="spectune-reliability-"))
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    results: dict[str, Any] = {
        "target": args.target,
        "device": args.device,
        "sizes": sizes,
        "folder": str(folder),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host_cpus": os.cpu_count(),
    }
    lock_settings = {
        "target": args.target,
        "device": args.device,
        "timeout": RUN_TIMEOUT_S,
        **sizes["lock"],
    }
    if "lock" in wanted:
        run_section(
            "lock", lambda: two_workers_vs_one(folder, lock_settings, lock_off_too=True, noise_run=True), results
        )
        if results["lock"].get("runs"):
            print_table(results["lock"])
    if "oom" in wanted:
        run_section("oom", lambda: section_oom(folder, args, sizes["oom"], dest), results)
    if "kill" in wanted:
        reference = results.get("lock", {}).get("runs", {}).get("one")
        run_section("kill", lambda: section_kill(folder, args, sizes["lock"], reference), results)
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_json(dest / "gpu_reliability.json", results)
    summary(results)
    return 0 if all(results[s]["ok"] for s in wanted if s in results) else 1


if __name__ == "__main__":
    sys.exit(main())
