"""A trace set simulated two ways: acceptance per offered draft (the trace model today) and per
planned draft (a declined draft counted as rejected, as the engine's counters count it).

An n-gram or suffix drafter offers fewer drafts than the step verifies where its match is short,
and none where nothing matches (`docs/TRACES.md`). The trace acceptance model counts position i
only in the steps that offered it, so it is the acceptance of the drafts that were offered. The
engine plans a step's shape before it knows what the drafter will offer, so a declined slot is
paid for, and the controller's counters count it as tested and rejected
(`Engine._count_declined`, `docs/BENCH_METHOD.md`). This script writes a copy of the trace set in
which every step offered the set's K (the largest `offered` in it; `accepted` unchanged, so a
declined position reads as the first rejection), runs `spectune simulate --json` on both, and
prints each arm's goodput and accepted length side by side.

    PYTHONPATH=. python benchmarks/sim_declined_drafts.py spectune/profiles/nvidia-h100_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml \\
        --trace spectune/data/traces/mtbench-ngram.jsonl.gz --concurrency 1 --requests 24 --decode-tokens 63 --repeats 6 \\
        --out benchmarks/results/heldout_h100own_v26/sim_declined_drafts_mtbench_c1.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from spectune.io import atomic_write_text


def planned_copy(trace: Path, out: Path) -> int:
    """Write ``trace`` with every step's ``offered`` set to the set's K; return that K."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    k = max(int(r["offered"]) for r in rows)
    with gzip.open(out, "wt") as f:
        for r in rows:
            r = {**r, "offered": k, "accepted": int(r["accepted"]), "step": int(r["step"])}
            r.pop("conf", None)  # confidences belong to the offered drafts only
            f.write(json.dumps(r) + "\n")
    return k


def simulate(policy: str, acceptance: str, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "spectune", "simulate", policy, "--acceptance", acceptance, "--json", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["rows"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--trace", required=True, help="a trace set (JSONL, .gz)")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--requests", default="24")
    ap.add_argument("--decode-tokens", default="63")
    ap.add_argument("--repeats", default="6")
    ap.add_argument("--arms", default="plain,fixed:1,fixed:2,fixed:3,auto")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    extra = ["--concurrency", a.concurrency, "--requests", a.requests, "--decode-tokens", a.decode_tokens,
             "--repeats", a.repeats, "--arms", a.arms, "--shared-planner"]
    with tempfile.TemporaryDirectory() as tmp:
        planned = Path(tmp) / f"planned-{Path(a.trace).name.removesuffix('.gz')}.gz"
        k = planned_copy(Path(a.trace), planned)
        per_offered = simulate(a.policy, a.trace, extra)
        per_planned = simulate(a.policy, str(planned), extra)
    print(f"{'c':>4s} {'arm':>8s} {'per offered draft':>20s} {'per planned draft':>20s}   (tok/s, accepted length)")
    for x, y in zip(per_offered, per_planned, strict=True):
        print(f"{x['concurrency']:4d} {x['arm']:>8s} {x['goodput_tok_s']:11.1f} {x['mean_accept_len']:7.3f} "
              f"{y['goodput_tok_s']:12.1f} {y['mean_accept_len']:7.3f}")
    if a.out:
        atomic_write_text(a.out, json.dumps({"policy": a.policy, "trace": a.trace, "k": k, "args": extra,
                                             "per_offered_draft": per_offered, "per_planned_draft": per_planned},
                                            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
