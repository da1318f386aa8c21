"""Padded rows per step: tier packing vs per-request padding, on grants from an acceptance curve.

Each step draws per-request acceptance around a published-style survival curve, allocates a
verify budget of ``batch * sum(survival)`` drafts with the allocation reference, and counts padded
rows for (a) packing into the smallest captured tier and (b) padding every request to the step's
longest query. Prints a table; writes JSON to $OUT or benchmarks/results/.

    python benchmarks/bench_padding.py [--steps 20] [--max-batch 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from spectune.io import atomic_write_text
from spectune.kernels.allocate import allocate_ref
from spectune.kernels.pack import padding_waste

SURVIVAL = [0.78, 0.58, 0.43, 0.32, 0.24, 0.18, 0.13]  # s_1..s_7
TIERS = [1, 2, 4, *range(8, 257, 8), *range(272, 1025, 16), *range(1056, 2049, 32)]
SHOWN = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]


def conditional(survival: list[float]) -> list[float]:
    prev = [1.0, *survival[:-1]]
    return [s / p for s, p in zip(survival, prev, strict=True)]


def sample_grants(batch: int, g: torch.Generator) -> list[int]:
    k = len(SURVIVAL)
    base = torch.tensor(conditional(SURVIVAL))  # [K]
    # requests differ: each scales the curve's log-acceptance by a factor around 1
    scale = torch.exp(0.5 * torch.randn(batch, 1, generator=g))  # [B, 1]
    conf = torch.exp(torch.log(base)[None, :] * scale).clamp(0.0, 1.0)  # [B, K]
    budget = round(batch * sum(SURVIVAL))
    k_valid = torch.full((batch,), k, dtype=torch.int32)
    return allocate_ref(conf, k_valid, budget).tolist()


def run(steps: int, max_batch: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for batch in range(1, max_batch + 1):
        tier_pad, req_pad, tokens = [], [], []
        for _ in range(steps):
            w = padding_waste(sample_grants(batch, g), TIERS)
            assert w.tier_pad_rows is not None and w.tier_pad_rows >= 0 and w.request_pad_rows >= 0
            tier_pad.append(w.tier_pad_rows)
            req_pad.append(w.request_pad_rows)
            tokens.append(w.tokens)
        rows.append({
            "batch": batch,
            "tokens": statistics.fmean(tokens),
            "tier_pad_rows": statistics.fmean(tier_pad),
            "request_pad_rows": statistics.fmean(req_pad),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = run(args.steps, args.max_batch, args.seed)
    print(f"{'batch':>5} {'tokens':>8} {'tier pad':>9} {'req pad':>9} {'tier %':>7} {'req %':>7}")
    for r in rows:
        if r["batch"] in SHOWN:
            t = r["tokens"]
            print(f"{r['batch']:>5} {t:>8.1f} {r['tier_pad_rows']:>9.1f} {r['request_pad_rows']:>9.1f} "
                  f"{100 * r['tier_pad_rows'] / t:>6.1f}% {100 * r['request_pad_rows'] / t:>6.1f}%")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    path = out_dir / "padding.json"
    atomic_write_text(path, json.dumps({"survival": SURVIVAL, "tiers": TIERS, "steps": args.steps,
                                        "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
