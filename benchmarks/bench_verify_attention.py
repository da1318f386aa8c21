"""Verification attention on one GPU: Triton paged kernel vs the torch paths.

32 query heads / 8 KV heads / head_dim 128, bf16, one layer. For each context (2048, 8192), batch
(1..256) and query tokens per request (1..16): the Triton kernel over the paged cache, SDPA with
``enable_gqa=True`` and the folded SDPA path (both on a dense copy gathered once beforehand, so
the gather is not counted against them). Every point is a CUDA-graph replay, median of REPS.

Reported: ms per call, the kernel's KV read bandwidth (K+V bytes of every request's sequence /
time) as % of the measured device copy bandwidth, and time(q) / time(q=1).
Correctness against ``verify_attention_ref`` is checked first. Writes JSON to ``$OUT/`` if set,
else ``benchmarks/results/verify_attention_h200.json``.

    python benchmarks/bench_verify_attention.py
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from spectune.kernels.attention import (
    SM90_CONFIGS,
    AttnConfig,
    choose_num_splits,
    folded_dense,
    gather_dense_kv,
    sdpa_gqa_dense,
    verify_attention,
    verify_attention_folded,
    verify_attention_ref,
    verify_attention_sdpa_gqa,
)
from spectune.kernels.meta import AttnMeta
from spectune.models.paged import PagedTritonAttention
from spectune.runtime.schema import atomic_write_text

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
CONTEXTS = (2048, 8192)
BATCHES = (1, 8, 16, 64, 128, 256)
Q_TOKENS = (1, 2, 4, 8, 16)
MAX_Q = 16
REPS = 25  # timed graph replays per point (median)
TARGET_REPLAY_MS = 0.3  # calls per graph chosen so one replay lasts about this long
SWEEP_SHAPE = (2048, 64)  # (context, batch) where the kernel configs are compared
GOAL_SHAPE = 64 * 2048  # batch x context from which the goals apply
GOAL_Q16_OVER_Q1, GOAL_PCT_OF_COPY = 1.10, 90.0


# ---------------------------------------------------------------------------------------------
# Timing


def _capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> list[float]:
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def bench_graph(fn, reps: int = REPS) -> float:
    """Median ms of one call of ``fn``, from CUDA-graph replays of back-to-back calls."""
    probe = _capture(fn, 1)
    one = statistics.median(_replay_ms(probe, 5))
    del probe
    calls = max(1, min(20, math.ceil(TARGET_REPLAY_MS / max(one, 1e-3))))
    graph = _capture(fn, calls)
    ms = statistics.median(_replay_ms(graph, reps)) / calls
    del graph
    return ms


def measure_or_none(fn) -> float | None:
    """A torch path that runs out of memory (or has no kernel for the shape) is reported as null."""
    try:
        return bench_graph(fn)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        print(f"  torch path failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return None


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(1, 255)
    dst = torch.empty_like(src)
    ms = bench_graph(lambda dst=dst, src=src: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------
# Inputs


def make_step(backend: PagedTritonAttention, tables: torch.Tensor, q_lens: list[int],
              ctx_lens: list[int], pad: int = 0) -> tuple[torch.Tensor, AttnMeta]:
    meta = backend.meta_for(tables, q_lens, ctx_lens, num_tokens=sum(q_lens) + pad)  # max_q = max(q_lens)
    q = torch.randn((sum(q_lens) + pad, N_HEADS, HEAD_DIM), device="cuda", dtype=DTYPE)
    return q, meta


def check_correctness() -> dict:
    """Kernel (split and not) and torch paths vs the fp32 reference at one mixed shape."""
    q_lens, ctx_lens = [1, 7, 16], [2048, 1000, 37]
    backend = PagedTritonAttention(1, 3 * 130 + 8, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    tables = backend.allocate(3, 2048, MAX_Q)
    q, meta = make_step(backend, tables, q_lens, ctx_lens, pad=5)
    k_cache, v_cache = backend.kv(0)
    ref = verify_attention_ref(q, k_cache, v_cache, meta).float()

    def err(out: torch.Tensor) -> float:
        return ((out.float() - ref).abs().max() / ref.abs().max()).item()

    errors = {
        "triton": err(verify_attention(q, k_cache, v_cache, meta)),
        "triton_split4": err(verify_attention(q, k_cache, v_cache, meta, num_splits=4)),
        "triton_split1": err(verify_attention(q, k_cache, v_cache, meta, num_splits=1)),
        "sdpa_gqa": err(verify_attention_sdpa_gqa(q, k_cache, v_cache, meta)),
        "folded": err(verify_attention_folded(q, k_cache, v_cache, meta)),
    }
    bad = {name: e for name, e in errors.items() if not e < 1e-2}
    if bad:
        raise SystemExit(f"correctness check failed (max rel err): {bad}")
    return errors


# ---------------------------------------------------------------------------------------------
# Points


def sweep_configs() -> dict[int, AttnConfig]:
    """Best config per query-tile class (q=1 for <= 32 rows, q=16 for 64 rows), at SWEEP_SHAPE."""
    ctx, batch = SWEEP_SHAPE
    backend = PagedTritonAttention(1, batch * ((ctx + MAX_Q) // BLOCK_SIZE + 1), BLOCK_SIZE,
                                   N_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    tables = backend.allocate(batch, ctx, MAX_Q)
    k_cache, v_cache = backend.kv(0)
    best: dict[int, AttnConfig] = {}
    for q_tok in (1, 16):
        q, meta = make_step(backend, tables, [q_tok] * batch, [ctx] * batch)
        scores = {}
        for cfg in SM90_CONFIGS:
            try:
                scores[cfg] = bench_graph(lambda cfg=cfg, q=q, meta=meta: verify_attention(
                    q, k_cache, v_cache, meta, config=cfg))
            except Exception as exc:  # a config out of shared memory / registers scores inf
                print(f"  config {cfg} failed: {type(exc).__name__}", file=sys.stderr)
                scores[cfg] = math.inf
        best[q_tok] = min(scores, key=scores.__getitem__)
        print(f"  q={q_tok:2d}: " + ", ".join(f"{c.block_n}/{c.num_warps}w/{c.num_stages}s "
                                             f"{ms * 1e3:.1f}us" for c, ms in scores.items()))
    del backend
    torch.cuda.empty_cache()
    return best


def config_for(best: dict[int, AttnConfig], q_tok: int) -> AttnConfig:
    return best[16] if q_tok * (N_HEADS // N_KV_HEADS) >= 64 else best[1]


def run_shape(ctx: int, batch: int, best: dict[int, AttnConfig], num_sms: int) -> list[dict]:
    num_blocks = batch * -(-(ctx + MAX_Q) // BLOCK_SIZE)
    backend = PagedTritonAttention(1, num_blocks, BLOCK_SIZE, N_KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    tables = backend.allocate(batch, ctx, MAX_Q)
    k_cache, v_cache = backend.kv(0)
    k_dense, v_dense = (t.contiguous() for t in gather_dense_kv(k_cache, v_cache, tables))
    splits = choose_num_splits(batch, N_KV_HEADS, tables.shape[1] * BLOCK_SIZE, num_sms)
    rows = []
    for q_tok in Q_TOKENS:
        q, meta = make_step(backend, tables, [q_tok] * batch, [ctx] * batch)
        cfg = config_for(best, q_tok)
        row = {"ctx": ctx, "batch": batch, "q": q_tok, "num_splits": splits,
               "config": [cfg.block_n, cfg.num_warps, cfg.num_stages],
               "kv_bytes": batch * (ctx + q_tok) * N_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()}
        row["triton_ms"] = bench_graph(lambda q=q, meta=meta, cfg=cfg: verify_attention(
            q, k_cache, v_cache, meta, config=cfg))
        row["sdpa_gqa_ms"] = measure_or_none(lambda q=q, meta=meta, k=k_dense, v=v_dense: sdpa_gqa_dense(q, k, v, meta))
        row["folded_ms"] = measure_or_none(lambda q=q, meta=meta, k=k_dense, v=v_dense: folded_dense(q, k, v, meta))
        rows.append(row)
    del backend, k_dense, v_dense
    torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict], copy_gbs: float) -> None:
    by_shape = {(r["ctx"], r["batch"], r["q"]): r for r in rows}
    for r in rows:
        r["triton_gbs"] = r["kv_bytes"] / (r["triton_ms"] * 1e-3) / 1e9
        r["pct_of_copy"] = 100.0 * r["triton_gbs"] / copy_gbs
        r["over_q1"] = r["triton_ms"] / by_shape[(r["ctx"], r["batch"], 1)]["triton_ms"]
        for name in ("sdpa_gqa", "folded"):
            ms = r[f"{name}_ms"]
            r[f"{name}_over_triton"] = ms / r["triton_ms"] if ms is not None else None
        if r["ctx"] * r["batch"] >= GOAL_SHAPE:
            r["meets_goal"] = bool(r["pct_of_copy"] >= GOAL_PCT_OF_COPY
                                   and (r["q"] != 16 or r["over_q1"] <= GOAL_Q16_OVER_Q1))


def print_table(rows: list[dict], copy_gbs: float) -> None:
    def fmt(ms: float | None, width: int, scale: float = 1.0) -> str:
        return "n/a".rjust(width) if ms is None else f"{ms * scale:>{width}.{1 if scale > 1 else 2}f}"

    print(f"\ndevice copy bandwidth: {copy_gbs:.0f} GB/s (read + written)")
    head = (f"{'ctx':>5} {'batch':>5} {'q':>3} {'split':>5} {'triton_us':>10} {'sdpa_us':>9} "
            f"{'folded_us':>9} {'GB/s':>6} {'%copy':>6} {'/q1':>5} {'sdpa/tr':>7} {'fold/tr':>7} goal")
    print(head)
    print("-" * len(head))
    for r in rows:
        goal = "" if "meets_goal" not in r else ("ok" if r["meets_goal"] else "MISS")
        print(f"{r['ctx']:>5} {r['batch']:>5} {r['q']:>3} {r['num_splits']:>5} "
              f"{r['triton_ms'] * 1e3:>10.1f} {fmt(r['sdpa_gqa_ms'], 9, 1e3)} {fmt(r['folded_ms'], 9, 1e3)} "
              f"{r['triton_gbs']:>6.0f} {r['pct_of_copy']:>6.1f} {r['over_q1']:>5.2f} "
              f"{fmt(r['sdpa_gqa_over_triton'], 7)} {fmt(r['folded_over_triton'], 7)} {goal}")


def output_path() -> Path:
    out = os.environ.get("OUT")
    if out:
        return Path(out) / "verify_attention_h200.json"
    return Path(__file__).resolve().parent / "results" / "verify_attention_h200.json"


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_verify_attention: needs a CUDA device", file=sys.stderr)
        return 1
    began = time.perf_counter()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}")
    errors = check_correctness()
    print("correctness (max rel err vs reference): " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    copy_gbs = copy_bandwidth_gbs()
    print(f"config sweep at ctx {SWEEP_SHAPE[0]}, batch {SWEEP_SHAPE[1]} (block_n/warps/stages):")
    best = sweep_configs()
    rows = []
    for ctx in CONTEXTS:
        for batch in BATCHES:
            rows += run_shape(ctx, batch, best, props.multi_processor_count)
    summarize(rows, copy_gbs)
    print_table(rows, copy_gbs)
    result = {
        "device": props.name, "sm_count": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": str(DTYPE).removeprefix("torch."), "block_size": BLOCK_SIZE},
        "method": f"CUDA-graph replay, median of {REPS}; torch paths on a dense pre-gathered KV copy",
        "copy_bandwidth_gbs": copy_gbs,
        "correctness_max_rel_err": errors,
        "configs": {str(q): [c.block_n, c.num_warps, c.num_stages] for q, c in best.items()},
        "rows": rows,
        "seconds": time.perf_counter() - began,
    }
    path = output_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
