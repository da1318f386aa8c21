"""The target's GEMMs at decode sizes (M = 1..64 rows) against what cuBLAS / cuBLASLt offer.

For each weight of one decoder layer of the target (default qwen3-8b; (N, K) from
``models.config.projection_shapes``: wqkv, wo, w13, w2) and the lm_head [vocab, dim], and each M,
x [M, K] bf16 times the weight [N, K] transposed, several ways:

  matmul     ``torch.matmul(x, w.t())`` (cuBLAS, torch's default BLAS library)
  linear     ``F.linear(x, w)`` (what the decoder calls)
  linear_lt  ``F.linear`` under ``torch.backends.cuda.preferred_blas_library("cublaslt")``
  fp8        ``torch._scaled_mm`` on e4m3 x [M, K] and w [N, K] with a scale per row of x and per
             output channel of w, bf16 out: the GEMM alone, inputs quantised beforehand; only
             where it runs (CUDA, capability >= 8.9, K and N multiples of 16), else skipped
  triton_small_m  ``kernels.gemv.small_m_matmul`` (the Triton small-M kernel, its heuristic config,
             recorded in the cell) for M <= 16 where Triton runs (CUDA, or CPU under
             TRITON_INTERPRET=1), else skipped; its output also against F.linear's
             (``rel_err_linear``)
  triton_row ``kernels.gemv.gemv_row`` (the one-row streaming kernel, its heuristic config) at
             M = 1 only, where Triton runs

A decode step reads each weight once from HBM; a weight smaller than the GPU's L2 timed alone
would be read from L2 instead. So one timed run multiplies ``copies`` distinct weights in turn
(their bytes together >= ``--flush-mib``) and the time per GEMM is the run's over ``copies``.
Timing is the profiler's (``autotune.timing.default_timer``: a FULL CUDA graph of the run,
replays timed with CUDA events, median; wall-clock eager runs on CPU). Beside each time: the
weight bytes one GEMM reads (bf16: 2 N K; fp8: N K + 4 N scale bytes) over that time, and that as a
fraction of the read bandwidth measured in the same run (one sum over ``--read-mib``).
Correctness first: every arm's output against a float32 product of the same inputs (relative
error of the max-norm).

``--sweep`` also times every candidate config of the small-M kernel
(``kernels.gemv.candidate_configs``) at each M <= 16 and of the one-row kernel
(``row_candidate_configs``) at M = 1 (in each cell's ``sweep``), and writes the small-M kernel's
winner per weight shape (lowest geometric mean of time / best over the M values) as a
``kernels.gemv`` config table, ``gemv_configs.json`` (to ship: ``kernels/configs/gemv/<GPU>.json``).

Prints a table; writes ``gemm_check.json`` under ``--out-dir`` (default $OUT, else
benchmarks/results/).

    python benchmarks/gemm_check.py                                   # one H200: ~1 minute
    python benchmarks/gemm_check.py --sweep --ms 1,4,16               # + the small-M config sweep
    python benchmarks/gemm_check.py --device cpu --preset tiny --ms 1,2 --flush-mib 1 --read-mib 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spectune.autotune.hardware import software_facts
from spectune.autotune.timing import Timer, default_timer, free_device_memory
from spectune.io import atomic_write_text
from spectune.kernels.attention_configs import num_sms
from spectune.kernels.fp8 import quantize_rows, quantize_weight, scaled_mm_ok
from spectune.kernels.gemv import (
    MAX_M,
    GemvConfig,
    blas_library,
    candidate_configs,
    default_config,
    gemv_row,
    row_candidate_configs,
    row_default_config,
    small_m_matmul,
    small_m_ok,
    table_to_json,
)
from spectune.models.build import StepFn
from spectune.models.config import ModelArgs, ModelError, projection_shapes, resolve_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import first_line, int_list, say  # noqa: E402  (the probes' shared helpers)

DEFAULT_MS = "1,2,4,8,16,32,64"
ARMS = ("matmul", "linear", "linear_lt", "fp8", "triton_small_m", "triton_row")
MAX_COPIES = 64
SWEEP_MAX_REL_ERR = 0.02  # a swept config's output against the float32 product (bf16 out)
GB = 1e9


def gemm_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(N, K) of the decoder layer's weights and the lm_head."""
    return {**projection_shapes(args), "lm_head": (args.vocab_size, args.dim)}


