"""Held-out simulation: a policy tuned on one acceptance source, served on others.

For each served source and concurrency: goodput of plain, every fixed K 1..max_fixed, and auto
(the policy with its online controller; a fresh planner per run), over seeds with common random
numbers; prints auto / best other arm and auto / plain, and writes JSON.

    python benchmarks/sim_heldout.py spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.ctx320.policy.yaml \
        --out benchmarks/results/sim_heldout_h200_ctx320.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from spectune.autotune.acceptance import load_acceptance
from spectune.autotune.simulator import FixedK, simulate
from spectune.io import atomic_write_text
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Planner
from spectune.runtime.table import read_table

TRACES = Path(__file__).resolve().parents[1] / "spectune" / "data" / "traces"
SOURCES = {
    "public": "public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench",
    **{path.name.split(".")[0]: str(path) for path in sorted(TRACES.glob("*.jsonl.gz"))},
    "high-0.9": "curve:" + ",".join(f"{0.9 ** i:.6f}" for i in range(1, 16)),
    "low-0.55": "curve:" + ",".join(f"{0.55 ** i:.6f}" for i in range(1, 16)),
    "mixture": "mixture:0.5*curve(" + ",".join(f"{0.95 ** i:.6f}" for i in range(1, 16))
               + ")+0.5*curve(" + ",".join(f"{0.35 ** i:.6f}" for i in range(1, 16)) + ")",
}
CONCURRENCY = (1, 4, 16, 64, 256)


def evaluate(table_path: str, sources: dict[str, str], concurrencies=CONCURRENCY, *, max_fixed: int = 7,
             seeds: int = 2, steps: int = 1500, mean_output_tokens: float = 128.0) -> list[dict]:
    table = read_table(table_path)
    cost = CostModel.of(table)
    ctx = table.policy.context_len if table.policy else None
    rows = []
    for name, src in sources.items():
        acc = load_acceptance(src, max_k=table.workload.max_k)
        for c in concurrencies:
            arms: dict[str, float] = {}
            auto_k: dict[int, int] = {}
            for arm in ["plain", *(f"fixed:{k}" for k in range(1, max_fixed + 1)), "auto"]:
                g = []
                for seed in range(seeds):
                    if arm == "auto":
                        fn = Planner(table)
                    else:
                        fn = FixedK(0 if arm == "plain" else int(arm.split(":")[1]))
                    r = simulate(cost, acc, fn, concurrency=c, steps=steps, seed=seed, context_len=ctx,
                                 mean_output_tokens=mean_output_tokens)
                    g.append(r.goodput_tok_s)
                    if arm == "auto":
                        for k, n in r.k_hist.items():
                            auto_k[k] = auto_k.get(k, 0) + n
                arms[arm] = math.exp(sum(math.log(x) for x in g) / len(g))
            best_arm = max((a for a in arms if a != "auto"), key=arms.__getitem__)
            rows.append(dict(source=name, concurrency=c, arms=arms, best_other=best_arm,
                             auto_over_best=arms["auto"] / arms[best_arm],
                             auto_over_plain=arms["auto"] / arms["plain"], auto_k_hist=auto_k))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--sources", default=",".join(SOURCES), help="names from: " + ", ".join(SOURCES))
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    names = a.sources.split(",")
    t0 = time.time()
    rows = evaluate(a.policy, {n: SOURCES[n] for n in names}, [int(c) for c in a.concurrency.split(",")],
                    seeds=a.seeds, steps=a.steps)
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
