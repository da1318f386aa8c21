"""What-if of serving a policy table: plain, fixed K and the table's planner through the simulator.

One code path for ``spectune simulate`` and the bench's predictions: ``predict_arm`` plays a closed
run of ``requests`` requests of ``decode_tokens`` tokens each at ``concurrency`` (the batch drains
once the queue is empty, as a bench run does) through ``simulate``, once per seed, and pools
tokens over seconds; ``simulate_table`` evaluates the cost model at the context the policy was
tuned for (``planner.cost.context_len``). Allocation ranks by each request's own history (``simulate``'s default);
rates come from the policy's ``rates`` (the planner's live estimate) or ``prior``.

``compare_open`` is the held-out habit's path (``tests/autotune/test_heldout.py``,
``benchmarks/sim_heldout.py``): an open workload (a full batch, finished requests replaced at once)
per concurrency, plain, every fixed K and auto over common-random-number seeds; ``heldout_sources``
names the served sources a table tuned on the public curve is judged on.

Arms (as in the bench): ``plain`` (K = 0), ``fixed:K`` (K drafts for every request, all verified),
``auto`` (a fresh planner per run, ``make_planner()``, so online state never leaks between runs;
with ``WhatIf.shared`` one planner trained by a first run serves every seed, as the bench serves).
Default arms: plain, every fixed K 1..min(max_k, 7), the best fixed K by the simulator and its
neighbours, auto. The bench's default: plain, the best fixed K and its neighbours, auto.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spectune.autotune.acceptance import AcceptanceModel, load_acceptance
from spectune.autotune.simulator import FixedK, PolicyFn, PrefillFn, simulate
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import Plan, smallest_tier
from spectune.runtime.prefill_plan import Riding, prefill_ms

FIXED_ARMS_MAX = 7  # default fixed arms: K = 1..min(max_k, FIXED_ARMS_MAX)


class ArmError(SpectuneError):
    """Bad arm or drift settings; the message names the option."""


# ---------------------------------------------------------------------------------------------
# arms


@dataclass(frozen=True)
class FixedPolicy:
    """K drafts for every request, all verified (K = 0: plain decoding, the drafter never runs).
    A batch whose b * (K + 1) tokens exceed the largest tier verifies what that tier holds."""

    k: int
    tiers: tuple[int, ...]

    def plan(self, batch_size: int) -> Plan:
        budget = batch_size * self.k
        tier = smallest_tier(self.tiers, batch_size + budget)
        if tier is None:
            budget = max(0, self.tiers[-1] - batch_size)
            tier = smallest_tier(self.tiers, batch_size + budget)
        return Plan(self.k if budget > 0 else 0, budget, tier)


def parse_arm(arm: str) -> int | None:
    """``plain`` -> 0, ``fixed:K`` -> K, ``auto`` -> None (the policy table decides)."""
    text = arm.strip().lower()
    if text == "plain":
        return 0
    if text == "auto":
        return None
    head, _, tail = text.partition(":")
    if head == "fixed" and tail.isdigit() and 0 <= int(tail) <= 64:
        return int(tail)
    raise ArmError(f"arm {arm!r}: not plain, fixed:K (K in 0..64) or auto")


def parse_arms(text: str | Sequence[str], max_k: int | None = None) -> tuple[str, ...]:
    """The arms, each checked; with ``max_k`` (the table's ``workload.max_k``) a fixed K past it is
    refused: the profile's drafter and the acceptance model stop there, so its row would mix the
    costs of one K with the acceptance of another."""
    arms = [a.strip().lower() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    if not arms:
        raise ArmError("--arms: no arm given (plain, fixed:K, auto)")
    for a in arms:
        try:
            k = parse_arm(a)
        except ArmError as exc:
            raise ArmError(f"--arms: {exc}") from None
        if max_k is not None and k is not None and k > max_k:
            raise ArmError(f"--arms: arm {a!r}: past the table's workload.max_k {max_k} (fixed:K in 0..{max_k})")
    return tuple(dict.fromkeys(arms))


def neighbours(best_k: int, max_k: int) -> list[int]:
    return [k for k in (best_k - 1, best_k, best_k + 1) if 1 <= k <= max_k]


def default_arms(max_k: int, best_k: int) -> tuple[str, ...]:
    """plain, fixed:1..min(max_k, 7), the best fixed K and its neighbours, auto."""
    ks = sorted(set(range(1, min(max_k, FIXED_ARMS_MAX) + 1)) | set(neighbours(best_k, max_k)))
    return ("plain", *(f"fixed:{k}" for k in ks), "auto")


def bench_default_arms(max_k: int, best_k: int) -> tuple[str, ...]:
    """plain, the best fixed K by the simulator and its neighbours, auto."""
    return ("plain", *(f"fixed:{k}" for k in neighbours(best_k, max_k)), "auto")


def split_drift(text: str) -> tuple[str, str]:
    """``A,B`` -> (A, B): the comma outside parentheses that is not followed by a number (curves
    and mixtures hold commas between numbers)."""
    depth, cuts = 0, []
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0 and not text[i + 1:].lstrip()[:1].replace(".", "0").isdigit():
            cuts.append(i)
    if len(cuts) != 1 or not text[: cuts[0]].strip() or not text[cuts[0] + 1:].strip():
        raise ArmError(f"--drift {text!r}: give two acceptance sources A,B (e.g. curve:0.9,0.81,public:...)")
    return text[: cuts[0]].strip(), text[cuts[0] + 1:].strip()


def drift_source(first: AcceptanceModel, second: AcceptanceModel) -> str:
    return f"drift: {first.source} -> {second.source} (requests of the second half)"


# ---------------------------------------------------------------------------------------------
# predictions


@dataclass(frozen=True)
class Predicted:
    goodput_tok_s: float | None  # decode tokens / simulated seconds, seeds pooled (None: no step)
    mean_accept_len: float  # emitted tokens per request per step, bonus included
    itl_p50_ms: float | None  # mean over seeds of each run's token-weighted quantile
    itl_p99_ms: float | None
    k_hist: dict[int, int] = field(default_factory=dict)  # steps per K over all seeds
    full_tok_s: float | None = None  # the steps at the full concurrency only (the bench's full_tok_s)
    output_tok_s: float | None = None  # end to end, prefill included (with a ``prefill`` model)
    ride_steps: float = 0.0  # decode steps that carried prompt pieces, mean per run (with ``ride``)
    seconds: float = 0.0  # one run's decode and prefill seconds, mean over the seeds


def predict_arm(cost: CostModel, acceptance: AcceptanceModel, make_policy: Callable[[], PolicyFn], *,
                concurrency: int, requests: int, decode_tokens: int, context_len: int, seeds: Sequence[int],
                drift: AcceptanceModel | None = None, prior: Sequence[float] | None = None,
                accept_scale: float = 1.0, prefill: PrefillFn | None = None,
                ride: Riding | None = None, host_lag: bool = False) -> Predicted:
    """A closed run of ``requests`` requests of ``decode_tokens`` tokens per seed (module doc);
    with ``prefill`` (and ``ride``: mixed prefill; ``simulate``'s) also the end-to-end rate;
    ``host_lag`` as ``simulate``'s (the reference engine's idle rows)."""
    tokens, seconds, slots, p50, p99 = 0, 0.0, 0, [], []
    full_tokens, full_seconds, outputs, all_seconds, ride_steps = 0, 0.0, 0, 0.0, 0
    k_hist: dict[int, int] = {}
    for s in seeds:
        sim = simulate(cost, acceptance, make_policy(), concurrency=concurrency, context_len=context_len,
                       steps=1_000_000, requests=requests, seed=s, accept_scale=accept_scale,
                       mean_output_tokens=max(1, decode_tokens), workload="closed", lengths="fixed",
                       drift=drift, prior=prior, prefill=prefill, ride=ride, host_lag=host_lag)
        slots += round(sim.tokens / sim.mean_accept_len) if sim.mean_accept_len else 0
        outputs, all_seconds = outputs + sim.tokens + sim.admitted, all_seconds + sim.seconds + sim.prefill_seconds
        tokens, seconds, ride_steps = tokens + sim.tokens, seconds + sim.seconds, ride_steps + sim.ride_steps
        full_tokens, full_seconds = full_tokens + sim.full_tokens, full_seconds + sim.full_seconds
        p50.append(sim.itl_p50_ms)
        p99.append(sim.itl_p99_ms)
        for k, n in sim.k_hist.items():
            k_hist[k] = k_hist.get(k, 0) + n
    rate = tokens / seconds if seconds > 0 else math.inf
    return Predicted(rate if math.isfinite(rate) else None, tokens / max(1, slots),
                     sum(p50) / len(p50) if p50 else None, sum(p99) / len(p99) if p99 else None,
                     dict(sorted(k_hist.items())), full_tokens / full_seconds if full_seconds > 0 else None,
                     outputs / all_seconds if prefill is not None and all_seconds > 0 else None,
                     ride_steps / max(1, len(seeds)), all_seconds / max(1, len(seeds)))


def best_fixed_k(cost: CostModel, acceptance: AcceptanceModel, max_k: int, *, tiers: Sequence[int] | None = None,
                 **workload: Any) -> int:
    """The fixed K in 1..max_k with the highest predicted goodput (``predict_arm``'s workload)."""
    return _best(fixed_k_predictions(cost, acceptance, max_k, tiers=tiers, **workload))


def fixed_k_predictions(cost: CostModel, acceptance: AcceptanceModel, max_k: int, *,
                        tiers: Sequence[int] | None = None, **workload: Any) -> dict[int, Predicted]:
    """``predict_arm`` of every fixed K in 1..max_k (``best_fixed_k``'s scan, kept whole)."""
    def predicted(k: int) -> Predicted:
        fixed = FixedK(k) if tiers is None else FixedPolicy(k, tuple(sorted(tiers)))
        return predict_arm(cost, acceptance, lambda: fixed, **workload)

    return {k: predicted(k) for k in range(1, max(1, max_k) + 1)}


def _best(fixed: dict[int, Predicted]) -> int:
    return max(fixed, key=lambda k: fixed[k].goodput_tok_s or 0.0)


def tuned_prior(table: Any) -> list[float] | None:
    """The population rates a runtime starts from: the table's ``policy.online.prior``, else the
    mean curve of the acceptance it was tuned on, else None (the served model's mean)."""
    if table.policy is not None and table.policy.online.prior:
        return list(table.policy.online.prior)
    if table.acceptance:
        return list(AcceptanceModel.from_dict(table.acceptance).mean_conditional())
    return None


@dataclass(frozen=True)
class WhatIf:
    """Inputs of ``simulate_table``: the planner factory, the served acceptance (and drift)."""

    make_planner: Callable[[], Any]  # a fresh runtime Planner per run (``spectune.runtime.planner.load``)
    acceptance: AcceptanceModel
    drift: AcceptanceModel | None = None
    requests: Callable[[int], int] = lambda c: min(1024, max(64, 8 * c))  # per concurrency
    repeats: int = 3  # seeds per (concurrency, arm), pooled
    decode_tokens: int = 127
    seed: int = 0
    shared: bool = False  # auto: one planner for every seed, trained first by an untimed run of the
    # first seed (the bench's protocol, ``engine.bench.train_online``); else a fresh one per run
    served_cost: CostModel | None = None  # the GPU's step times (default: the table's own cost model)
    prompt_len: int | None = None  # end to end too: each admission's separate prefill forwards
    ride: Riding | None = None  # mixed prefill (its prompt_len is ``prompt_len``): prompts ride in the steps
    host_lag: bool = False  # an engine whose host plans a step ahead (``simulate(host_lag=True)``: idle rows)


def served_cost_of(path: str, table: Any) -> CostModel:
    """``--served-cost``: the cost model of another profile of ``table``'s target and drafter, to
    time the simulated runs while the policy plans on its own (``WhatIf.served_cost``)."""
    from spectune.runtime.table import read_table

    other = read_table(path)
    for name in ("target", "drafter", "max_k"):
        mine, theirs = getattr(table.workload, name), getattr(other.workload, name)
        if mine != theirs:
            raise ArmError(f"--served-cost {path}: workload.{name} is {theirs!r}, the policy's is {mine!r}")
    return CostModel.of(other)


def simulate_table(what: WhatIf, concurrency: Sequence[int], arms: Sequence[str] | None) -> dict[str, Any]:
    """Every (concurrency, arm) through ``predict_arm``; rows and the auto / best other ratio."""
    planner = what.make_planner()
    table = planner.table
    max_k = min(planner.k_hi, what.acceptance.max_k)
    prior = tuned_prior(table)
    served = what.served_cost if what.served_cost is not None else planner.cost
    rows: list[dict[str, Any]] = []
    for c in concurrency:
        work = arm_workload(what, c, planner.cost.context_len, prior)
        prefill = prefill_ms(served, what.prompt_len) if what.prompt_len is not None else None
        fixed = fixed_k_predictions(served, what.acceptance, max_k, **work)
        best = _best(fixed)
        chosen = arms if arms is not None else default_arms(max_k, best)
        here = []
        trained = _trained_planner(what, served, work) if what.shared else None
        # a fixed arm's run is the scan's where the arms run as it does (no prefill, no host lag)
        scanned = fixed if prefill is None and what.ride is None and not what.host_lag else {}
        for arm in chosen:
            k = parse_arm(arm)

            def make(k: int | None = k, trained: Any = trained) -> Any:
                if k is not None:
                    return FixedK(k)
                return trained if trained is not None else what.make_planner()

            p = scanned.get(k) if k is not None else None
            if p is None:
                p = predict_arm(served, what.acceptance, make, prefill=prefill, ride=what.ride,
                                host_lag=what.host_lag, **work)
            here.append({"concurrency": c, "arm": arm, "goodput_tok_s": p.goodput_tok_s, "full_tok_s": p.full_tok_s,
                         "output_tok_s": p.output_tok_s,
                         "mean_accept_len": p.mean_accept_len, "itl_p50_ms": p.itl_p50_ms,
                         "itl_p99_ms": p.itl_p99_ms, "k_hist": {str(k): n for k, n in p.k_hist.items()},
                         "requests": work["requests"], "best_fixed_k": best})
        _ratio_to_best_other(here)
        rows += here
    source = drift_source(what.acceptance, what.drift) if what.drift is not None else what.acceptance.source
    tuned = table.acceptance.get("source") if table.acceptance else None
    replayed = what.acceptance.replay is not None and what.drift is None  # (``simulate``: token replay)
    return {"rows": rows, "acceptance": source + (" -- replayed token by token" if replayed else ""),
            "tuned_acceptance": tuned, "drift": what.drift is not None,
            "context_len": planner.cost.context_len, "repeats": what.repeats, "prompt_len": what.prompt_len,
            "host_lag": what.host_lag,
            "mixed_prefill": None if what.ride is None else {"budget": what.ride.budget,
                                                             "ride_limit": what.ride.ride_limit,
                                                             "admit_ahead": what.ride.ahead}}


def arm_workload(what: WhatIf, concurrency: int, context_len: int, prior: list[float] | None) -> dict[str, Any]:
    """``predict_arm``'s workload keywords of one concurrency of ``what`` (``simulate_table``'s runs)."""
    return dict(concurrency=concurrency, requests=what.requests(concurrency), decode_tokens=what.decode_tokens,
                context_len=context_len, drift=what.drift, prior=prior, seeds=range(what.seed, what.seed + what.repeats))


def _trained_planner(what: WhatIf, cost: CostModel, work: dict[str, Any]) -> Any:
    """A fresh planner after one closed run of the first seed's traffic (with drift, both halves:
    the timed runs start adapted to the second half and must detect the switch)."""
    planner = what.make_planner()
    run = {key: v for key, v in work.items() if key != "seeds"}
    predict_arm(cost, what.acceptance, lambda: planner, seeds=[what.seed], host_lag=what.host_lag, **run)
    return planner


def _ratio_to_best_other(rows: list[dict[str, Any]]) -> None:
    """auto / the best other arm, over the whole closed run (``ratio_vs_best_other``) and over its
    steps at full concurrency (``full_ratio_vs_best_other``: without the drain, where a drafting
    arm's requests finish at spread-out steps while plain decoding's fixed-length requests finish
    together)."""
    for metric, key in (("goodput_tok_s", "ratio_vs_best_other"), ("full_tok_s", "full_ratio_vs_best_other")):
        others = [r[metric] for r in rows if r["arm"] != "auto" and r[metric]]
        for r in rows:
            r[key] = r[metric] / max(others) if r["arm"] == "auto" and others and r[metric] else None


# ---------------------------------------------------------------------------------------------
# held out: an open workload, every fixed K


def _curve(f: Callable[[int], float], n: int = 15) -> str:
    return ",".join(f"{f(i):.6f}" for i in range(1, n + 1))


def heldout_sources() -> dict[str, tuple[str, str | None]]:
    """name -> (acceptance, drift or None): every shipped trace set, a high (0.9^i) and a low
    (0.55^i) curve, a drift from the high to the low one, a two-class mixture (0.85^i / 0.5^i)
    and an extreme one (0.95^i / 0.35^i)."""
    import importlib.resources

    traces = importlib.resources.files("spectune").joinpath("data", "traces")
    out: dict[str, tuple[str, str | None]] = {
        p.name.split(".")[0]: (str(p), None) for p in sorted(traces.iterdir(), key=lambda p: p.name)
        if p.name.endswith(".jsonl.gz")}
    high, low = "curve:" + _curve(lambda i: 0.9 ** i), "curve:" + _curve(lambda i: 0.55 ** i)
    out["high-0.9"], out["low-0.55"], out["drift"] = (high, None), (low, None), (high, low)
    out["two-class"] = (f"mixture:0.5*curve({_curve(lambda i: 0.85 ** i)})+0.5*curve({_curve(lambda i: 0.5 ** i)})", None)
    out["extreme-mixture"] = (f"mixture:0.5*curve({_curve(lambda i: 0.95 ** i)})+0.5*curve({_curve(lambda i: 0.35 ** i)})",
                              None)
    return out


def compare_open(table: Any, acceptance: str, concurrency: Sequence[int], *, drift: str | None = None,
                 fixed: Sequence[int] = range(1, FIXED_ARMS_MAX + 1), seeds: Sequence[int] = (0, 1),
                 steps: int = 1200, steps_batch1: int | None = 4000,
                 mean_output_tokens: float = 128.0) -> list[dict[str, Any]]:
    """Per concurrency: goodput of plain, each fixed K and auto (a fresh planner per run) in an
    open workload, the geometric mean over ``seeds`` (common random numbers: every arm sees the
    same requests and draws); auto / the best other arm, auto / plain, auto's K histogram.
    Batch 1 runs ``steps_batch1`` steps, so that as many requests finish as at larger batches."""
    from spectune.runtime.planner import Planner

    cost = CostModel.of(table)
    ctx = table.policy.context_len if table.policy is not None else None
    acc = load_acceptance(acceptance, max_k=table.workload.max_k)
    second = load_acceptance(drift, max_k=table.workload.max_k) if drift else None
    arms: list[tuple[str, Callable[[], Any]]] = [("plain", lambda: FixedK(0))]
    arms += [(f"fixed:{k}", functools.partial(FixedK, k)) for k in fixed]
    arms.append(("auto", Planner(table).fresh))  # (the lookup built once, a fresh state per run)
    rows = []
    for c in concurrency:
        n_steps = steps_batch1 if c == 1 and steps_batch1 else steps
        goodput: dict[str, float] = {}
        auto_k: dict[int, int] = {}
        for name, make in arms:
            logs = []
            for seed in seeds:
                r = simulate(cost, acc, make(), concurrency=c, steps=n_steps, seed=seed, context_len=ctx,
                             mean_output_tokens=mean_output_tokens, drift=second)
                logs.append(math.log(r.goodput_tok_s))
                if name == "auto":
                    for k, n in r.k_hist.items():
                        auto_k[k] = auto_k.get(k, 0) + n
            goodput[name] = math.exp(sum(logs) / len(logs))
        best = max((a for a in goodput if a != "auto"), key=goodput.__getitem__)
        rows.append({"concurrency": c, "arms": goodput, "best_other": best,
                     "auto_over_best": goodput["auto"] / goodput[best],
                     "auto_over_plain": goodput["auto"] / goodput["plain"], "auto_k_hist": dict(sorted(auto_k.items()))})
    return rows
