"""How close end to end can come to decode: the prompts' compute as a ceiling, beside the simulator.

Every prompt token passes through the target once. Where the decode steps already run past the
profile's compute knee, a prompt token costs about the fitted cost of one more token there
(``token_ms + compute_ms`` of the target fit: no packing overhead, no weight read, no lm_head
discount), whatever forward it rides in. So an engine whose decode steps deliver D tok/s, serving
requests of P prompt tokens and N output tokens (the first of them from the prefill, N - 1 from
decode steps), reaches about

    e2e / decode <= (N / (N - 1)) / (1 + D * P / (N - 1) * m)     m = the fit's seconds a token past the knee

end to end -- a ceiling as exact as the cost model (the profile's held-out error, a few per cent
of the prompts' share). Below the knee a riding token is cheaper and the ceiling does not hold:
the ``past_knee`` column says where the arm's mean full step is past it.

For each concurrency and arm, on the policy's tuned acceptance (or ``--acceptance``): decode tok/s
(the decode steps of the run with separate prefill), the simulated end to end with separate
prefill forwards and with prompts riding in the steps (``spectune simulate --prompt-len`` and
``--mixed-prefill``, the engine's default ride limit; and riding with ``--admit-ahead``, a request's
successor riding beside its last step), each over that decode rate, and the ceiling.

    PYTHONPATH=. python benchmarks/e2e_ceiling.py spectune/profiles/nvidia-h200_qwen3-8b_eagle-1l.fused.ctx320.policy.yaml \\
        --prompt-len 64 --new-tokens 256 --concurrency 32,64,128,256 --out benchmarks/results/e2e_ceiling_p64.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from spectune.autotune.acceptance import AcceptanceModel, resolve_acceptance
from spectune.autotune.whatif import WhatIf, parse_arm, parse_arms, simulate_table
from spectune.errors import SpectuneError
from spectune.io import atomic_write_text
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import load
from spectune.runtime.prefill_plan import RIDE_BUDGET, Riding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_common import int_list  # noqa: E402  (the probes' shared helpers)


def marginal_ms(cost: CostModel) -> float:
    """The target fit's ms per token past the compute knee (its per-token and compute terms)."""
    t = cost.params.target
    return t.token_ms + t.compute_ms


def ceiling(decode_tok_s: float, prompt_len: int, new_tokens: int, m_ms: float) -> float:
    """The largest end to end / decode an engine whose decode steps run at ``decode_tok_s`` reaches
    when each request's ``prompt_len`` tokens cost ``m_ms`` each and its first of ``new_tokens``
    output tokens comes from the prefill (module doc)."""
    n = new_tokens - 1
    return (new_tokens / n) / (1.0 + decode_tok_s * prompt_len / n * m_ms / 1e3)


def mean_step_tokens(row: dict[str, Any], concurrency: int) -> float:
    """The arm's mean tokens a full step verifies: batch x (K + 1) over its K histogram (the arm's
    own K where it ran no step), an upper estimate where the verify budget holds fewer."""
    hist = {int(k): n for k, n in (row.get("k_hist") or {}).items()}
    k = sum(k * n for k, n in hist.items()) / sum(hist.values()) if hist else float(parse_arm(row["arm"]) or 0)
    return concurrency * (k + 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy")
    ap.add_argument("--acceptance", help="served acceptance (default: the one the policy was tuned on)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--concurrency", default="32,64,128,256")
    ap.add_argument("--arms", default="plain,auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    began = time.time()
    try:
        concurrency = int_list(a.concurrency, "--concurrency", example="32,64", error=SpectuneError)
        arms = parse_arms(a.arms)
        for flag, value, least in (("--prompt-len", a.prompt_len, 1), ("--new-tokens", a.new_tokens, 2),
                                   ("--repeats", a.repeats, 1)):
            if value < least:
                raise SpectuneError(f"{flag} must be >= {least}, got {value}")
        planner = load(a.policy, on_gpu_mismatch="ignore")
        tuned = AcceptanceModel.from_dict(planner.table.acceptance) if planner.table.acceptance else None
        served = resolve_acceptance(a.acceptance if a.acceptance is not None else tuned, max(1, planner.k_hi))
    except (SpectuneError, OSError, ValueError) as exc:
        print(f"e2e_ceiling: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    what = replace(WhatIf(planner.fresh, served, None, repeats=a.repeats),
                   decode_tokens=a.new_tokens - 1, prompt_len=a.prompt_len)
    separate = simulate_table(what, concurrency, arms)["rows"]
    riding = simulate_table(replace(what, ride=Riding(a.prompt_len, RIDE_BUDGET, None)), concurrency, arms)["rows"]
    # admitted ahead (``--admit-ahead``): a request's successor rides beside its last step
    ahead = simulate_table(replace(what, ride=Riding(a.prompt_len, RIDE_BUDGET, None, ahead=True)), concurrency,
                           arms)["rows"]
    knee = planner.cost.params.target.knee_tokens
    m = marginal_ms(planner.cost)
    rows = []
    print(f"{'c':>4} {'arm':>8} {'decode':>8} {'e2e sep':>8} {'e2e ride':>8} {'sep/dec':>8} {'ride/dec':>8} "
          f"{'ahead/dec':>9} {'ceiling':>7} {'step tok':>8} past knee ({knee:.0f})")
    for sep, ride, early in zip(separate, riding, ahead, strict=True):
        c, arm = sep["concurrency"], sep["arm"]
        decode = sep["goodput_tok_s"]
        tokens = mean_step_tokens(sep, c)
        row = {"concurrency": c, "arm": arm, "decode_tok_s": decode, "e2e_separate_tok_s": sep["output_tok_s"],
               "e2e_riding_tok_s": ride["output_tok_s"], "separate_over_decode": sep["output_tok_s"] / decode,
               "riding_over_decode": ride["output_tok_s"] / decode, "e2e_ahead_tok_s": early["output_tok_s"],
               "ahead_over_decode": early["output_tok_s"] / decode, "marginal_us_per_token": m * 1e3,
               "ceiling": ceiling(decode, a.prompt_len, a.new_tokens, m), "mean_step_tokens": tokens, "past_knee": tokens >= knee,
               "k_hist": sep["k_hist"]}
        rows.append(row)
        print(f"{c:>4} {arm:>8} {decode:>8.0f} {row['e2e_separate_tok_s']:>8.0f} {row['e2e_riding_tok_s']:>8.0f} "
              f"{row['separate_over_decode']:>8.3f} {row['riding_over_decode']:>8.3f} {row['ahead_over_decode']:>9.3f} "
              f"{row['ceiling']:>7.3f} "
              f"{tokens:>8.0f} {'yes' if row['past_knee'] else 'no'}")
    print(f"{time.time() - began:.0f} s")
    if a.out:
        atomic_write_text(a.out, json.dumps({
            "method": "spectune simulate's closed runs (8 x c requests, a fresh planner per run), "
                      f"{a.repeats} seeds; ceiling = (N / (N - 1)) / (1 + decode x P / (N - 1) x the target fit's ms a "
                      "token past the knee (token_ms + compute_ms)); P prompt, N output tokens a request",
            "policy": a.policy, "acceptance": served.source, "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens, "knee_tokens": knee, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