def read_bandwidth(timer: Timer, device: torch.device, mib: int) -> dict[str, Any]:
    """GB/s of one read of ``mib`` MiB (a float32-accumulated sum of bf16)."""
    src = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device).normal_()
    step = StepFn(run=lambda: src.sum(dtype=torch.float32), refresh=lambda: None,
                  tokens=src.numel(), batch=1, label=f"sum {mib} MiB")
    t = timer(step)
    return {"bytes": src.numel() * 2, "ms": t.median_ms,
            "gbps": src.numel() * 2 / (t.median_ms * 1e-3) / GB, "mode": t.mode}


def arms_for(x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, Any]:
    """Each arm: (run over all copies, output of the first copy, weight bytes per GEMM, BLAS
    library) or the reason it is skipped."""
    n, k = weights[0].shape
    cuda = x.device.type == "cuda"
    arms: dict[str, Any] = {
        "matmul": (lambda: [torch.matmul(x, w.t()) for w in weights], 2 * n * k, None),
        "linear": (lambda: [F.linear(x, w) for w in weights], 2 * n * k, None),
        "linear_lt": (lambda: [F.linear(x, w) for w in weights], 2 * n * k, "cublaslt")
        if cuda else "CUDA only",
        "triton_small_m": (lambda: [small_m_matmul(x, w) for w in weights], 2 * n * k, None)
        if small_m_ok(x, weights[0]) else f"M <= {MAX_M}, bf16/fp16, where Triton runs",
        "triton_row": (lambda: [gemv_row(x, w) for w in weights], 2 * n * k, None)
        if small_m_ok(x, weights[0]) and x.shape[0] == 1 else "M = 1, bf16/fp16, where Triton runs",
    }
    if not scaled_mm_ok(x, weights[0]):  # (by the shape and the device only)
        arms["fp8"] = "torch._scaled_mm does not run here (CUDA, capability >= 8.9, K, N % 16)"
        return arms
    q_x, s_x = quantize_rows(x)  # [M, K] e4m3, [M, 1] float32
    q_ws = [quantize_weight(w) for w in weights]  # ([N, K] e4m3, [N] float32) each

    def fp8() -> list[torch.Tensor]:
        return [torch._scaled_mm(q_x, q.t(), scale_a=s_x, scale_b=s.view(1, -1),
                                 out_dtype=torch.bfloat16) for q, s in q_ws]

    arms["fp8"] = (fp8, n * k + 4 * n, None)
    return arms


def sweep_small_m(timer: Timer, x: torch.Tensor, weights: list[torch.Tensor],
                  want: torch.Tensor, label: str, row: bool = False) -> list[dict[str, Any]]:
    """Every candidate config of the small-M kernel (``row``: of the one-row kernel) on these
    inputs: ms per GEMM, inf where it fails (out of resources) or its result is off (relative
    error over ``SWEEP_MAX_REL_ERR``)."""
    n, k = weights[0].shape
    out = []
    cands: list[Any] = (row_candidate_configs if row else candidate_configs)(n, k, num_sms(x.device))
    for cfg in cands:
        def run(cfg: Any = cfg) -> list[torch.Tensor]:
            return [(gemv_row if row else small_m_matmul)(x, w, cfg) for w in weights]

        entry: dict[str, Any] = {"config": dataclasses.asdict(cfg), "ms": math.inf}
        try:
            err = float((run()[0].float() - want).abs().max() / want.abs().max())
            if err <= SWEEP_MAX_REL_ERR:
                t = timer(StepFn(run=run, refresh=lambda: None, tokens=x.shape[0], batch=1,
                                 label=f"{label} {cfg}"))
                entry["ms"] = t.median_ms / len(weights)
            else:
                entry["error"] = f"rel_err {err:.3g}"
        except Exception as exc:  # noqa: BLE001 (a failing candidate only loses)
            entry["error"] = first_line(exc)
        out.append(entry)
    return out


