"""Shared by the profile benchmarks: run ``spectune profile`` as a subprocess, compare two profiles,
run sections that record their errors, write JSON.

Used by ``profile_two_workers.py``, ``profile_two_gpus.py`` and ``gpu_reliability.py`` (each
puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd


def log(message: str) -> None:
    print(message, flush=True)


def out_dir(arg: str | None) -> Path:
    """``--out-dir``, else ``$OUT``, else ``benchmarks/results``."""
    dest = Path(arg or os.environ.get("OUT") or Path(__file__).parent / "results")
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def write_json(path: Path, obj: Any) -> None:
    from spectune.io import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1, default=str))
    log(f"wrote {path}")


def profile_command(
    out: Path,
    *,
    target: str,
    device: str,
    batch_sizes: str,
    max_k: int,
    trials: int,
    workers: int = 1,
    drafter: str = "eagle-1l",
    context_len: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "spectune.cli",
        "profile",
        "--target",
        target,
        "--drafter",
        drafter,
        "--device",
        device,
        "--batch-sizes",
        batch_sizes,
        "--max-k",
        str(max_k),
        "--trials",
        str(trials),
        "--out",
        str(out),
        "--no-progress",
        "--workers",
        str(workers),
    ]
    if context_len is not None:
        cmd += ["--context-len", str(context_len)]
    return cmd + list(extra)


def run_command(cmd: Sequence[str], *, timeout: float | None = None) -> dict[str, Any]:
    """Run to completion; rc, wall seconds and the output's tail (never raises on a non-zero rc)."""
    start = time.perf_counter()
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = "timeout", str(exc.stdout or ""), str(exc.stderr or "")
    return {
        "rc": rc,
        "wall_s": round(time.perf_counter() - start, 1),
        "command": " ".join(cmd),
        "stdout": out[-3000:],
        "stderr": err[-3000:],
    }


def run_profile(
    folder: Path, label: str, *, workers: int = 1, timeout: float | None = None, **settings: Any
) -> dict[str, Any]:
    """``spectune profile`` into ``folder/label.yaml``; raises with the output's tail when it fails."""
    out = folder / f"{label}.yaml"
    res = run_command(profile_command(out, workers=workers, **settings), timeout=timeout)
    res.update(label=label, workers=workers, yaml=str(out), csv=str(out.with_suffix(".csv")))
    log(f"  {label}: {workers} worker(s), rc {res['rc']}, {res['wall_s']} s")
    if res["rc"] != 0:
        raise RuntimeError(f"{label}: spectune profile exited {res['rc']}: {res['stderr'][-600:]}")
    return res


def _quantile(values: list[float], q: float) -> float | None:
    return sorted(values)[int(q * (len(values) - 1))] if values else None


def compare(
    one_yaml: Path | str, two_yaml: Path | str, one_csv: Path | str, two_csv: Path | str
) -> dict[str, Any]:
    """Point sets, per-point time differences and the fitted models of two profiles."""
    from spectune.runtime.costs import CostModel
    from spectune.runtime.table import read_table

    a, b = pd.read_csv(one_csv), pd.read_csv(two_csv)
    first = {"seed", "held_out"}
    grid_a = set(a.loc[a["phase"].isin(first), "key"])
    grid_b = set(b.loc[b["phase"].isin(first), "key"])
    common = sorted(set(a["key"]) & set(b["key"]))
    ms_a, ms_b = a.set_index("key")["ms"], b.set_index("key")["ms"]
    signed = [
        ms_b[k] / ms_a[k] - 1
        for k in common
        if pd.notna(ms_a[k]) and pd.notna(ms_b[k]) and ms_a[k] > 0
    ]
    rel = [abs(x) for x in signed]
    # noise of one run: the spread of each point's own replays, (p80 - p20) / median
    spread = [
        (r.p80_ms - r.p20_ms) / r.ms
        for r in a.itertuples()
        if pd.notna(r.ms) and r.ms > 0 and pd.notna(r.p80_ms) and pd.notna(r.p20_ms)
    ]
    ta, tb = read_table(one_yaml), read_table(two_yaml)
    wl = ta.workload
    ma = CostModel(ta.costs.model, wl.drafter_kind, wl.context_len)
    mb = CostModel(tb.costs.model, wl.drafter_kind, wl.context_len)
    pred_signed = [
        mb.target_ms(bs * q, bs) / ma.target_ms(bs * q, bs) - 1
        for bs in range(1, wl.max_batch + 1)
        for q in range(1, wl.max_k + 2)
    ]
    pred = [abs(x) for x in pred_signed]
    return {
        "grid_and_held_out_equal": grid_a == grid_b,
        "point_sets_equal": set(a["key"]) == set(b["key"]),
        "points": [len(a), len(b)],
        "common_points": len(common),
        "duplicates": [int(a["key"].duplicated().sum()), int(b["key"].duplicated().sum())],
        "point_rel_diff_median": statistics.median(rel) if rel else None,
        # > 0: the second run's points are slower (a bias, not noise, when most points agree in sign)
        "point_rel_diff_signed_median": statistics.median(signed) if signed else None,
        "point_slower_share": sum(x > 0 for x in signed) / len(signed) if signed else None,
        "point_rel_diff_p90": _quantile(rel, 0.9),
        "point_rel_diff_max": max(rel) if rel else None,
        "replay_spread_median": statistics.median(spread) if spread else None,
        "model_target_rel_diff_median": statistics.median(pred),
        "model_target_signed_median": statistics.median(pred_signed),
        "model_target_rel_diff_max": max(pred),
        "held_out_error": [ta.costs.error.median_rel, tb.costs.error.median_rel],
        "held_out_error_max": [ta.costs.error.max_rel, tb.costs.error.max_rel],
        "workers_two": {str(k): int(v) for k, v in b["worker"].value_counts().items()},
        "gpu_uuids": sorted({str(u) for u in pd.concat([a["gpu_uuid"], b["gpu_uuid"]]).dropna()}),
    }


