"""One profile study shared by two GPUs (one worker per GPU) vs the same study on one GPU.

On a machine with two GPUs of one model (``nvidia-h200-x2``), in one call:
  1. ``spectune profile --target qwen3-8b --drafter eagle-1l --batch-sizes 1-256 --max-k 15
     --context-len 2048 --device cuda:0`` (one worker, one GPU),
  2. the same with ``--workers 2`` (one worker per visible GPU, one study in a journal file),
then reports each wall time and measuring span (first point claimed to last finished), the
ratio (goal <= 0.6), which GPU every worker's points came from (UUIDs must differ, the model must
be the same: a study is one GPU model's), the merged table's held-out error and the per-point
differences between the two runs. The full grid is 131 points; one worker took under 150 s on one
H200 (docs/BENCHMARKS.md), so both runs fit one 10-minute call.

On a one-GPU machine (``--mode shared``, the default there) it is a dry run of the same script:
two workers share the GPU (the per-GPU timing lock on) on a smaller grid (batch 1-32, K <= 7,
4 adaptive trials), labelled ``dry run`` in the output; its ratio says nothing about two GPUs.
``--device cpu --target tiny`` runs it on CPU (tiny grid). Writes ``profile_two_gpus.json``.

    PYTHONPATH=. python benchmarks/profile_two_gpus.py --out-dir $OUT            # x2: ~5 min; 1 GPU: ~2 min
    PYTHONPATH=. python benchmarks/profile_two_gpus.py --device cpu --target tiny --out-dir /tmp/g2
"""

from __future__ import annotations

import argparse
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
    log,
    out_dir,
    run_profile,
    run_section,
    worker_gpus,
    write_json,
)

FULL = {"batch_sizes": "1-256", "max_k": 15, "context_len": 2048, "trials": 16}  # the study
SHARED = {"batch_sizes": "1-32", "max_k": 7, "context_len": 2048, "trials": 4}  # one-GPU dry run
CPU = {"batch_sizes": "1-4", "max_k": 2, "context_len": 256, "trials": 0}
RUN_TIMEOUT_S = 290


def visible_gpus() -> list[dict[str, Any]]:
    """Name, UUID and driver of each visible GPU (NVML)."""
    import torch

    from spectune.autotune.nvml import gpu_identity, nvml_index

    return [
        {
            k: v
            for k, v in gpu_identity(nvml_index(i)).items()
            if k in ("name", "uuid", "driver", "index")
        }
        for i in range(torch.cuda.device_count())
    ]


def choose_mode(args: argparse.Namespace) -> str:
    if args.device == "cpu":
        return "cpu"
    if args.mode != "auto":
        return args.mode
    import torch

    return "two-gpus" if torch.cuda.device_count() >= 2 else "shared"


def one_vs_two(folder: Path, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    sizes = {"two-gpus": FULL, "shared": SHARED, "cpu": CPU}[mode]
    common = {"target": args.target, "drafter": args.drafter, **sizes, "timeout": RUN_TIMEOUT_S}
    one_device = "cpu" if mode == "cpu" else "cuda:0"
    two_device = {"two-gpus": "cuda", "shared": "cuda:0", "cpu": "cpu"}[
        mode
    ]  # cuda: one worker per GPU
    one = run_profile(folder, "one", workers=1, device=one_device, **common)
    two = run_profile(folder, "two", workers=2, device=two_device, **common)
    cmp = compare(one["yaml"], two["yaml"], one["csv"], two["csv"])
    spans = {
        label: journal_trials(r["yaml"] + ".journal")["measuring_s"]
        for label, r in (("one", one), ("two", two))
    }
    per_worker = worker_gpus(two["csv"])
    uuids = sorted({u for w in per_worker for u in w["gpu_uuids"]})
    models = sorted({g for w in per_worker for g in w["gpus"]})
    from spectune.runtime.table import read_table

    hw = read_table(two["yaml"]).hardware
    res = {
        "mode": mode,
        "dry_run": mode != "two-gpus",
        "settings": sizes,
        "runs": {
            k: {n: v for n, v in r.items() if n != "stdout"}
            for k, r in (("one", one), ("two", two))
        },
        "wall_ratio": round(two["wall_s"] / one["wall_s"], 3),
        "measuring_s": spans,
        "measuring_ratio": round(spans["two"] / spans["one"], 3)
        if spans["one"] and spans["two"]
        else None,
        "workers": per_worker,
        "gpu_uuids_two": uuids,
        "gpu_models_two": models,
        "uuids_differ_per_worker": len(per_worker) == 2
        and all(len(w["gpu_uuids"]) == 1 for w in per_worker)
        and len(uuids) == 2,
        "one_model": len(models) == 1,
        "driver": hw.driver,
        "gpu": hw.gpu,
        "compare": cmp,
    }
    if mode != "cpu":
        res["visible_gpus"] = visible_gpus()
    return res


def print_summary(res: dict[str, Any]) -> None:
    label = "" if not res["dry_run"] else f"  [dry run: {res['mode']}, not the two-GPU result]"
    c = res["compare"]
    log(f"{'run':>4} {'workers':>7} {'wall s':>7} {'measuring s':>11} {'points':>6}{label}")
    for i, name in enumerate(("one", "two")):
        r = res["runs"][name]
        log(
            f"{name:>4} {r['workers']:>7} {r['wall_s']:>7} {res['measuring_s'][name]!s:>11} {c['points'][i]:>6}"
        )
    log(
        f"ratio two / one: wall {res['wall_ratio']}, measuring {res['measuring_ratio']} (goal <= 0.6 on two GPUs)"
    )
    for w in res["workers"]:
        log(
            f"  worker {w['worker']}: {w['points']} points on {', '.join(w['gpus'])} {', '.join(w['gpu_uuids'])}"
        )
    log(
        f"GPU UUIDs differ per worker: {res['uuids_differ_per_worker']}; one GPU model: {res['one_model']} "
        f"({res['gpu']}, driver {res['driver']})"
    )
    log(
        f"grid + held-out equal {c['grid_and_held_out_equal']}, duplicates {c['duplicates']}; per point |two/one - 1| "
        f"median {fmt_pct(c['point_rel_diff_median'])}, p90 {fmt_pct(c['point_rel_diff_p90'])}; fitted model "
        f"median {fmt_pct(c['model_target_rel_diff_median'])}, max {fmt_pct(c['model_target_rel_diff_max'])}"
    )
    log(
        f"held-out error: one {fmt_pct(c['held_out_error'][0])} / {fmt_pct(c['held_out_error_max'][0])} max, "
        f"merged two {fmt_pct(c['held_out_error'][1])} / {fmt_pct(c['held_out_error_max'][1])} max"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--mode",
        default="auto",
        choices=["auto", "two-gpus", "shared"],
        help="auto: two-gpus with >= 2 GPUs, else shared (a dry run on one GPU)",
    )
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--drafter", default="eagle-1l")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    mode = choose_mode(args)
    log(f"mode {mode}" + ("" if mode == "two-gpus" else " (dry run)"))
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    folder = Path(tempfile.mkdtemp(prefix="spectune-two-gpus-"))
    run_section("one_vs_two", lambda: one_vs_two(folder, args, mode), results)
    if results["one_vs_two"]["ok"]:
        print_summary(results["one_vs_two"])
    write_json(out_dir(args.out_dir) / "profile_two_gpus.json", results)
    return 0 if results["one_vs_two"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