def sweep_winners(rows: list[dict[str, Any]]) -> dict[tuple[int, int], GemvConfig]:
    """Per weight shape (N, K): the swept config with the lowest geometric mean of time / best
    time over the shape's M values; one that failed at any M loses."""
    per_shape: dict[tuple[int, int], list[dict[tuple, float]]] = {}
    for r in rows:
        swept = r.get("triton_small_m", {}).get("sweep")
        if swept:
            per_shape.setdefault((r["n"], r["k"]), []).append(
                {tuple(e["config"].values()): e["ms"] for e in swept})
    winners = {}
    for shape, per_m in per_shape.items():
        best = [min(times.values()) for times in per_m]

        def score(key: tuple, per_m: list = per_m, best: list = best) -> float:
            ratios = [times.get(key, math.inf) / b for times, b in zip(per_m, best, strict=True)]
            return math.exp(sum(math.log(q) for q in ratios) / len(ratios)) if all(
                math.isfinite(q) for q in ratios) else math.inf

        key = min(per_m[0], key=lambda c: (score(c), c))
        if math.isfinite(score(key)):
            winners[shape] = GemvConfig(*key)
    return winners


def check_shape(
    timer: Timer, device: torch.device, name: str, n: int, k: int, ms: list[int],
    flush_bytes: int, read_gbps: float, gen: torch.Generator, sweep: bool = False,
) -> list[dict[str, Any]]:
    copies = max(1, min(MAX_COPIES, math.ceil(flush_bytes / (2 * n * k))))
    weights = [torch.randn(n, k, device=device, generator=gen).div_(k**0.5).to(torch.bfloat16)
               for _ in range(copies)]  # [N, K] each
    rows = []
    for m in ms:
        row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "copies": copies}
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)  # [M, K]
        want = x.float() @ weights[0].float().t()  # [M, N]
        lin = F.linear(x, weights[0]).float()  # [M, N], what the decoder computes
        for arm, spec in arms_for(x, weights).items():
            if isinstance(spec, str):
                row[arm] = {"skipped": spec}
                continue
            run, nbytes, lib = spec
            cell: dict[str, Any] = {"weight_bytes": nbytes}
            try:
                with blas_library(lib):
                    got = run()[0].float()
                    cell["rel_err"] = float((got - want).abs().max() / want.abs().max())
                    if arm == "triton_row":
                        cell["config"] = dataclasses.asdict(row_default_config(device, n, k))
                    if arm == "triton_small_m":
                        cell["rel_err_linear"] = float((got - lin).abs().max() / lin.abs().max())
                        cell["config"] = dataclasses.asdict(default_config(device, n, k))
                    step = StepFn(run=run, refresh=lambda: None, tokens=m, batch=1,
                                  label=f"gemm {name} m={m} {arm}")
                    t = timer(step)
                ms_one = t.median_ms / copies
                gbps = nbytes / (ms_one * 1e-3) / GB
                cell.update(ms=ms_one, gbps=gbps, of_read_bw=gbps / read_gbps, mode=t.mode)
                if arm in ("triton_small_m", "triton_row") and sweep:
                    cell["sweep"] = sweep_small_m(timer, x, weights, want, f"gemm {name} m={m} {arm}",
                                                  row=arm == "triton_row")
            except Exception as exc:  # one bad point must not end the run
                cell["error"] = first_line(exc)
            row[arm] = cell
        rows.append(row)
    del weights
    free_device_memory()
    return rows


def print_table(result: dict[str, Any]) -> None:
    say(f"\n{result['target']} bf16 GEMMs on {result['gpu']}: us per GEMM (GB/s of its weight "
        f"bytes); read bandwidth {result['read']['gbps']:.0f} GB/s")
    say(f"{'shape':<8} {'N x K':>13} {'M':>3} " + " ".join(f"{a:>17}" for a in ARMS))
    for r in result["rows"]:
        cells = []
        for arm in ARMS:
            c = r.get(arm, {})
            cells.append(f"{c['ms'] * 1e3:8.1f} ({c['gbps']:5.0f})" if "ms" in c
                         else ("-" if "skipped" in c else "error"))
        say(f"{r['shape']:<8} {r['n']:>6}x{r['k']:<6} {r['m']:>3} "
            + " ".join(f"{c:>17}" for c in cells))


