"""CUDA-graph capture memory and time: the policy's verification tiers vs fixed-K graphs.

Three graph sets for the same target (one shared graph memory pool per set, captured largest
first, as engines do):
  tiers    the policy table's tiers (token counts; any batch and K that fit replay one of them)
  fixed-K  one graph per captured batch size b at the policy's largest K: b * (K + 1) tokens
  per-K    one graph per (batch size, K) for K = 1..max K: what adaptive K costs when every
           K gets its own graphs
Captured batch sizes: 1, 2, 4 and multiples of 8 up to the table's max batch (vLLM's default
capture list has this shape). Memory is the growth of reserved device memory over the set
(cache emptied before), time is wall-clock of all captures.

    python benchmarks/bench_capture.py spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.policy.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from spectune.io import atomic_write_text
from spectune.models.build import even_split, fit_paged_cache
from spectune.models.config import resolve_target
from spectune.models.decoder import Transformer
from spectune.runtime.planner import load

MIB = 2**20


def capture_sizes(max_batch: int) -> list[int]:
    return sorted({b for b in [1, 2, 4, *range(8, max_batch + 1, 8)] if b <= max_batch})


def capture_set(model: Transformer, backend, token_counts: list[int], max_batch: int, context: int,
                device: torch.device) -> dict:
    """Capture one graph per token count into one shared pool; returns MiB, seconds, graphs."""
    graphs, keep = [], []
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pool = torch.cuda.graph_pool_handle()
    start = time.perf_counter()
    for tokens in sorted(set(token_counts), reverse=True):
        batch = min(tokens, max_batch)
        q_lens = even_split(tokens, batch)
        meta = backend.meta_for(backend.block_tables[:batch], q_lens, [context] * batch,
                                num_tokens=tokens, max_q=max(q_lens))
        ids = torch.randint(1, model.args.vocab_size, (tokens,), device=device)
        positions = torch.tensor([context + j for q in q_lens for j in range(q)], device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(ids, positions, meta)  # warm-up: Triton compiles, cuBLAS handles
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = model(ids, positions, meta)
        graphs.append(graph)
        keep.append((ids, positions, meta, out))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    mib = (torch.cuda.memory_reserved() - before) / MIB
    del graphs, keep
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"graphs": len(set(token_counts)), "mib": round(mib, 1), "seconds": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy")
    ap.add_argument("--context", type=int, default=512, help="cached context per request (capture memory does not depend on it)")
    args = ap.parse_args()
    planner = load(args.policy, on_gpu_mismatch="ignore")
    table = planner.table
    tiers = list(table.policy.tiers)
    max_batch = table.workload.max_batch
    max_k = max(row.k for row in table.policy.rows)
    device = torch.device("cuda")
    model_args = resolve_target(table.workload.target)
    dtype = getattr(torch, table.workload.dtype)
    model = Transformer(model_args, None, device=device, dtype=dtype)
    backend = fit_paged_cache(model, model_args.n_layers, batch=max_batch, ctx_max=args.context, max_q=max_k + 1)
    model.backend = backend
    sizes = capture_sizes(max_batch)
    sets = {
        "tiers": tiers,
        f"fixed-K{max_k}": [b * (max_k + 1) for b in sizes],
        f"per-K 1..{max_k}": [b * (k + 1) for k in range(1, max_k + 1) for b in sizes],
    }
    rows = {}
    for name, counts in sets.items():
        rows[name] = capture_set(model, backend, counts, max_batch, args.context, device)
        print(f"{name:>14}: {rows[name]['graphs']:4d} graphs  {rows[name]['mib']:8.1f} MiB  {rows[name]['seconds']:6.2f} s",
              flush=True)
    fixed = rows[f"fixed-K{max_k}"]
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "policy": args.policy,
        "target": table.workload.target, "dtype": table.workload.dtype, "max_batch": max_batch,
        "max_k": max_k, "capture_batch_sizes": sizes, "sets": rows,
        "tiers_over_fixed_mib": round(rows["tiers"]["mib"] / fixed["mib"], 3) if fixed["mib"] else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"tiers / fixed-K capture memory: {result['tiers_over_fixed_mib']}")
    out = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results")) / "capture_h200.json"
    atomic_write_text(out, json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
