"""Accounting of ``spectune bench`` rows: exactness (near ties vs hard mismatches) and predictions
comparable with the measured decode throughput.

Exactness: greedy speculative output must equal plain greedy output. A request that differs is
classified by the plain arm's top-1 minus top-2 logit (the *margin*) at its first differing
index: within the dtype's tolerance (``NEAR_TIE``) it is a near tie, a numerical flip between
forwards of different shapes; otherwise a hard mismatch, a defect.

Prediction: the simulator plays the bench's concurrency, requests and output length through the
policy's cost model (decode only, as ``decode_tok_s`` measures), once with the bench's acceptance
model and once with its conditional rates scaled so the simulated acceptance length equals the
measured clean one; and the cost model is evaluated over the exact steps that ran.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spectune.autotune.acceptance import AcceptanceModel
from spectune.autotune.whatif import Predicted, predict_arm
from spectune.engine.engine import RunResult
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import step_ms
from spectune.runtime.prefill_plan import Riding


@dataclass(frozen=True)
class NearTie:
    """A divergence is numerical when the plain margin (top-1 minus top-2 logit) at its index is
    <= max(atol, rtol * |top-1 logit|)."""

    atol: float
    rtol: float

    def holds(self, margin: float, top1: float) -> bool:
        return math.isfinite(margin) and margin <= max(self.atol, self.rtol * abs(top1))

    def __str__(self) -> str:
        return f"margin <= max({self.atol:g}, {self.rtol:g} x |top1|)"


# bf16 / fp16: 2-4 units in the last place of the top-1 logit (8- / 11-bit significands), with a
# floor for small logits; fp32: reduction-order noise only (docs/BENCH_METHOD.md "Exactness")
NEAR_TIE = {"bfloat16": NearTie(0.05, 2.0**-6), "float16": NearTie(0.01, 2.0**-9), "float32": NearTie(1e-4, 0.0)}


def mismatches(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> tuple[int, int | None]:
    """Requests whose output differs from the plain greedy reference, and the first differing
    output index over them (None when all agree)."""
    count, first = 0, None
    for out, ref in zip(outputs, reference, strict=True):
        n = min(len(out), len(ref))
        at = next((i for i in range(n) if out[i] != ref[i]), None)
        if at is not None:
            count += 1
            first = at if first is None else min(first, at)
    return count, first


@dataclass(frozen=True)
class Mismatches:
    total: int  # requests whose output differs from the plain reference
    near_tie: int  # ... first at an index where the plain margin is within the tolerance
    hard: int  # ... first at an index with a clear plain margin (or none recorded): a defect
    first: int | None  # earliest differing output index over them


def classify_mismatches(outputs: Sequence[Sequence[int]], plain: RunResult, tolerance: NearTie) -> Mismatches:
    """Compare ``outputs`` with the plain run's outputs and classify each differing request by
    the plain margin at its first differing index."""
    total, near, first = 0, 0, None
    for rid, (out, ref) in enumerate(zip(outputs, plain.outputs, strict=True)):
        at = next((i for i in range(min(len(out), len(ref))) if out[i] != ref[i]), None)
        if at is None:
            continue
        total += 1
        first = at if first is None else min(first, at)
        margins, top1 = plain.margins[rid], plain.top1[rid]
        if at < len(margins) and tolerance.holds(margins[at], top1[at]):
            near += 1
    return Mismatches(total, near, total - near, first)


@dataclass(frozen=True)
class Prediction:
    decode_tok_s: float | None  # simulator, the bench's acceptance model
    at_measured_accept: float | None  # simulator, acceptance rescaled to the measured clean length
    at_measured_steps: float | None  # cost model over the steps that ran (batch, K, tier, riding tokens)
    output_tok_s: float | None = None  # simulator, end to end with separate prefill forwards (``prefill``)


def ratio_minus_one(a: float | None, b: float | None) -> float | None:
    return a / b - 1.0 if a is not None and b else None


def accept_scale_for(length: Callable[[float], float], target: float, hi: float, iterations: int = 10) -> float:
    """The scale s in [0, hi] where the non-decreasing acceptance length ``length(s)`` crosses
    ``target`` (bisection); ``hi`` when even ``length(hi)`` falls short."""
    lo = 0.0
    if length(hi) <= target:
        return hi
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if length(mid) < target else (lo, mid)
    return (lo + hi) / 2


ITL_SAMPLE = 200  # per-token latencies kept per row (evenly spaced quantiles)
SIM_REQUESTS = 128  # simulated requests per prediction at least: the bench's workload, replicated


def predict_decode(cost: CostModel, acceptance: AcceptanceModel, make_policy: Callable[[], Any], res: RunResult, *,
                   speculative: bool, concurrency: int, requests: int, decode_tokens: int, context_len: int,
                   seed: int, drift: AcceptanceModel | None = None, prior: Sequence[float] | None = None,
                   at_measured_accept: bool = True, prefill: Callable[[int], float] | None = None,
                   ride: Riding | None = None, host_lag: bool = True) -> Prediction:
    """Decode goodput predictions for one measured (concurrency, arm) run ``res``.

    The simulator plays the bench's workload through ``whatif.predict_arm`` (the code path of
    ``spectune simulate``): a closed run of ``requests`` requests of exactly ``decode_tokens``
    tokens after the prefill's first, at ``concurrency``, replicated over seeds up to
    ``SIM_REQUESTS`` requests so that the sampling noise of a few requests does not enter the
    prediction; ``drift`` and ``prior`` as the bench serves and ranks.
    ``make_policy()`` gives a fresh policy (online state reset). With the acceptance rescaled the
    error left is the cost model's and what the simulator leaves out (the order of admissions);
    over the measured steps it is the cost model's alone.
    ``at_measured_accept`` False skips the rescaled prediction (a bisection of ~12 simulations).
    ``prefill(n)`` (``runtime.prefill_plan.prefill_ms``: the ms of admitting n requests by separate prefill
    forwards) adds the end-to-end prediction; with ``ride`` (mixed prefill) the admissions that ride
    are priced in the steps that carry them (``simulate(ride=...)``), and the decode prediction is
    that run's too (the engine's decode time holds the riding steps). ``host_lag`` (on: this
    engine's host plans a step ahead of the device) plays the idle rows of requests whose end the
    host learns a step late (``simulate(host_lag=True)``; against the H200 runs of
    ``benchmarks/sim_host_lag.py`` it halved the drafting arms' median error)."""
    reps = max(1, -(-SIM_REQUESTS // max(1, requests)))

    # the rescaled prediction scales the fitted classes' rates (a trace set's token replay, which
    # the first prediction plays, has no rate to scale: ``simulate``)
    classes = dataclasses.replace(acceptance, replay=None)

    def run(scale: float, with_prefill: bool = False, model: AcceptanceModel = classes) -> Predicted:
        return predict_arm(cost, model, make_policy, concurrency=concurrency, requests=requests,
                           decode_tokens=decode_tokens, context_len=context_len, seeds=range(seed, seed + reps),
                           drift=drift, prior=prior, accept_scale=scale,
                           prefill=prefill if with_prefill or ride is not None else None, ride=ride,
                           host_lag=host_lag)

    try:
        first = run(1.0, True, acceptance)
        base, output = first.goodput_tok_s, first.output_tok_s
        at_accept = None if speculative else base
        measured = res.mean_accept_len_clean if speculative and at_measured_accept else None
        if measured is not None:
            # past 1 / (smallest rate) every rate is clipped to 1: the longest acceptance there is
            smallest = min((a for c in acceptance.components for a in c.accept if a > 0), default=1.0)
            scale = accept_scale_for(lambda s: run(s).mean_accept_len, measured, 1.0 / max(smallest, 1e-3))
            at_accept = run(scale).goodput_tok_s
    except SpectuneError:
        return Prediction(None, None, None)
    timed = dataclasses.replace(cost, context_len=context_len)
    rides = res.ride_tokens or [0] * len(res.step_shapes)
    ms = sum(step_ms(timed, b, k, tier, p) for (b, k, tier), p in zip(res.step_shapes, rides, strict=True))
    at_steps = res.decode_tokens / ms * 1e3 if ms > 0 and res.decode_tokens else None
    return Prediction(base, at_accept, at_steps, output)


# ---------------------------------------------------------------------------------------------
# repeats: means, 95 % t-intervals, auto / best other arm


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """Mean and the two-sided Student-t interval of the mean (lo = hi = mean for one value)."""
    if not values:
        return None
    from scipy.stats import t

    n, mean = len(values), float(sum(values) / len(values))
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def summarise(rows: Sequence[dict[str, Any]], metric: str = "decode_tok_s") -> dict[str, Any]:
    """Per (concurrency, arm): ``metric`` over repeats (mean, 95 % interval, timed-out runs);
    per concurrency: auto / the best other arm (by mean) and auto / plain, each the mean and
    interval of the per-repeat ratios (arms of one repeat share the acceptance draws).
    ``metric``: ``decode_tok_s`` (every decode step of the run), ``full_tok_s`` (the steps at
    full concurrency: serving under load, without the closed run's ramp and drain) or
    ``output_tok_s`` (end to end: the whole run, prefill included)."""
    arms: dict[tuple[int, str], dict[int, dict[str, Any]]] = {}
    for r in rows:
        arms.setdefault((r["concurrency"], r["arm"]), {})[r.get("repeat", 0)] = r
    per_arm: list[dict[str, Any]] = []
    for (c, arm), runs in arms.items():
        stat = mean_interval([x[metric] for x in runs.values() if x.get(metric)])
        per_arm.append({"concurrency": c, "arm": arm, "repeats": len(runs),
                        "timed_out": sum(bool(x.get("timed_out")) for x in runs.values()),
                        metric: stat[0] if stat else None, "ci95": [stat[1], stat[2]] if stat else None})
    ratios = []
    for c in sorted({c for c, _ in arms}):
        here: dict[str, dict[str, Any]] = {str(s["arm"]): s for s in per_arm if s["concurrency"] == c}
        others = {a: s for a, s in here.items() if a != "auto" and s[metric]}
        if "auto" not in here or not others:
            continue
        best = max(others, key=lambda a: others[a][metric])
        entry: dict[str, Any] = {"concurrency": c, "best_other": best}
        for name, base in (("vs_best_other", best), ("vs_plain", "plain")):
            pairs = [(arms[(c, "auto")][i], arms[(c, base)][i]) for i in arms[(c, "auto")]
                     if (c, base) in arms and i in arms[(c, base)]]
            stat = mean_interval([a[metric] / b[metric] for a, b in pairs if a.get(metric) and b.get(metric)])
            entry[name] = stat[0] if stat else None
            entry[f"{name}_ci95"] = [stat[1], stat[2]] if stat else None
        ratios.append(entry)
    return {"metric": metric, "arms": per_arm, "ratios": ratios}


# ---------------------------------------------------------------------------------------------
# one results row


def captured_runs(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``arm@concurrency`` of every timed run that captured CUDA graphs inside the run
    (``graph_captures_in_run``): a capture stalls its step, so the run's throughput reads low."""
    return [f"{r['arm']}@{r['concurrency']}" for r in rows if r.get("graph_captures_in_run")]


def weighted_quantile(values: Sequence[float], weights: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    v, w = np.asarray(values, dtype=float), np.asarray(weights, dtype=float)
    order = np.argsort(v)
    cw = np.cumsum(w[order])
    return float(v[order][min(int(np.searchsorted(cw, q * cw[-1])), len(v) - 1)])



def k_runs(step_shapes: list[tuple[int, int, int]]) -> list[list[int]]:
    """The run's K over time, run-length coded: ``[[K, steps], ...]`` in step order (when the
    controller moved, which ``k_hist`` cannot say)."""
    runs: list[list[int]] = []
    for _, k, _ in step_shapes:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return runs

def row_for(arm: str, concurrency: int, res: RunResult, reading: Any, plain: RunResult,
            predicted: Prediction, tolerance: NearTie) -> dict[str, Any]:
    lat, wts = res.itl_ms, res.itl_tokens
    per_token = np.repeat(np.asarray(lat, dtype=float), np.asarray(wts, dtype=int)) if lat else np.zeros(0)
    sample = (np.quantile(per_token, np.linspace(0, 1, min(ITL_SAMPLE, len(per_token)))).round(4).tolist()
              if len(per_token) else None)
    ttft = [t for t in res.ttft_ms if t is not None]
    energy = getattr(reading, "energy_j", None) if reading is not None else None
    bad = classify_mismatches(res.outputs, plain, tolerance)
    done = sum(res.done)
    spec = any(k > 0 for k in res.k_hist)
    return {
        "concurrency": concurrency,
        "arm": arm,
        "output_tok_s": res.tokens / res.seconds if res.seconds > 0 else 0.0,
        "decode_tok_s": res.decode_tok_s,
        "full_tok_s": res.full_tok_s,
        "full_share": res.full_ms / res.decode_ms if res.decode_ms > 0 else None,
        "itl_p50_ms": weighted_quantile(lat, wts, 0.50),
        "itl_p99_ms": weighted_quantile(lat, wts, 0.99),
        "ttft_ms": float(np.median(ttft)) if ttft else None,
        "mean_accept_len": res.mean_accept_len if spec else None,
        "mean_accept_len_clean": res.mean_accept_len_clean if spec else None,
        "k_hist": {str(k): n for k, n in res.k_hist.items()},
        "k_runs": k_runs(res.step_shapes),
        "power_w": getattr(reading, "mean_power_w", None),
        "joules_per_token": energy / res.tokens if energy is not None and res.tokens else None,
        "sm_clock_mhz": getattr(reading, "sm_clock_mhz", None),
        "throttle_reasons": getattr(reading, "throttle_names", None) if reading is not None else None,
        "completed": done,
        "failed": len(res.done) - done,
        "mismatches": bad.total,
        "near_tie_mismatches": bad.near_tie,
        "hard_mismatches": bad.hard,
        "first_mismatch_index": bad.first,
        "diverged_requests": res.diverged_requests,
        "predicted_tok_s": predicted.decode_tok_s,
        "predicted_tok_s_at_measured_accept": predicted.at_measured_accept,
        "predicted_tok_s_at_measured_steps": predicted.at_measured_steps,
        "prediction_error": ratio_minus_one(res.decode_tok_s, predicted.decode_tok_s),
        "prediction_error_at_measured_accept": ratio_minus_one(res.decode_tok_s, predicted.at_measured_accept),
        "predicted_output_tok_s": predicted.output_tok_s,
        "output_prediction_error": ratio_minus_one(res.tokens / res.seconds if res.seconds > 0 else None,
                                                   predicted.output_tok_s),
        "itl_ms": sample,
        "ttft_p99_ms": float(np.quantile(ttft, 0.99)) if ttft else None,
        "steps": res.steps,
        "ride_steps": sum(1 for p in res.ride_tokens if p),  # steps that carried prompt pieces
        "tokens": res.tokens,
        "decode_tokens": res.decode_tokens,
        "seconds": res.seconds,
        "decode_seconds": res.decode_ms / 1e3,
        "tier_hist": {str(t): n for t, n in res.tier_hist.items()},
        "idle_rows": res.idle_rows,
        "host_waits": res.waits,
        "observed_steps": res.observed,
        "timed_steps": res.timed_steps,
        "drafter_calls": res.drafter_calls,
        "graph_captures_in_run": res.captures,
        "timed_out": res.timed_out,
        "prefill_forwards": res.prefill_forwards,
        "mixed_prefill_tokens": res.mixed_prefill_tokens,
    }
