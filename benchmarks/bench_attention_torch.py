"""Verification attention alone: SDPA with ``enable_gqa=True`` vs query heads folded into the query
axis (each request's KV read once), 32 query heads / 8 KV heads / head_dim 128, per (context,
batch, query tokens per request), CUDA-graph replays; KV-read floor at the given bandwidth.

    python benchmarks/bench_attention_torch.py            # GPU: ~100 points, well under 2 minutes
    python benchmarks/bench_attention_torch.py --cpu      # tiny shapes, wall-clock, eager

Checks the two paths against the float64 reference first, prints a table, writes JSON to
``$OUT/bench_attention_torch.json`` (or ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

from spectune.autotune.timing import CudaGraphTimer, InfeasiblePoint, Timer, WallClockTimer
from spectune.io import atomic_write_text
from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.attention import AttnMode, DenseTorchAttention, reference_attention
from spectune.models.build import StepFn, free_device_memory

GPU_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "contexts": [2048, 8192],
             "batches": [1, 4, 16, 64, 256], "qs": [1, 2, 4, 8, 16]}
CPU_SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 32, "contexts": [64, 256],
             "batches": [1, 4], "qs": [1, 4]}
MODES: tuple[AttnMode, ...] = ("sdpa_gqa", "folded")


def check_correctness(shape: dict, device: torch.device) -> float:
    """Both modes against the float64 reference on a small mixed batch; returns the max error."""
    h, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q_lens, ctx_lens, pad = [1, 4, 2], [37, 5, 64], 3
    meta = AttnMeta.from_lens(q_lens, ctx_lens, device=device, max_q=4)
    t = sum(q_lens) + pad
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(t, n, d, device=device, dtype=torch.float32, generator=gen)
               for n in (h, hkv, hkv))
    worst = 0.0
    for mode in MODES:
        backend = DenseTorchAttention(1, 3, 64, 4, hkv, d, dtype=torch.float32, device=device, mode=mode)
        backend.randomize_(gen)
        k_ctx, v_ctx = (c.double().cpu() for c in backend.cache(0))
        out = backend(0, q, k, v, meta).double().cpu()
        ref = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                  AttnMeta.from_lens(q_lens, ctx_lens, max_q=4), k_ctx, v_ctx)
        err = (out - ref).abs().max().item()
        if err > 1e-3:
            raise SystemExit(f"{mode}: max error {err:.2e} against the reference")
        worst = max(worst, err)
    return worst


def attention_step(backend: DenseTorchAttention, mode: AttnMode, batch: int, q_len: int, ctx: int,
                   heads: int) -> StepFn:
    device, dtype = backend.k_store.device, backend.k_store.dtype
    t = batch * q_len
    meta = AttnMeta.from_lens([q_len] * batch, [ctx] * batch, device=device, max_q=q_len)
    q = torch.empty(t, heads, backend.head_dim, device=device, dtype=dtype)  # [T, H, D]
    k = torch.empty(t, backend.n_kv_heads, backend.head_dim, device=device, dtype=dtype)  # [T, Hkv, D]
    v = torch.empty_like(k)

    def refresh() -> None:
        for x in (q, k, v):
            x.normal_()

    def run() -> object:
        backend.mode = mode
        return backend(0, q, k, v, meta)

    refresh()
    return StepFn(run=run, refresh=refresh, tokens=t, batch=batch, label=f"{mode} b={batch} q={q_len}")


def kv_floor_ms(batch: int, ctx: int, kv_heads: int, head_dim: int, elem: int, tbps: float) -> float:
    return 2 * batch * ctx * kv_heads * head_dim * elem / (tbps * 1e12) * 1e3


def run_grid(shape: dict, device: torch.device, dtype: torch.dtype, timer: Timer, tbps: float) -> list[dict]:
    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    for ctx in shape["contexts"]:
        for batch in shape["batches"]:
            backend = DenseTorchAttention(1, batch, ctx, max(shape["qs"]), shape["kv_heads"],
                                          shape["head_dim"], dtype=dtype, device=device)
            backend.randomize_()
            for q_len in shape["qs"]:
                row = {"ctx": ctx, "bs": batch, "q": q_len,
                       "floor_ms": round(kv_floor_ms(batch, ctx, shape["kv_heads"], shape["head_dim"],
                                                     elem, tbps), 4)}
                for mode in MODES:
                    step = attention_step(backend, mode, batch, q_len, ctx, shape["heads"])
                    try:
                        row[f"{mode}_ms"] = round(timer(step).median_ms, 4)
                    except InfeasiblePoint as exc:
                        row[f"{mode}_ms"] = None
                        row["error"] = str(exc)
                rows.append(row)
                print(f"{ctx:>6} {batch:>4} {q_len:>3} {_fmt(row['sdpa_gqa_ms'])} "
                      f"{_fmt(row['folded_ms'])} {row['floor_ms']:>10.4f}", flush=True)
            del backend
            free_device_memory()
    return rows


def _fmt(ms: float | None) -> str:
    return f"{ms:>10.4f}" if ms is not None else f"{'OOM':>10}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--bandwidth-tbps", type=float, default=4.2, help="KV-read floor bandwidth")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT or benchmarks/results)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if on_gpu else "cpu")
    shape = GPU_SHAPE if on_gpu else CPU_SHAPE
    dtype = torch.bfloat16 if on_gpu else torch.float32
    timer: Timer = CudaGraphTimer(warmup=3, reps=20) if on_gpu else WallClockTimer(warmup=1, reps=5)

    err = check_correctness(shape, device)
    print(f"correctness: both modes match the float64 reference (max error {err:.1e})")
    print(f"{'ctx':>6} {'bs':>4} {'q':>3} {'sdpa_gqa':>10} {'folded':>10} {'kv floor':>10}  (ms)")
    rows = run_grid(shape, device, dtype, timer, args.bandwidth_tbps)

    result = {
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
        "timer": "cuda-graph" if on_gpu else "wall-clock", "bandwidth_tbps": args.bandwidth_tbps,
        "heads": shape["heads"], "kv_heads": shape["kv_heads"], "head_dim": shape["head_dim"],
        "max_correctness_error": err, "rows": rows,
    }
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    path = Path(args.out) if args.out else out_dir / "bench_attention_torch.json"
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
