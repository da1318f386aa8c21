"""CPU microbenchmark of the planner's host time: ``plan()`` alone over every batch size, and a
server step (``plan`` + ``observe`` of K-position counters + ``observe_time`` of the step's
measured time, the controller deciding every ``decide_every`` steps) at K = 15 with acceptance
that shifts, so the controller works, and step times 5 % off the cost model for every other K;
at a fixed batch of 32, at a server's batch (a random walk of one step up or down), and at a
batch that jumps to a new size every step (each step re-decides a stale batch size: the worst
case of the host time). Beside them, traffic that does not shift (acceptance 0.8 at every
position, counters on the plan's K positions only, as an engine reports them) at the fixed and
the server's batch: the host time of a server whose traffic holds still; and the same traffic as
an engine counts it (each request of the batch drafts the plan's K, with a rate of its own drawn
around 0.75, and stops at its first rejection: counts with the noise of real requests, which move
the estimate a little every block), at both batches. Each step loop reports the decisions
(``_decide`` calls) per 100 steps: the controller's host time is mostly those. Every figure is
the best of ``--rounds`` interleaved rounds (default 5): single passes on the device hosts read
22-46 us a step for the same loops from one call to the next (docs/BENCHMARKS.md, section 6).

``--against REV`` (or ``--against-file PLANNER_PY``) times the step loops of that planner beside
the working copy's in one process, in interleaved rounds (best of each): a host's speed moves
between calls by more than a change to the controller does, so a change is judged by this ratio.

    PYTHONPATH=. python benchmarks/bench_planner.py                                 # this planner
    PYTHONPATH=. python benchmarks/bench_planner.py --against HEAD~1 --rounds 7     # against another"""

from __future__ import annotations

import argparse
import json
import random
import time
from functools import partial
from pathlib import Path
from typing import Any

from spectune.io import atomic_write_text
from spectune.runtime.planner import Planner, load
from spectune.runtime.table import (
    SCHEMA,
    CostError,
    CostModelParams,
    Costs,
    DrafterCost,
    Hardware,
    Online,
    OverheadCost,
    Policy,
    Row,
    Software,
    Table,
    TargetCost,
    Workload,
)


def synthetic_table(max_batch: int = 256) -> Table:
    params = CostModelParams(TargetCost(4.9, 0.02, 512, 0.03, 27.0), DrafterCost(0.03, 0.4, 0.001),
                             OverheadCost(0.1, 0.0005))
    rows = [Row((1, 32), 4, 128, tier=160, budget_mode="fill-tier"), Row((33, 64), 2, 128),
            Row((65, max_batch), 0, 0)]
    tiers = sorted({*range(8, max_batch + 1, 8), 160, 192})
    pol = Policy(tiers, rows, Online(min_k=0, max_k=15, prior=[0.8] * 15))
    return Table(SCHEMA, Hardware("cpu"), Software("0.1.0", "x"),
                 Workload("qwen3-8b", "eagle-1l", "autoregressive", 1, "bfloat16", 2048, 15, max_batch),
                 Costs(params, CostError(1, 0.0, 0.0)), policy=pol)


