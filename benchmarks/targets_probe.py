"""The target step of the targets served on an H200, against its weight-read floor.

For each target (default: qwen3-8b bf16, qwen3-8b fp8, qwen3-32b bf16, llama-3.1-8b bf16) it
builds the random-weight target alone (no drafter), then times the decode step -- q = 1 token per
request at each batch size, paged Triton attention over ``--context-len`` tokens of KV each -- as a
CUDA-graph replay with the profiler's timer (``spectune.autotune.timing.default_timer``). Beside
each time:

  weight floor  bytes of weights the step reads (``models.config.weight_read_bytes``: every layer,
                the final norm, the lm_head; FP8 projections at 1 byte plus their scales) divided
                by the read bandwidth measured in the same run (one sum over ``--copy-mib``);
  + KV floor    the same plus the KV cache the step reads (batch x context x K/V bytes per token).

The copy bandwidth (device-to-device copy of the same buffer, bytes read + written per second) is
recorded beside it: on an H200 it is well below the read bandwidth, and a floor from it is not one
(a qwen3-32b step at batch 1 measured faster than the weights' bytes over the copy bandwidth).

Then (CUDA only) the FP8 GEMM against bf16 at qwen3-8b's projection shapes for M = 1..4096: bf16
``F.linear``, the FP8 linear as the model runs it (row quantisation kernel + ``torch._scaled_mm``)
and ``_scaled_mm`` alone on inputs quantised beforehand.

Each target and each point is independent: an error is recorded (first line) and the run goes on;
the target's memory is freed before the next. Prints tables; writes ``targets_probe.json`` under
``--out-dir`` (default $OUT, else benchmarks/results/).

    python benchmarks/targets_probe.py                      # one H200: < 4 minutes
    python benchmarks/targets_probe.py --device cpu --target tiny,tiny:fp8 --batches 1,2 --context-len 32
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spectune.autotune.hardware import hardware_facts, software_facts
from spectune.autotune.timing import Timer, default_timer, free_device_memory
from spectune.io import atomic_write_text
from spectune.kernels.fp8 import fp8_linear, quantize_rows, quantize_weight, scaled_mm_ok
from spectune.models.build import StepFn, build_target, target_step
from spectune.models.config import (
    ModelError,
    kv_bytes_per_token,
    param_count,
    resolve_target,
    weight_read_bytes,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import first_line, say  # noqa: E402  (the probes' shared helpers)

DEFAULT_TARGETS = "qwen3-8b,qwen3-8b:fp8,qwen3-32b,llama-3.1-8b"
GEMM_SHAPES = {
    "wqkv": (6144, 4096),
    "wo": (4096, 4096),
    "w13": (24576, 4096),
    "w2": (4096, 12288),
}  # (N, K)
GEMM_M = (1, 16, 64, 256, 1024, 4096)
GB = 1e9


def step_of(
    run: Callable[[], object], refresh: Callable[[], None], tokens: int, label: str
) -> StepFn:
    return StepFn(run=run, refresh=refresh, tokens=tokens, batch=1, label=label)


# ---------------------------------------------------------------------------------------------
# bandwidth


def measure_bandwidth(timer: Timer, device: torch.device, mib: int) -> dict[str, Any]:
    """Copy ``mib`` MiB device to device (read + write) and read it once (a sum): GB/s of each."""
    n = mib * 2**20 // 2  # bf16 elements
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)

    def refresh() -> None:
        src.add_(1.0)

    copy = timer(step_of(lambda: dst.copy_(src), refresh, n, f"copy {mib} MiB"))
    read = timer(step_of(lambda: src.sum(dtype=torch.float32), refresh, n, f"sum {mib} MiB"))
    nbytes = n * 2
    out = {
        "bytes": nbytes,
        "copy_ms": copy.median_ms,
        "copy_gbps": 2 * nbytes / (copy.median_ms * 1e-3) / GB,  # read + written
        "read_ms": read.median_ms,
        "read_gbps": nbytes / (read.median_ms * 1e-3) / GB,
        "timer": copy.mode,
    }
    return out


# ---------------------------------------------------------------------------------------------
# targets


def parse_targets(text: str) -> list[tuple[str, bool]]:
    """``qwen3-8b,qwen3-8b:fp8`` -> [("qwen3-8b", False), ("qwen3-8b", True)]."""
    specs = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, suffix = item.partition(":")
        if suffix not in ("", "fp8", "bf16", "bfloat16"):
            raise SystemExit(f"--target: {item!r}: the suffix must be :fp8 or :bf16")
        specs.append((name, suffix == "fp8"))
    if not specs:
        raise SystemExit("--target: no target named")
    return specs


def probe_target(
    name: str,
    fp8: bool,
    batches: list[int],
    context: int,
    timer: Timer,
    device: torch.device,
    dtype: torch.dtype,
    read_gbps: float | None,
) -> dict[str, Any]:
    label = f"{name}:{'fp8' if fp8 else 'bf16'}"
    res: dict[str, Any] = {"target": name, "label": label, "fp8": fp8, "points": []}
    try:
        args = resolve_target(name)
    except ModelError as exc:
        res["error"] = first_line(exc)
        return res
    read_bytes = weight_read_bytes(args, dtype, fp8=fp8)
    kv_token = kv_bytes_per_token(args, dtype)
    res.update(params=param_count(args), weight_read_bytes=read_bytes, kv_bytes_per_token=kv_token)
    model = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        model = build_target(
            args,
            device=device,
            dtype=dtype,
            fp8=fp8,
            generator=torch.Generator(device=device).manual_seed(0),
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            res["weights_gib"] = torch.cuda.memory_allocated(device) / 2**30
        res["build_s"] = time.perf_counter() - start
        say(f"  {label}: built in {res['build_s']:.1f} s")
        for batch in batches:
            point: dict[str, Any] = {"batch": batch, "q": 1, "context_len": context}
            kv = batch * context * kv_token
            if read_gbps:
                point["weight_floor_ms"] = read_bytes / (read_gbps * GB) * 1e3
                point["weight_kv_floor_ms"] = (read_bytes + kv) / (read_gbps * GB) * 1e3
            try:
                step = target_step(model, batch=batch, q=1, context_len=context)
                t = timer(step)
                point.update(
                    ms=t.median_ms,
                    p20_ms=t.p20_ms,
                    p80_ms=t.p80_ms,
                    reps=t.reps,
                    mode=t.mode,
                    capture_mib=t.capture_mib,
                )
                if read_gbps:
                    point["over_weight_floor"] = t.median_ms / point["weight_floor_ms"]
                del step
            except Exception as exc:  # one bad point must not end the target
                point["error"] = first_line(exc)
            res["points"].append(point)
            say(
                f"  {label} b={batch}: "
                + (f"{point['ms']:.3f} ms" if "ms" in point else point["error"])
            )
            model.backend = None
            free_device_memory()
        if device.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    except Exception as exc:  # the build (or anything else) failed: record it, free, go on
        res["error"] = first_line(exc)
        say(f"  {label}: {res['error']}")
    finally:
        del model
        free_device_memory()
    return res


# ---------------------------------------------------------------------------------------------
# GEMM: bf16 vs FP8 at the target's projection shapes


def gemm_arms(
    x: torch.Tensor, w: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """One projection several ways: bf16; FP8 as the model runs it (``fp8_linear``: quantise, then
    by M the unit-scale GEMM + ``scale_out`` or the row-wise GEMM); the GEMMs alone: row-wise
    scales (also with fast accumulation) and unit scales into float32."""
    q_x, s_x = quantize_rows(x)  # [M, K] e4m3, [M, 1] float32
    s_b = s_w.view(1, -1)  # [1, N]
    one = torch.ones((), device=x.device)

    def rowwise(fast: bool) -> Callable[[], object]:
        return lambda: torch._scaled_mm(
            q_x, q_w.t(), scale_a=s_x, scale_b=s_b, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    return {
        "bf16_ms": lambda: F.linear(x, w),
        "fp8_ms": lambda: fp8_linear(x, q_w, s_w),
        "fp8_gemm_only_ms": rowwise(False),
        "fp8_fast_accum_ms": rowwise(True),
        "fp8_unit_f32_ms": lambda: torch._scaled_mm(
            q_x, q_w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
        ),
    }


def probe_gemm_shape(
    timer: Timer,
    device: torch.device,
    name: str,
    n: int,
    k: int,
    ms: tuple[int, ...],
    gen: torch.Generator,
) -> list[dict[str, Any]]:
    w = torch.randn(n, k, device=device, generator=gen).div_(k**0.5).to(torch.bfloat16)  # [N, K]
    q_w, s_w = quantize_weight(w)
    rows: list[dict[str, Any]] = []
    for m in ms:
        row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
        try:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)  # [M, K]
            row["scaled_mm"] = scaled_mm_ok(x, q_w)
            refresh = functools.partial(x.normal_, generator=gen)
            for key, run in gemm_arms(x, w, q_w, s_w).items():
                try:
                    row[key] = timer(step_of(run, refresh, m, f"gemm {name} m={m} {key}")).median_ms
                except Exception as exc:
                    row[key.replace("_ms", "_error")] = first_line(exc)
        except Exception as exc:
            row["error"] = first_line(exc)
        rows.append(row)
    return rows


def probe_gemm(
    timer: Timer, device: torch.device, shapes: dict[str, tuple[int, int]], ms: tuple[int, ...]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(1)
    for name, (n, k) in shapes.items():
        try:
            rows += probe_gemm_shape(timer, device, name, n, k, ms, gen)
        except Exception as exc:
            rows.append({"shape": name, "n": n, "k": k, "error": first_line(exc)})
        free_device_memory()
    return rows


# ---------------------------------------------------------------------------------------------
# output


def fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_tables(result: dict[str, Any]) -> None:
    bw = result.get("bandwidth") or {}
    say(
        f"\nread {fmt(bw.get('read_gbps'), '.0f')} GB/s (the floors' bandwidth), copy {fmt(bw.get('copy_gbps'), '.0f')} GB/s (read + write) "
        f"over {fmt(bw.get('bytes', 0) / 2**20, '.0f')} MiB"
    )
    say(
        f"\n{'target':<20} {'batch':>5} {'step ms':>9} {'p20-p80':>15} {'w floor':>8} {'w+kv fl':>8} {'x floor':>7}  note"
    )
    for t in result["targets"]:
        if "error" in t and not t["points"]:
            say(f"{t['label']:<20} {'':>5} {'-':>9} {'':>15} {'':>8} {'':>8} {'':>7}  {t['error']}")
            continue
        for p in t["points"]:
            band = f"{fmt(p.get('p20_ms'))}-{fmt(p.get('p80_ms'))}" if "ms" in p else ""
            say(
                f"{t['label']:<20} {p['batch']:>5} {fmt(p.get('ms')):>9} {band:>15} {fmt(p.get('weight_floor_ms')):>8} "
                f"{fmt(p.get('weight_kv_floor_ms')):>8} {fmt(p.get('over_weight_floor'), '.2f'):>7}  {p.get('error', '')}"
            )
        if "error" in t:
            say(f"{t['label']:<20} error: {t['error']}")
    if result.get("gemm"):
        say(
            f"\n{'gemm':<6} {'N x K':>12} {'M':>5} {'bf16 ms':>9} {'fp8 ms':>9} {'rowwise':>9} "
            f"{'fast acc':>9} {'unit f32':>9} {'bf16/fp8':>8}"
        )
        for r in result["gemm"]:
            ratio = r["bf16_ms"] / r["fp8_ms"] if r.get("bf16_ms") and r.get("fp8_ms") else None
            errors = "; ".join(str(v) for key, v in r.items() if key.endswith("error"))
            say(
                f"{r['shape']:<6} {r['n']:>6}x{r['k']:<5} {r.get('m', '-'):>5} {fmt(r.get('bf16_ms'), '.4f'):>9} "
                f"{fmt(r.get('fp8_ms'), '.4f'):>9} {fmt(r.get('fp8_gemm_only_ms'), '.4f'):>9} "
                f"{fmt(r.get('fp8_fast_accum_ms'), '.4f'):>9} {fmt(r.get('fp8_unit_f32_ms'), '.4f'):>9} "
                f"{fmt(ratio, '.2f'):>8}  {errors}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--target",
        default=DEFAULT_TARGETS,
        help=f"comma list of preset[:fp8] (default {DEFAULT_TARGETS})",
    )
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--copy-mib",
        type=int,
        default=None,
        help="buffer the read and copy bandwidths are measured over (default 2048 on CUDA, 16 on CPU)",
    )
    ap.add_argument("--no-gemm", action="store_true", help="skip the bf16 vs FP8 GEMM section")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args(argv)
    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        raise SystemExit(f"--batches: cannot read {args.batches!r} (e.g. 1,32,128)") from None
    if not batches or batches[0] < 1 or args.context_len < 1:
        raise SystemExit("--batches and --context-len must be >= 1")
    targets = parse_targets(args.target)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device present")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    timer = default_timer(device)
    dtype = torch.bfloat16
    started = time.perf_counter()
    sw = software_facts()
    try:
        hw = hardware_facts(device)
        hardware = {
            "gpu": hw.gpu,
            "capability": hw.capability,
            "driver": hw.driver,
            "memory_gib": hw.memory_gib,
        }
    except Exception as exc:  # NVML missing or refusing: the name from torch is enough
        hardware = {
            "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
            "error": first_line(exc),
        }
    result: dict[str, Any] = {
        "hardware": hardware,
        "software": {
            "torch": sw.torch,
            "triton": sw.triton,
            "cuda": sw.cuda,
            "spectune": sw.spectune,
        },
        "device": str(device),
        "dtype": "bfloat16",
        "batches": batches,
        "context_len": args.context_len,
        "targets": [],
        "gemm": [],
    }
    say(
        f"{hardware['gpu']}: torch {sw.torch}, triton {sw.triton}; targets {args.target}, batches {batches}, "
        f"context {args.context_len}"
    )
    try:
        result["bandwidth"] = measure_bandwidth(
            timer, device, args.copy_mib or (2048 if cuda else 16)
        )
        bw = result["bandwidth"]
        say(
            f"read bandwidth {bw['read_gbps']:.0f} GB/s, copy {bw['copy_gbps']:.0f} GB/s (read + write)"
        )
    except Exception as exc:
        result["bandwidth"] = {"error": first_line(exc)}
        say(f"bandwidth: {result['bandwidth']['error']}")
    free_device_memory()
    read_gbps = result["bandwidth"].get("read_gbps")
    for name, fp8 in targets:
        result["targets"].append(
            probe_target(name, fp8, batches, args.context_len, timer, device, dtype, read_gbps)
        )
    if cuda and not args.no_gemm:
        say("gemm: bf16 vs fp8 at qwen3-8b's projection shapes")
        try:
            result["gemm"] = probe_gemm(timer, device, GEMM_SHAPES, GEMM_M)
        except Exception as exc:
            result["gemm"] = [{"error": first_line(exc)}]
    result["wall_s"] = time.perf_counter() - started
    print_tables(result)
    path = out / "targets_probe.json"
    atomic_write_text(path, json.dumps(result, indent=1, default=str) + "\n")
    say(f"\n{result['wall_s']:.0f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