def print_row_sweep(result: dict[str, Any]) -> None:
    """The one-row kernel's sweep at M = 1: heuristic -> fastest config, beside F.linear."""
    say("\none-row sweep (M = 1): us per GEMM, F.linear | heuristic -> fastest")
    for r in result["rows"]:
        cell, lin = r.get("triton_row", {}), r.get("linear", {})
        ok = [e for e in cell.get("sweep", []) if math.isfinite(e["ms"])]
        if ok and "ms" in cell and "ms" in lin:
            best = min(ok, key=lambda e: e["ms"])
            say(f"  {r['shape']:<8} {lin['ms'] * 1e3:7.1f} | {cell['ms'] * 1e3:7.1f} -> {best['ms'] * 1e3:7.1f}"
                f"  {best['config']}")


def write_sweep_table(result: dict[str, Any], device: torch.device, path: Path) -> None:
    """The sweep's winners as a ``kernels.gemv`` config table; prints heuristic vs winner."""
    winners = sweep_winners(result["rows"])
    if not winners:
        say("sweep: no shape ran the small-M kernel; no table written")
        return
    sw = result["software"]
    source = (f"gemm_check.py --sweep, {result['target']}, M {[m for m in result['ms'] if m <= MAX_M]}, "
              f"torch {sw['torch']}, triton {sw['triton']}")
    atomic_write_text(path, table_to_json(result["gpu"], num_sms(device), source, winners))
    say("\nsmall-M sweep: us per GEMM, heuristic -> winner")
    for r in result["rows"]:
        cell = r.get("triton_small_m", {})
        cfg = winners.get((r["n"], r["k"]))
        if "sweep" in cell and cfg is not None:
            won = next(e["ms"] for e in cell["sweep"] if e["config"] == dataclasses.asdict(cfg))
            say(f"  {r['shape']:<8} M {r['m']:>2}: {cell['ms'] * 1e3:7.1f} -> {won * 1e3:7.1f}  {cfg}")
    say(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", help="target preset (default qwen3-8b)")
    ap.add_argument("--ms", default=DEFAULT_MS, help=f"rows M of x (default {DEFAULT_MS})")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--flush-mib", type=int, default=512,
                    help="distinct weights' bytes one timed run reads at least (past the L2)")
    ap.add_argument("--read-mib", type=int, default=1024, help="buffer of the read-bandwidth sum")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every candidate config of the small-M kernel at M <= 16 and "
                         "write the winners per shape to gemv_configs.json")
    args = ap.parse_args(argv)
    ms = int_list(args.ms, "--ms", example="1,2,4,8")
    for flag, value in (("--flush-mib", args.flush_mib), ("--read-mib", args.read_mib)):
        if value < 1:
            raise SystemExit(f"{flag}: must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device present")
    try:
        target = resolve_target(args.preset)
    except ModelError as exc:
        raise SystemExit(f"--preset: {exc}") from None
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sw = software_facts()
    timer = default_timer(device)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "software": {"torch": sw.torch, "triton": sw.triton, "cuda": sw.cuda, "spectune": sw.spectune},
        "target": target.name, "ms": ms, "flush_mib": args.flush_mib,
        "read": read_bandwidth(timer, device, args.read_mib), "rows": [],
    }
    say(f"{result['gpu']}: torch {sw.torch}; {target.name}, M {ms}; read "
        f"{result['read']['gbps']:.0f} GB/s")
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in gemm_shapes(target).items():
        say(f"  {name} [{n}, {k}]")
        result["rows"] += check_shape(timer, device, name, n, k, ms, args.flush_mib * 2**20,
                                      result["read"]["gbps"], gen, args.sweep)
    result["wall_s"] = time.perf_counter() - started
    print_table(result)
    path = out / "gemm_check.json"
    atomic_write_text(path, json.dumps(result, indent=1, default=str) + "\n")
    say(f"\n{result['wall_s']:.0f} s; wrote {path}")
    if args.sweep:
        write_sweep_table(result, device, out / "gemv_configs.json")
        print_row_sweep(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