def step_us(planner: Planner, steps: int, batch_sizes: list[int], steady: bool = False,
            a: float = 0.8) -> tuple[float, int]:
    """Microseconds per server step (plan then observe), and how many plans changed online.
    Shifting traffic (default): counters of all K_max positions, acceptance alternating 0.9 / 0.3
    every 16 steps, step times 5 % off the model at odd K. ``steady``: acceptance ``a`` that holds
    still, each step's counters those of its plan's K (position i tested where the i before it
    were accepted, a fraction ``a`` of the tested accepted; zero past K), step times as modelled."""
    planner.reset_online()
    n = planner.k_hi
    counters: dict[object, tuple[list[float], list[float]]] = {}
    if steady:
        for b in set(batch_sizes):
            for k in range(n + 1):
                tested = [b * a ** i if i < k else 0.0 for i in range(n)]
                counters[(b, k)] = ([t * a for t in tested], tested)
    else:
        for j in range(64):
            r = 0.9 if (j // 16) % 2 == 0 else 0.3
            tested = [32.0 * r ** i for i in range(n)]
            counters[j] = ([t * r for t in tested], tested)
    plan, observe, observe_time = planner.plan, planner.observe, planner.observe_time
    model = planner._model_ms
    t0 = time.perf_counter()
    for i in range(steps):
        b = batch_sizes[i % len(batch_sizes)]
        p = plan(b)
        observe(*counters[(b, p.k) if steady else i & 63])
        ms = model[b].get(p, 10.0) if 0 < b <= planner.max_batch else 10.0
        observe_time(b, p, ms * (1.05 if p.k % 2 and not steady else 1.0))
    us = (time.perf_counter() - t0) / steps * 1e6
    return us, len(planner.choices())


def request_counters(rng: random.Random, b: int, k: int, n: int, a: float = 0.75,
                     spread: float = 0.15) -> tuple[list[float], list[float]]:
    """One step's counters of ``b`` requests drafting ``k`` each: request r accepts each draft with
    a rate of its own (uniform in a +- spread), position j tested where the j drafts before it were
    accepted (an engine's counters: zero past K)."""
    acc, tested = [0.0] * n, [0.0] * n
    for _ in range(b):
        r = a + rng.uniform(-spread, spread)
        for j in range(k):
            tested[j] += 1.0
            if rng.random() >= r:
                break
            acc[j] += 1.0
    return acc, tested


def sampled_us(planner: Planner, steps: int, batch_sizes: list[int], seed: int = 0,
               variants: int = 8) -> tuple[float, float]:
    """Microseconds per server step of traffic that holds still, counted per request
    (``request_counters``; ``variants`` draws per (batch, K), drawn outside the timed calls), and
    the decisions per 100 steps."""
    planner.reset_online()
    rng, n, pool = random.Random(seed), planner.k_hi, {}
    plan, observe, observe_time = planner.plan, planner.observe, planner.observe_time
    model, clock, spent = planner._model_ms, time.perf_counter, 0.0
    decisions, decide = [0], planner._decide

    def counted(b: int | None = None) -> None:
        decisions[0] += 1
        decide(b)
    planner._decide = counted  # type: ignore[method-assign]
    try:
        for i in range(steps):
            b = batch_sizes[i % len(batch_sizes)]
            t0 = clock()
            p = plan(b)
            t1 = clock()
            key = (b, p.k, i % variants)
            counters = pool.get(key)
            if counters is None:
                counters = pool[key] = request_counters(rng, b, p.k, n)
            t2 = clock()
            observe(*counters)
            observe_time(b, p, model[b].get(p, 10.0) if 0 < b <= planner.max_batch else 10.0)
            spent += (t1 - t0) + (clock() - t2)
    finally:
        del planner._decide
    return spent / steps * 1e6, 100.0 * decisions[0] / steps


def served_batches(max_batch: int, steps: int = 4096, seed: int = 0) -> list[int]:
    """A continuous-batching server's batch sizes: a random walk of -1 / 0 / 0 / +1 a step
    (a request retires, none or one is admitted) from half the table's range, inside 1..max_batch."""
    rng = random.Random(seed)
    b, out = max(1, max_batch // 2), []
    for _ in range(steps):
        b = min(max_batch, max(1, b + rng.choice((-1, 0, 0, 1))))
        out.append(b)
    return out


# (key, name, loop): each loop times one kind of step at (planner, steps, a server's batch walk)
# and returns (us a step, its other figure: plans moved or decisions per 100 steps)
STEP_LOOPS = (
    ("fixed", "shifting, batch 32", lambda p, n, walk: step_us(p, n, [min(32, p.max_batch)])),
    ("walk", "shifting, a server's batch", lambda p, n, walk: step_us(p, n, walk)),
    ("steady_fixed", "holds still, batch 32", lambda p, n, walk: step_us(p, n, [min(32, p.max_batch)], steady=True)),
    ("steady_walk", "holds still, a server's batch", lambda p, n, walk: step_us(p, n, walk, steady=True)),
    ("sampled_fixed", "counted per request, batch 32", lambda p, n, walk: sampled_us(p, n, [min(32, p.max_batch)])),
    ("sampled_walk", "counted per request, a server's batch", lambda p, n, walk: sampled_us(p, n, walk)),
)


def compare(args: argparse.Namespace) -> None:
    """The step loops of two planners (this working copy's and ``--against``'s) in one process:
    ``--rounds`` interleaved rounds, the best of each; a host's speed drifts between calls more
    than a change to the controller moves it, so only a ratio measured this way counts."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planner_trace import planner_at  # (it imports this module: imported here, not above)

    import spectune.runtime.planner as current

    if args.against_file and not Path(args.against_file).is_file():
        raise SystemExit(f"bench_planner: --against-file {args.against_file}: no such file")
    other = planner_at(args.against or "", Path(args.against_file) if args.against_file else None)
    label = args.against_file or args.against
    planners = [mod.load(args.policy, on_gpu_mismatch="ignore") if args.policy else mod.Planner(synthetic_table())
                for mod in (current, other)]
    steps = max(1000, args.calls // 20)
    walks = [served_batches(p.max_batch) for p in planners]
    best = [[float("inf")] * 2 for _ in STEP_LOOPS]
    for _ in range(max(1, args.rounds)):
        for row, (_, _, loop) in zip(best, STEP_LOOPS, strict=True):
            for i, p in enumerate(planners):
                row[i] = min(row[i], loop(p, steps, walks[i])[0])
    print(f"{'step loop (us a step, best of ' + str(args.rounds) + ')':<40} {'this':>8} {'other':>8} {'ratio':>7}")
    rows = []
    for (_, name, _), (us, us_other) in zip(STEP_LOOPS, best, strict=True):
        print(f"{name:<40} {us:>8.2f} {us_other:>8.2f} {us / us_other:>7.3f}")
        rows.append({"loop": name, "us": us, "us_against": us_other, "ratio": us / us_other})
    print(f"(other: {label})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"against": label, "rounds": args.rounds, "steps": steps,
                                       "policy": args.policy, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("policy", nargs="?", help="policy YAML (default: a synthetic 256-batch table)")
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_planner.json"))
    ap.add_argument("--against", metavar="REV",
                    help="time the step loops of this git revision's planner beside the working copy's")
    ap.add_argument("--against-file", metavar="PLANNER_PY", help="the same with a planner.py file as the other")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds of every loop (per planner with --against); each loop reports its best")
    args = ap.parse_args(argv)
    if args.against or args.against_file:
        compare(args)
        return
    planner = load(args.policy, on_gpu_mismatch="ignore") if args.policy else Planner(synthetic_table())
    sizes = [1 + i % planner.max_batch for i in range(args.calls)]
    assert all(planner.plan(b).tier is not None for b in range(1, planner.max_batch + 1))
    plan = planner.plan
    ride_b = min(32, planner.max_batch)

    def plan_us() -> tuple[float, int]:
        t0 = time.perf_counter()
        for b in sizes:
            plan(b)
        return (time.perf_counter() - t0) / args.calls * 1e6, 0

    def ride_us() -> tuple[float, int]:
        t0 = time.perf_counter()
        for _ in range(args.calls // 10):
            planner.plan_ride(ride_b, 256)  # a riding step (mixed prefill): its shape, made once per estimate
        return (time.perf_counter() - t0) / (args.calls // 10) * 1e6, 0

    steps = max(1000, args.calls // 10)
    walk, jumps = served_batches(planner.max_batch), [1 + (i * 37) % planner.max_batch for i in range(512)]
    loops: dict[str, Any] = {
        "plan": plan_us, "ride": ride_us, "var": lambda: step_us(planner, steps, jumps),
        **{key: partial(loop, planner, steps, walk) for key, _, loop in STEP_LOOPS},
    }
    # the best of --rounds interleaved rounds per loop: one pass on a shared host reads up to 2x
    # its best (a loop's other figure, plans moved or decisions, is the same in every round)
    best: dict[str, tuple[float, Any]] = {}
    for _ in range(max(1, args.rounds)):
        for key, loop in loops.items():
            got = loop()
            if key not in best or got[0] < best[key][0]:
                best[key] = got
    us, ride = best["plan"][0], best["ride"][0]
    (fixed_b, fixed_changed), (var_b, var_changed), (walk_b, walk_changed) = best["fixed"], best["var"], best["walk"]
    steady_fixed, steady_walk = best["steady_fixed"][0], best["steady_walk"][0]
    (sampled_fixed, dec_fixed), (sampled_walk, dec_walk) = best["sampled_fixed"], best["sampled_walk"]
    print(f"(best of {max(1, args.rounds)} rounds)")
    print(f"{'what':<58} {'us':>8}")
    print(f"{'plan() per call':<58} {us:>8.3f}")
    print(f"{'plan_ride() per call, batch 32, 256 prompt tokens riding':<58} {ride:>8.3f}")
    print(f"{'plan+observe+observe_time per step, batch 32, K<=15':<58} {fixed_b:>8.3f}   ({fixed_changed} plans moved)")
    print(f"{'  batch of a server (one step in, one out, +-1 a step)':<58} {walk_b:>8.3f}   ({walk_changed} plans moved)")
    print(f"{'  batch jumps 37 every step (a new batch size each step)':<58} {var_b:>8.3f}   ({var_changed} plans moved)")
    print(f"{'  traffic that holds still, batch 32':<58} {steady_fixed:>8.3f}")
    print(f"{'  traffic that holds still, a server batch':<58} {steady_walk:>8.3f}")
    print(f"{'  the same counted per request, batch 32':<58} {sampled_fixed:>8.3f}   ({dec_fixed:.1f} decisions / 100 steps)")
    print(f"{'  the same counted per request, a server batch':<58} {sampled_walk:>8.3f}   ({dec_walk:.1f} decisions / 100 steps)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"calls": args.calls, "rounds": max(1, args.rounds), "us_per_call": us,
                                       "max_batch": planner.max_batch,
                                       "max_k": planner.k_hi, "decide_every": planner.online.decide_every,
                                       "step_us_fixed_batch": fixed_b, "step_us_served_batch": walk_b,
                                       "step_us_varying_batch": var_b, "plan_ride_us": ride,
                                       "step_us_steady_fixed_batch": steady_fixed,
                                       "step_us_steady_served_batch": steady_walk,
                                       "step_us_sampled_fixed_batch": sampled_fixed,
                                       "step_us_sampled_served_batch": sampled_walk,
                                       "decisions_per_100_steps_sampled_fixed_batch": dec_fixed,
                                       "decisions_per_100_steps_sampled_served_batch": dec_walk}, indent=1))


if __name__ == "__main__":
    main()
