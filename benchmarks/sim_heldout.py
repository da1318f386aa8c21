"""Held-out simulation: a policy tuned on one acceptance source, served on others.

For each served source (``spectune.autotune.whatif.heldout_sources``: every shipped trace set,
0.9^i, 0.55^i, a drift from one to the other, a two-class and an extreme mixture) and
concurrency: goodput of plain, every fixed K 1..7 and auto (the policy with its online
controller; a fresh planner per run) in an open workload, over seeds with common random numbers
(``whatif.compare_open``, the path ``tests/autotune/test_heldout.py`` asserts on); prints auto /
best other arm and auto / plain, and writes JSON.

    python benchmarks/sim_heldout.py spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml \
        --out benchmarks/results/sim_heldout_h200_ctx320.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from spectune.autotune.whatif import compare_open, heldout_sources
from spectune.io import atomic_write_text
from spectune.runtime.table import read_table

CONCURRENCY = (1, 4, 16, 64, 256)
PUBLIC = "public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench"


def main(argv=None) -> int:
    sources = {"public": (PUBLIC, None), **heldout_sources()}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--sources", default=",".join(sources), help="names from: " + ", ".join(sources))
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1200, help="steps per run (batch 1: --steps-batch1)")
    ap.add_argument("--steps-batch1", type=int, default=4000, help="so that as many requests finish as at larger batches")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    table = read_table(a.policy)
    unknown = [n for n in a.sources.split(",") if n not in sources]
    if unknown:
        print(f"sim_heldout: --sources: unknown {', '.join(unknown)} (known: {', '.join(sources)})", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = []
    for name in a.sources.split(","):
        acc, drift = sources[name]
        for r in compare_open(table, acc, [int(c) for c in a.concurrency.split(",")], drift=drift,
                              seeds=range(a.seeds), steps=a.steps, steps_batch1=a.steps_batch1):
            rows.append({"source": name, **r})
    print(f"{'source':24s} {'c':>4s} {'auto/best':>9s} {'best':>8s} {'auto/plain':>10s}  auto K steps")
    for r in rows:
        ks = " ".join(f"{k}:{n}" for k, n in sorted(r["auto_k_hist"].items()))
        print(f"{r['source']:24s} {r['concurrency']:4d} {r['auto_over_best']:9.3f} {r['best_other']:>8s} "
              f"{r['auto_over_plain']:10.3f}  {ks}")
    worst = min(rows, key=lambda r: r["auto_over_best"])
    print(f"worst auto/best {worst['auto_over_best']:.3f} ({worst['source']} c={worst['concurrency']}); "
          f"{time.time() - t0:.0f} s", file=sys.stderr)
    if a.out:
        atomic_write_text(a.out, json.dumps({"policy": a.policy, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
