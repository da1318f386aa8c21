"""A trace set simulated two ways beside the GPU: the classes fitted per offered draft
(``FILE#declined=offered``) and the trace set replayed token by token (the simulator's default
for a trace set: ``spectune.autotune.simulator``, "Token replay"), with bench results of the same
set printed beside (``--measured``: full-load tok/s over plain decoding's).

An n-gram or suffix drafter offers fewer drafts than the step verifies where its match is short,
and none where nothing matches (`docs/TRACES.md`). The runtime plans a step's shape before it
knows what the drafter will offer, so a declined slot is paid for, and the controller's counters
count it as tested and rejected (`Engine._count_declined`, `docs/BENCH_METHOD.md`). Per offered
draft, position i counts only in the steps that offered it: the acceptance of the drafts that
were offered. The token replay plays the recorded steps as the bench's engine does, a declined
draft a rejection, and a step that starts inside a recorded step accepting what that step had
left (acceptance that depends on K, as an n-gram span does). This script runs `spectune simulate
--json` on both and prints each arm's goodput, accepted length and full-load ratio to plain.

    R=benchmarks/results
    PYTHONPATH=. python benchmarks/sim_declined_drafts.py spectune/profiles/nvidia-h100_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml \\
        --trace spectune/data/traces/mtbench-ngram.jsonl.gz --concurrency 1,16,64,256 --requests 24,48,128,320 --repeats 3 \\
        --measured $R/heldout_h100own_v2[346]/bench_heldout_mtbench_h100own_v2*.json \\
        --out $R/trace_planned_v27/sim_vs_h100_mtbench.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from spectune.io import atomic_write_text


def simulate(policy: str, acceptance: str, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "spectune", "simulate", policy, "--acceptance", acceptance, "--json", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["rows"]


def measured_ratios(paths: list[str]) -> dict[tuple[int, str], float]:
    """(concurrency, arm) -> full-load tok/s over plain decoding's, from bench JSONs (mean of files)."""
    seen: dict[tuple[int, str], list[float]] = {}
    for path in paths:
        arms = json.loads(Path(path).read_text())["summary_full_load"]["arms"]
        plain = {a["concurrency"]: a["full_tok_s"] for a in arms if a["arm"] == "plain"}
        for a in arms:
            if a["concurrency"] in plain and a["arm"] != "plain":
                seen.setdefault((a["concurrency"], a["arm"]), []).append(a["full_tok_s"] / plain[a["concurrency"]])
    return {key: sum(v) / len(v) for key, v in seen.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--trace", required=True, help="a trace set (JSONL, .gz)")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--requests", default="24", help="requests per concurrency: one number, or one per concurrency")
    ap.add_argument("--decode-tokens", default="63")
    ap.add_argument("--repeats", default="6")
    ap.add_argument("--arms", default="plain,fixed:1,fixed:2,fixed:3,auto")
    ap.add_argument("--measured", nargs="*", default=[], metavar="BENCH_JSON",
                    help="bench results of the same trace set: their full-load ratios to plain printed beside")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    conc, reqs = a.concurrency.split(","), a.requests.split(",")
    if len(reqs) not in (1, len(conc)):
        ap.error(f"--requests: one number or one per concurrency ({len(conc)}), got {len(reqs)}")
    try:
        measured = measured_ratios(a.measured)
    except (OSError, ValueError, KeyError) as exc:
        ap.error(f"--measured: not a bench result JSON: {exc}")
    per_offered: list[dict] = []
    replayed: list[dict] = []
    runs = []
    for c, n in zip(conc, reqs * len(conc) if len(reqs) == 1 else reqs, strict=False):
        extra = ["--concurrency", c, "--requests", n, "--decode-tokens", a.decode_tokens,
                 "--repeats", a.repeats, "--arms", a.arms, "--shared-planner"]
        runs.append(extra)
        per_offered += simulate(a.policy, f"{a.trace}#declined=offered", extra)
        replayed += simulate(a.policy, a.trace, extra)
    print(f"{'c':>4s} {'arm':>8s} {'classes per offered draft':>28s} {'token replay':>28s} {'measured':>9s}")
    print(f"{'':13s} {'tok/s accepted full/plain':>28s} {'tok/s accepted full/plain':>28s} {'full/plain':>9s}")
    plain = {(r["concurrency"], m): r["full_tok_s"] for m, rows in (("o", per_offered), ("p", replayed))
             for r in rows if r["arm"] == "plain"}
    for x, y in zip(per_offered, replayed, strict=True):
        c = x["concurrency"]
        ro = x["full_tok_s"] / plain[(c, "o")] if (c, "o") in plain else float("nan")
        rp = y["full_tok_s"] / plain[(c, "p")] if (c, "p") in plain else float("nan")
        m = measured.get((c, x["arm"]))
        print(f"{c:4d} {x['arm']:>8s} {x['goodput_tok_s']:11.1f} {x['mean_accept_len']:7.3f} {ro:8.3f} "
              f"{y['goodput_tok_s']:11.1f} {y['mean_accept_len']:7.3f} {rp:8.3f} "
              f"{'' if m is None else f'{m:9.3f}'}")
    if a.out:
        atomic_write_text(a.out, json.dumps({"policy": a.policy, "trace": a.trace, "args": runs,
                                             "per_offered_draft": per_offered, "token_replay": replayed,
                                             "measured": a.measured,
                                             "measured_full_over_plain": [{"concurrency": c, "arm": arm, "ratio": r}
                                                                          for (c, arm), r in sorted(measured.items())]},
                                            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