def worker_gpus(csv: Path | str, storage: Path | str | None = None) -> list[dict[str, Any]]:
    """Per worker of a profile: points, and the GPU(s) its trials recorded (name, UUID)."""
    frame = pd.read_csv(csv)
    out = []
    for worker, rows in frame.groupby("worker", dropna=False):
        out.append(
            {
                "worker": str(worker),
                "points": len(rows),
                "gpu_uuids": sorted({str(u) for u in rows["gpu_uuid"].dropna()}),
                "gpus": sorted({str(g) for g in rows["gpu"].dropna()}),
            }
        )
    return out


def load_only_study(journal: Path | str) -> Any:
    """The one study in a journal file (None while the file or the study does not exist yet)."""
    import optuna

    from spectune.autotune.study_storage import open_storage

    if not Path(journal).exists():
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(str(journal))
    names = [s.study_name for s in storage.get_all_studies()]
    return optuna.load_study(study_name=names[0], storage=storage) if names else None


def journal_trials(journal: Path | str) -> dict[str, Any]:
    """Trials of a profile's journal by key: how many settled (COMPLETE / PRUNED with a result), how
    many failed, and the measuring span (first point claimed to last finished, seconds)."""
    from optuna.trial import TrialState

    study = load_only_study(journal)
    if study is None:
        return {"settled_per_key": {}, "failed": 0, "states": {}, "measuring_s": None}
    settled: dict[str, int] = {}
    states: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        states[t.state.name] = states.get(t.state.name, 0) + 1
        key = t.user_attrs.get("key")
        if key and t.state in (TrialState.COMPLETE, TrialState.PRUNED) and "result" in t.user_attrs:
            settled[key] = settled.get(key, 0) + 1
    done = [t for t in study.get_trials(deepcopy=False) if t.datetime_complete and t.datetime_start]
    span = (
        (
            max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)
        ).total_seconds()
        if done
        else None
    )
    return {
        "settled_per_key": settled,
        "failed": states.get("FAIL", 0),
        "states": states,
        "measuring_s": None if span is None else round(span, 1),
    }


def fmt_pct(value: Any) -> str:
    return "-" if value is None else f"{value:.2%}"


def run_section(name: str, fn: Callable[[], dict[str, Any]], results: dict[str, Any]) -> None:
    """Run one section; an exception is recorded (type, message, last frames) and the rest goes on."""
    log(f"== {name}")
    start = time.perf_counter()
    try:
        res = fn()
        res["ok"] = bool(res.get("ok", True))
    except Exception as exc:  # a section's failure is a result; the other sections still run
        res = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-2000:],
        }
        log(f"  {name} failed: {res['error'][:300]}")
    res["section_s"] = round(time.perf_counter() - start, 1)
    results[name] = res
    log(f"  {name}: {'ok' if res['ok'] else 'NOT ok'} in {res['section_s']} s")
