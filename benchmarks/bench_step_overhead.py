"""Device overhead of the adaptive step: allocate + pack + accept + stats vs a fixed-K step.

Both paths run the same dummy target (an embedding lookup: [T] -> [T, V], near-zero cost) so the
difference is the runtime's own work. Adaptive: the pool's captured verify graph (allocation of a
device budget, packing, greedy acceptance, counters). Fixed K: pack with every request granted K,
the target, argmax, acceptance, no allocation and no counters. Correctness first: with a budget of
``batch * K`` and equal confidences both paths emit the same tokens.

On CUDA each path is a CUDA graph timed with events (median of replays); without CUDA a tiny
eager run with wall-clock time through Triton's interpreter (not a performance figure).
Prints a table; writes JSON to $OUT or benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the tiny CPU run uses Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from spectune.io import atomic_write_text  # noqa: E402
from spectune.kernels.accept import accept_greedy  # noqa: E402
from spectune.kernels.pack import PackedBatch, pack  # noqa: E402
from spectune.runtime.step import AdaptiveVerifier, GraphPool  # noqa: E402

VOCAB = 4096


@dataclass(frozen=True)
class Plan:
    k: int
    verify_budget: int
    tier: int


def dummy_target(vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=g).to(device)  # [V, V]

    def forward(input_ids, positions, meta):
        return table[input_ids]  # [T, V]

    return forward


def time_fn(fn: Callable[[], None], cuda: bool, reps: int) -> float:
    """Median milliseconds of ``fn``."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def fixed_k_step(forward, verifier: AdaptiveVerifier, batch: int, k: int, tier: int):
    """Pack with uniform grants -> target -> argmax -> accept, on the pool's static inputs."""
    b = verifier.pool.buf
    grant = torch.full((batch,), k, dtype=torch.int32, device=b.drafts.device)
    packed = PackedBatch.empty(batch, tier, b.drafts.device)
    out = None

    def run():
        nonlocal out
        pack(b.last_token[:batch], b.drafts[:batch], grant, b.context_lens[:batch], b.block_tables[:batch],
             verifier.pool.block_size, tier, out=packed)
        logits = forward(packed.input_ids, packed.positions, None)
        out = accept_greedy(logits.argmax(-1), b.drafts[:batch], packed.cu_seqlens_q)

    run()
    return run, lambda: out


def bench(batches: list[int], ks: list[int], device: torch.device, reps: int) -> list[dict]:
    cuda = device.type == "cuda"
    forward = dummy_target(VOCAB, device)
    rows = []
    for k in ks:
        tiers = sorted({b * (k + 1) for b in batches})
        pool = GraphPool(forward, tiers, max_batch=max(batches), max_k=k, device=device)
        verifier = AdaptiveVerifier(pool)
        g = torch.Generator().manual_seed(k)
        for batch in batches:
            tier = batch * (k + 1)
            plan = Plan(k, batch * k, tier)
            last = torch.randint(0, VOCAB, (batch,), generator=g).to(device)
            ctx = torch.randint(0, 100, (batch,), generator=g).to(torch.int32).to(device)
            drafts = torch.randint(0, VOCAB, (batch, k), generator=g).to(device)
            adaptive = verifier.step(last, drafts, None, batch, plan, context_lens=ctx)
            adaptive_tokens = adaptive.out_tokens.clone()
            run_fixed, fixed_out = fixed_k_step(forward, verifier, batch, k, tier)
            fixed_graph = None
            if cuda:
                fixed_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(fixed_graph):
                    run_fixed()
                fixed_graph.replay()
            result = fixed_out()
            assert result is not None and torch.equal(result.out_tokens, adaptive_tokens), "paths disagree"
            t_adaptive = time_fn(lambda: pool.run(tier, True), cuda, reps)  # noqa: B023
            t_fixed = time_fn(fixed_graph.replay if fixed_graph is not None else run_fixed, cuda, reps)
            rows.append({"k": k, "batch": batch, "tier": tier, "adaptive_ms": t_adaptive,
                         "fixed_k_ms": t_fixed, "overhead_ms": t_adaptive - t_fixed})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    batches, ks, reps = ([1, 8, 32, 128], [7, 15], args.reps) if cuda else ([1, 8], [7], 3)
    rows = bench(batches, ks, device, reps)
    print(f"{'K':>3} {'batch':>5} {'tier':>5} {'adaptive ms':>12} {'fixed-K ms':>11} {'overhead ms':>12}")
    for r in rows:
        print(f"{r['k']:>3} {r['batch']:>5} {r['tier']:>5} {r['adaptive_ms']:>12.4f} {r['fixed_k_ms']:>11.4f} "
              f"{r['overhead_ms']:>12.4f}")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    path = out_dir / "step_overhead.json"
    atomic_write_text(path, json.dumps({"device": name, "vocab": VOCAB, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
