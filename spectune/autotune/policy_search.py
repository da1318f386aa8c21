"""Policy search: which tiers to capture, and K / verify budget per batch size.

Structure (an outer Optuna study, an inner enumeration):
- ``OperatingGrid``: for every batch b in 1..max_batch, draft length K in 0..max_k and candidate
  tier t >= b of a fixed universe, the step with budget B = min(b*K, t - b) (a step pays for its
  tier, so filling it is free) -- expected tokens (analytic, survival allocation, over the
  *in-flight* request mix of a serving loop: hard requests stay longer in the batch, see
  ``simulator.inflight_weights``), step ms and J/token. Computed once.
- Optuna searches the tier set (one on/off decision per universe tier, under the capture memory
  and seconds budgets); for a tier set, each b independently picks its best candidate (its own
  operating point). The study starts from two enqueued tier sets: all tiers (when they fit the
  budgets) and a greedy value-per-cost set.
- Smoothing (``smooth_choices``, tolerance ``smooth``, default 0.5 %): the per-b optimum flips K
  (e.g. 2/3) where the packed tokens of one K land just under a tier and the other's just over;
  engines that pad to their own graph sizes see that as noise. Batch sizes are regrouped into the
  fewest runs of one K such that no b loses more than the tolerance of its predicted optimum.
- Rows: adjacent batch sizes with one K that verify their full b*K drafts in the smallest tier
  holding them merge into one ``fixed`` row; others with the same (K, tier) merge into one
  ``fill-tier`` row (budget at b is min(b*K, tier - b)); adjacent K = 0 batch sizes merge into one
  plain row. The K = 0 cut-off is derived: every b whose best step does not beat plain decoding
  gets K = 0. Row.gain is recomputed from the smoothed steps.

Objectives (per b, then averaged over b against the all-tiers optimum):
  goodput: tokens/s;  energy: tokens/J;  latency: tokens/s subject to step ms <= bound (a step's
  ms bounds every inter-token latency of that step, so it is a safe p99 proxy).
``pareto``: NSGA-II over the tier set, an energy weight and a step-ms cap; objectives mean gain
vs plain (max), mean J/token vs plain (min), mean step ms vs plain (min, p99 proxy).
The online controller starts from ``Online``'s defaults (``tune_pipeline.search_online`` picks them
by simulated drift when asked); its prior is the in-flight mean curve (``live_prior``). Tiers: the
rows' tiers plus those the controller needs if acceptance is the tuned curve scaled by
``ADAPT_SCALES`` (``room_tiers``), as far as the capture budget allows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import optuna

from spectune.autotune.acceptance import AcceptanceModel
from spectune.autotune.simulator import Mixture, expected_tokens, inflight_weights
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.planner import smallest_tier, step_ms
from spectune.runtime.table import CapturePoint, Online, Policy, Row

Objective = Literal["goodput", "energy", "latency"]
# acceptance the captured tiers leave room for: the tuned conditional rates scaled by these (the
# online controller can only run shapes that have a graph)
ADAPT_SCALES = (0.7, 0.85, 1.15, 1.3)
Progress = Callable[[int, int], None]  # (done, total)
# smoothing tolerance: a run of batch sizes takes its neighbour's K when that costs less than this
# fraction of predicted goodput at every batch size of the run (see ``smooth_choices``)
DEFAULT_SMOOTH = 0.005


class SearchError(SpectuneError):
    """The search cannot run (bad budget, missing capture or power data, nothing feasible)."""


EXACT_TIERS = 16  # every tier size up to this one is a candidate (``tier_universe``)


def tier_universe(max_batch: int, max_k: int) -> list[int]:
    """Candidate tiers: every size up to ``EXACT_TIERS`` (16), then 20, 24, 28, 32, 40, ... (powers
    of two with 1.25x, 1.5x and 1.75x between, so padding stays under 15%) up to b*(K+1), every
    multiple of 8 up to max_batch (plain decoding pads little), and max_batch itself. The sizes up
    to 16 are all there so that batch 1 runs any K <= 15 in a graph of exactly K + 1 tokens, as an
    engine's fixed-K graph does: one padded token costs 0.7-1 % of a batch-1 step in the H200
    profiles, and a graph of at most 16 tokens 4-24 MiB of capture memory there."""
    top = max_batch * (max_k + 1)
    out, p = {max_batch, *range(8, max_batch + 1, 8), *range(1, min(EXACT_TIERS, top) + 1)}, 1
    while p <= top:
        out.add(p)
        steps = (3, 5, 6, 7) if p >= 8 else (6,) if p >= 2 else ()
        out.update(p * s // 4 for s in steps if p * s // 4 <= top)
        p *= 2
    out.add(top)
    return sorted(out)


def capture_costs(points: Sequence[CapturePoint], tiers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(MiB, seconds) per tier, linear in tokens between measured tiers, extended past them."""
    if not points:
        return np.zeros(len(tiers)), np.zeros(len(tiers))
    pts = sorted(points, key=lambda p: p.tokens)
    x = np.array([p.tokens for p in pts], dtype=float)
    t = np.asarray(tiers, dtype=float)

    def interp(y: np.ndarray) -> np.ndarray:
        out = np.interp(t, x, y)
        if len(x) >= 2:
            lo = (y[1] - y[0]) / (x[1] - x[0]) if x[1] > x[0] else 0.0
            hi = (y[-1] - y[-2]) / (x[-1] - x[-2]) if x[-1] > x[-2] else 0.0
            out = np.where(t < x[0], y[0] + lo * (t - x[0]), out)
            out = np.where(t > x[-1], y[-1] + hi * (t - x[-1]), out)
        return np.maximum(out, 0.0)

    return interp(np.array([p.mib for p in pts])), interp(np.array([p.seconds for p in pts]))


@dataclass
class OperatingGrid:
    """Candidate step shapes per batch size. Per b (index b - 1), arrays over candidates."""

    universe: list[int]
    k: list[np.ndarray]  # [n_cand] draft length
    budget: list[np.ndarray]  # [n_cand] B
    tier_idx: list[np.ndarray]  # [n_cand] index into universe
    tokens: list[np.ndarray]  # [n_cand] expected emitted tokens per step
    ms: list[np.ndarray]  # [n_cand] step ms
    joules: list[np.ndarray]  # [n_cand] J per step (nan without a power model)
    plain_tok_s: np.ndarray  # [max_batch] K = 0 with an exact graph (no padding)
    plain_ms: np.ndarray  # [max_batch]
    plain_j_tok: np.ndarray  # [max_batch]
    fixed_tok_s: np.ndarray  # [max_batch, max_k + 1] fixed K, full budget, exact graph

    @classmethod
    def build(cls, cost: CostModel, acceptance: AcceptanceModel, *, max_batch: int, max_k: int,
              universe: Sequence[int] | None = None, progress: Progress | None = None,
              fits: Callable[[int, int], bool] | None = None) -> OperatingGrid:
        """``fits(b, tokens)``: False for a step the profile ran out of memory at (such candidates
        are left out; a fixed-K reference that does not fit counts 0 tok/s)."""
        uni = list(universe) if universe is not None else tier_universe(max_batch, max_k)
        mix = Mixture.of(acceptance, max(max_k, 1))
        g = cls(uni, [], [], [], [], [], [], np.zeros(max_batch), np.zeros(max_batch),
                np.zeros(max_batch), np.zeros((max_batch, max_k + 1)))
        tiers = np.array(uni)

        def joule(tokens: int, ms: float) -> float:
            w = cost.power_w(tokens)
            return math.nan if w is None else w * ms / 1000.0

        for b in range(1, max_batch + 1):
            idx = np.nonzero(tiers >= b)[0]
            ks, bs, ts, tok, ms, js = [], [], [], [], [], []
            for k in range(max_k + 1):
                budgets = np.minimum(b * k, tiers[idx] - b)
                keep = idx if k == 0 else idx[budgets > 0]
                budgets = budgets[budgets > 0] if k else np.zeros(len(idx), np.int64)
                if not len(keep):
                    continue
                # one call for the tier candidates and the full budget b*K (fixed K, exact graph)
                tk_all = expected_tokens(mix, b, k, np.append(budgets, b * k), inflight=True)
                tk = tk_all[:-1]
                for t_i, bud, e in zip(keep, budgets, tk, strict=True):
                    t = int(tiers[t_i])
                    if fits is not None and not fits(b, t):
                        continue
                    m = step_ms(cost, b, k, t)
                    ks.append(k)
                    bs.append(int(bud))
                    ts.append(int(t_i))
                    tok.append(float(e))
                    ms.append(m)
                    js.append(joule(t, m))
                exact = b * (k + 1)
                m_exact = step_ms(cost, b, k, exact)
                runs = fits is None or fits(b, exact)
                g.fixed_tok_s[b - 1, k] = float(tk_all[-1]) / m_exact * 1000 if runs else 0.0
                if k == 0:
                    g.plain_ms[b - 1] = m_exact
                    g.plain_tok_s[b - 1] = b / m_exact * 1000
                    g.plain_j_tok[b - 1] = joule(b, m_exact) / b
            for lst, vals in zip((g.k, g.budget, g.tier_idx, g.tokens, g.ms, g.joules),
                                 (ks, bs, ts, tok, ms, js), strict=True):
                lst.append(np.array(vals))
            if progress is not None:
                progress(b, max_batch)
        return g

    @property
    def max_batch(self) -> int:
        return len(self.k)


@dataclass(frozen=True)
class Choice:
    batch: int
    k: int
    budget: int
    tier: int
    tok_s: float
    step_ms: float
    joules_per_token: float | None
    gain: float  # vs plain decoding with an exact graph
    gain_vs_fixed: float  # vs the best of plain and fixed K = 1..max_k (exact graphs)


def candidate_values(grid: OperatingGrid, i: int, mask: np.ndarray, *, objective: Objective = "goodput",
                     latency_bound_ms: float | None = None, energy_weight: float | None = None) -> np.ndarray:
    """What each candidate of batch b = i + 1 is worth [n_cand] (higher is better, a ratio scale:
    tokens/s, tokens/J, or their weighted geometric mean); 0 where its tier is not in ``mask`` or
    it breaks the latency bound."""
    ok = mask[grid.tier_idx[i]]
    if latency_bound_ms is not None:
        within = ok & (grid.ms[i] <= latency_bound_ms)
        ok = within if within.any() else ok & (grid.k[i] == 0)
    tok_s = grid.tokens[i] / grid.ms[i]
    if energy_weight is not None:
        value = tok_s ** (1 - energy_weight) * (grid.tokens[i] / grid.joules[i]) ** energy_weight
    elif objective == "energy":
        value = grid.tokens[i] / grid.joules[i]
    else:
        value = tok_s
    return np.where(ok, value, 0.0)


def _choice(grid: OperatingGrid, i: int, j: int) -> Choice:
    """Candidate j of batch b = i + 1 as a Choice."""
    tps = float(grid.tokens[i][j] / grid.ms[i][j]) * 1000
    jt = float(grid.joules[i][j] / grid.tokens[i][j])
    return Choice(i + 1, int(grid.k[i][j]), int(grid.budget[i][j]), grid.universe[grid.tier_idx[i][j]],
                  tps, float(grid.ms[i][j]), None if math.isnan(jt) else jt,
                  tps / float(grid.plain_tok_s[i]), tps / float(grid.fixed_tok_s[i].max()))


def _best(value: np.ndarray, ks: np.ndarray) -> int:
    # prefer plain decoding on ties (no drafter to run)
    return int(np.argmax(np.where(value > 0, value - 1e-12 * value * (ks > 0), -np.inf)))


def choose(grid: OperatingGrid, mask: np.ndarray, *, objective: Objective = "goodput",
           latency_bound_ms: float | None = None, energy_weight: float | None = None) -> list[Choice] | None:
    """Best candidate per batch size among the tiers in ``mask``; None if some b has none."""
    out = []
    for i in range(grid.max_batch):
        value = candidate_values(grid, i, mask, objective=objective, latency_bound_ms=latency_bound_ms,
                                 energy_weight=energy_weight)
        if not (value > 0).any():
            return None
        out.append(_choice(grid, i, _best(value, grid.k[i])))
    return out


def smooth_choices(grid: OperatingGrid, mask: np.ndarray, choices: list[Choice], tolerance: float, *,
                   objective: Objective = "goodput", latency_bound_ms: float | None = None,
                   energy_weight: float | None = None) -> tuple[list[Choice], float]:
    """Fewest K changes over batch size within a loss tolerance: (smoothed choices, worst
    per-batch relative loss vs the unsmoothed optimum).

    K is *allowed* at batch b when the best step with that K (same tier set) is worth at least
    ``1 - tolerance`` of b's optimum; a b whose optimum is plain decoding allows only K = 0 (a
    speculative step there would fall below plain decoding). Scanning b upwards, a run goes on
    while some K is allowed at every b of it (this greedy gives the fewest runs), and takes the K
    allowed throughout with the highest summed worth. Every b therefore loses at most
    ``tolerance``, whatever merges happened around it.
    """
    if tolerance <= 0 or len(choices) < 2:
        return choices, 0.0
    values = [candidate_values(grid, i, mask, objective=objective, latency_bound_ms=latency_bound_ms,
                               energy_weight=energy_weight) for i in range(grid.max_batch)]  # per b: [n_cand]
    ks = np.arange(int(max(k.max() for k in grid.k)) + 1)
    # worth[i, k]: best value with K = k at b = i + 1 over b's optimum (0 where K = k has no step)
    worth = np.array([[np.where(grid.k[i] == k, v, 0.0).max() for k in ks] / v.max()
                      for i, v in enumerate(values)])
    allowed = worth >= 1.0 - tolerance  # [max_batch, K + 1]
    for i, c in enumerate(choices):
        if c.k == 0:
            allowed[i] = ks == 0
    out: list[Choice] = []
    lo = 0
    while lo < len(choices):
        run = allowed[lo].copy()
        hi = lo + 1
        while hi < len(choices) and (run & allowed[hi]).any():
            run &= allowed[hi]
            hi += 1
        k = int(np.argmax(np.where(run, worth[lo:hi].sum(0), -1.0)))
        for i in range(lo, hi):
            c = choices[i]
            out.append(c if c.k == k else _choice(grid, i, _best(np.where(grid.k[i] == k, values[i], 0.0), grid.k[i])))
        lo = hi
    loss = max(1.0 - float(values[i][_index_of(grid, i, c)] / values[i].max()) for i, c in enumerate(out))
    return out, max(0.0, loss)


def _index_of(grid: OperatingGrid, i: int, c: Choice) -> int:
    tier = grid.universe.index(c.tier)
    hit = (grid.k[i] == c.k) & (grid.budget[i] == c.budget) & (grid.tier_idx[i] == tier)
    return int(np.nonzero(hit)[0][0])


def _score(choices: list[Choice], ideal: list[Choice], objective: Objective) -> float:
    if objective == "energy":
        return float(np.mean([_ratio(c_i.joules_per_token, c.joules_per_token)
                              for c, c_i in zip(choices, ideal, strict=True)]))
    return float(np.mean([c.tok_s / c_i.tok_s for c, c_i in zip(choices, ideal, strict=True)]))


def _ratio(num: float | None, den: float | None) -> float:
    if num is None or den is None:
        raise SearchError("costs.model.power: missing, needed for the energy objective")
    return num / den


def rows_from_choices(choices: list[Choice], tiers: Sequence[int] | None = None) -> list[Row]:
    """Adjacent batch sizes -> rows: K = 0 runs merge into one plain row; with ``tiers`` (the
    captured set), runs of one K whose every step verifies the full b*K drafts in the smallest
    tier that holds them become one ``fixed`` row (budget b*K at every b); the rest merge by
    (K, tier) into ``fill-tier`` rows. Row.gain is the mean of the choices' gains."""

    def keys(c: Choice) -> set[tuple[int, int | None]]:  # row shapes that reproduce c: (K, tier | None)
        if c.k == 0:
            return {(0, None)}
        full = tiers is not None and c.budget == c.batch * c.k and c.tier == smallest_tier(tiers, c.batch * (c.k + 1))
        return {(c.k, c.tier), (c.k, None)} if full else {(c.k, c.tier)}

    groups: list[tuple[list[Choice], set[tuple[int, int | None]]]] = []
    for c in choices:  # fewest rows: a row goes on while some shape reproduces all its choices
        common = groups[-1][1] & keys(c) if groups else set()
        if common:
            groups[-1][0].append(c)
            groups[-1] = (groups[-1][0], common)
        else:
            groups.append(([c], keys(c)))
    rows: list[Row] = []
    for grp, shapes in groups:
        lo, hi, top = grp[0].batch, grp[-1].batch, grp[-1]
        gain = round(float(np.mean([c.gain for c in grp])), 4)
        if top.k == 0:
            rows.append(Row((lo, hi), 0, 0, tier=top.tier, gain=gain))
        elif (top.k, None) in shapes:
            rows.append(Row((lo, hi), top.k, hi * top.k, tier=top.tier, gain=gain))
        else:
            rows.append(Row((lo, hi), top.k, top.budget, tier=top.tier, gain=gain, budget_mode="fill-tier"))
    return rows


@dataclass(frozen=True)
class FrontPoint:
    trial: int
    gain: float  # mean goodput / plain over batch sizes
    energy_ratio: float | None  # mean J/token / plain
    latency_ratio: float  # mean step ms / plain (p99 inter-token latency proxy)
    tiers: tuple[int, ...]


@dataclass(frozen=True)
class SearchResult:
    policy: Policy
    choices: list[Choice]
    capture_mib: float
    capture_seconds: float
    k0_cutoff: int  # smallest batch from which K = 0 throughout (max_batch + 1: none)
    trials: int
    front: list[FrontPoint]
    smooth_loss: float = 0.0  # worst per-batch relative loss of smoothing vs the unsmoothed choices
    raw_rows: int = 0  # rows before smoothing


@dataclass(frozen=True)
class Budget:
    mib: float | None = None
    seconds: float | None = None

    def excess(self, mib: float, seconds: float) -> float:
        e = 0.0
        if self.mib is not None:
            e += max(0.0, mib - self.mib) / max(self.mib, 1e-9)
        if self.seconds is not None:
            e += max(0.0, seconds - self.seconds) / max(self.seconds, 1e-9)
        return e


def _greedy_mask(grid: OperatingGrid, required: int, mib: np.ndarray, sec: np.ndarray, budget: Budget,
                 score_fn) -> np.ndarray:
    mask = np.zeros(len(grid.universe), bool)
    mask[required] = True
    best = score_fn(mask)
    while True:
        pick, pick_val = None, 0.0
        for t in np.nonzero(~mask)[0]:
            trial = mask.copy()
            trial[t] = True
            if budget.excess(float(mib[trial].sum()), float(sec[trial].sum())) > 0:
                continue
            gain = score_fn(trial) - best
            weight = (mib[t] / budget.mib if budget.mib else 0.0) + (sec[t] / budget.seconds if budget.seconds else 0.0)
            val = gain / max(weight, 1e-6)
            if gain > 1e-9 and val > pick_val:
                pick, pick_val = t, val
        if pick is None:
            return mask
        mask[pick] = True
        best = score_fn(mask)


def search_policy(cost: CostModel, acceptance: AcceptanceModel, *, max_batch: int, max_k: int,
                  capture: Sequence[CapturePoint] = (), objective: Objective = "goodput",
                  capture_budget_mib: float | None = None, capture_seconds: float | None = None,
                  latency_bound_ms: float | None = None, trials: int = 40, seed: int = 0,
                  pareto: bool = False, grid: OperatingGrid | None = None,
                  smooth: float = DEFAULT_SMOOTH, progress: Progress | None = None,
                  universe: Sequence[int] | None = None, fits: Callable[[int, int], bool] | None = None,
                  ) -> SearchResult:
    """``universe``: the candidate tiers (default ``tier_universe``); ``fits(b, tokens)``: see
    :meth:`OperatingGrid.build` (:mod:`spectune.autotune.feasibility` gives both)."""
    if not 0.0 <= smooth < 1.0:
        raise SearchError(f"smooth: must be in [0, 1), got {smooth}")
    if objective not in ("goodput", "energy", "latency"):
        raise SearchError(f"objective must be goodput, energy or latency, got {objective!r}")
    if objective == "latency" and latency_bound_ms is None:
        raise SearchError("objective latency needs --latency-bound-ms")
    if (objective == "energy" or pareto) and cost.power_w(1) is None:
        raise SearchError("costs.model.power: missing, needed for the energy objective")
    budget = Budget(capture_budget_mib, capture_seconds)
    if (budget.mib is not None or budget.seconds is not None) and not capture:
        raise SearchError("costs.capture: no capture measurements, needed for a capture budget")
    for name, v in (("capture_budget_mib", budget.mib), ("capture_seconds", budget.seconds)):
        if v is not None and v <= 0:
            raise SearchError(f"{name}: must be > 0, got {v}")
    grid = grid or OperatingGrid.build(cost, acceptance, max_batch=max_batch, max_k=max_k, progress=progress,
                                       universe=universe, fits=fits)
    uni = grid.universe
    mib, sec = capture_costs(capture, uni)
    top = smallest_tier(uni, max_batch)  # plain decoding at max_batch must fit
    if top is None:
        raise SearchError(f"max_batch: {max_batch} exceeds the largest candidate tier {uni[-1]}")
    required = uni.index(top)
    if budget.excess(float(mib[required]), float(sec[required])) > 0:
        raise SearchError(f"capture budget: the tier for max_batch={max_batch} alone needs "
                          f"{mib[required]:.0f} MiB / {sec[required]:.1f} s")
    bound = latency_bound_ms if objective == "latency" else None
    all_mask = np.ones(len(uni), bool)
    ideal = choose(grid, all_mask, objective=objective, latency_bound_ms=bound)
    assert ideal is not None

    def score_fn(mask: np.ndarray) -> float:
        ch = choose(grid, mask, objective=objective, latency_bound_ms=bound)
        return -1.0 if ch is None else _score(ch, ideal, objective)

    free = [i for i in range(len(uni)) if i != required]

    def mask_of(trial: optuna.trial.BaseTrial) -> np.ndarray:
        m = np.zeros(len(uni), bool)
        m[required] = True
        for i in free:
            m[i] = bool(trial.suggest_categorical(f"tier_{uni[i]}", [True, False]))
        return m

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    starts = [all_mask] if budget.excess(float(mib.sum()), float(sec.sum())) == 0 else []
    starts.append(_greedy_mask(grid, required, mib, sec, budget, score_fn))
    front: list[FrontPoint] = []
    if pareto:
        study = _pareto_study(grid, mask_of, mib, sec, budget, trials, seed, starts, free, uni, front)
        best_trial = max(study.best_trials, key=lambda t: t.values[0] if objective != "energy" else -t.values[1])
        mask = mask_of(optuna.trial.FixedTrial(best_trial.params))
        ew, cap = best_trial.params["energy_weight"], best_trial.params["step_cap_ms"]
        lat: float | None = float(cap)
        weight: float | None = float(ew)
    else:
        def objective_fn(trial: optuna.trial.Trial) -> float:
            m = mask_of(trial)
            excess = budget.excess(float(mib[m].sum()), float(sec[m].sum()))
            return -excess if excess > 0 else score_fn(m)

        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
        for m in starts:
            study.enqueue_trial({f"tier_{uni[i]}": bool(m[i]) for i in free})
        study.optimize(objective_fn, n_trials=max(trials, len(starts)))
        mask = mask_of(optuna.trial.FixedTrial(study.best_trial.params))
        lat, weight = bound, None
    raw = choose(grid, mask, objective=objective, latency_bound_ms=lat, energy_weight=weight)
    if raw is None:
        raise SearchError("no feasible tier set found")
    choices, loss = smooth_choices(grid, mask, raw, smooth, objective=objective, latency_bound_ms=lat,
                                   energy_weight=weight)
    used = sorted({c.tier for c in choices})
    used_idx = [uni.index(t) for t in used]
    cutoff = max_batch + 1
    for c in reversed(choices):
        if c.k > 0:
            break
        cutoff = c.batch
    room = room_tiers(cost, acceptance, max_batch=max_batch, max_k=max_k, universe=uni)
    used = add_room(used, room, uni, mib, sec, budget)
    used_idx = [uni.index(t) for t in used]
    online = Online(min_k=0, max_k=max_k, prior=live_prior(acceptance, choices, max_k),
                    adapt_range=(min(ADAPT_SCALES), max(ADAPT_SCALES)))
    rows = [dataclasses.replace(r, tokens=row_tokens(mix_of(acceptance, max_k), r, max_k))
            for r in rows_from_choices(choices, used)]
    policy = Policy(tiers=used, rows=rows, online=online,
                    objective="pareto" if pareto else objective)
    # rows before smoothing, over the same tiers as the policy's (a row's budget fills its tier,
    # so another tier set splits rows differently: smoothing 0 read "20 -> 21 rows")
    return SearchResult(policy, choices, float(mib[used_idx].sum()), float(sec[used_idx].sum()), cutoff,
                        len(study.trials), front, loss, len(rows_from_choices(raw, used)))


def mix_of(acceptance: AcceptanceModel, max_k: int) -> Mixture:
    return Mixture.of(acceptance, max(max_k, 1))


def row_tokens(mix: Mixture, row: Row, max_k: int) -> list[float]:
    """Expected emitted tokens per request per step at K = 0..max_k, full budget, at the row's
    middle batch size, over the in-flight mix (what the online controller calibrates to)."""
    b = (row.batch[0] + row.batch[1]) // 2
    out = [1.0]
    for k in range(1, max_k + 1):
        t = float(expected_tokens(mix, b, k, [b * k], inflight=True)[0]) / b
        out.append(round(min(max(t, out[-1]), out[-1] + 1.0), 5))
    return out


def room_tiers(cost: CostModel, acceptance: AcceptanceModel, *, max_batch: int, max_k: int,
               universe: Sequence[int], scales: Sequence[float] = ADAPT_SCALES) -> dict[int, int]:
    """Tiers the online controller needs if the traffic's acceptance is the tuned mean curve
    scaled by each of ``scales``: per scale and batch size, the best K with its full budget b*K
    (homogeneous requests) in the smallest universe tier holding b*(K+1). Returns tier -> how
    many (scale, batch) optima use it. Plain decoding's tier at every batch size is always
    included (K = 0 is the controller's choice wherever drafting stops paying, and a plain step
    pays for its padding like any other)."""
    need: dict[int, int] = {}
    for b in range(1, max_batch + 1):
        tier = smallest_tier(universe, b)
        if tier is not None:
            need[tier] = need.get(tier, 0) + 1
    base = np.array(acceptance.mean_conditional()[:max_k] or (0.0,), dtype=float)
    base = np.pad(base, (0, max(0, max_k - len(base))), mode="edge")
    for scale in scales:
        surv = np.cumprod(np.clip(base * scale, 0.0, 1.0))
        extra = np.concatenate([[0.0], np.cumsum(surv)])  # [max_k + 1] expected accepted drafts at K
        for b in range(1, max_batch + 1):
            best, best_tier = -1.0, None
            for k in range(max_k + 1):
                tier = smallest_tier(universe, b * (k + 1))
                if tier is None:
                    break
                g = b * (1.0 + extra[k]) / step_ms(cost, b, k, tier)
                if g > best:
                    best, best_tier = g, tier
            if best_tier is not None:
                need[best_tier] = need.get(best_tier, 0) + 1
    return need


def add_room(used: Sequence[int], room: dict[int, int], universe: Sequence[int], mib: np.ndarray,
             sec: np.ndarray, budget: Budget) -> list[int]:
    """``used`` plus the tiers of ``room``, the most needed first, while the capture budget holds."""
    out = set(used)
    for tier in sorted(room, key=lambda t: (-room[t], t)):
        if tier in out:
            continue
        trial = out | {tier}
        idx = [universe.index(t) for t in trial]
        if budget.excess(float(mib[idx].sum()), float(sec[idx].sum())) == 0:
            out = trial
    return sorted(out)


def live_prior(acceptance: AcceptanceModel, choices: list[Choice], max_k: int) -> list[float]:
    """Conditional rates [max_k] the runtime should observe when the traffic is as tuned: the mean
    curve of the in-flight mix (full budget, at the K of the smallest speculative batch size)."""
    mix = Mixture.of(acceptance, max_k)
    k = next((c.k for c in choices if c.k > 0), max_k)
    w = inflight_weights(mix, 1, k, [k])[0]  # [C]
    surv = w @ mix.survival  # [max_k]
    prev = np.concatenate([[1.0], surv[:-1]])
    rates = np.divide(surv, prev, out=np.zeros_like(surv), where=prev > 0)
    return [round(float(min(1.0, a)), 6) for a in rates]


def _pareto_study(grid, mask_of, mib, sec, budget, trials, seed, starts, free, uni, front) -> optuna.Study:
    step_max = float(max(m.max() for m in grid.ms))
    step_min = float(grid.plain_ms.min())

    def evaluate(trial: optuna.trial.BaseTrial) -> tuple[float, float, float]:
        m = mask_of(trial)
        ew = trial.suggest_float("energy_weight", 0.0, 1.0)
        cap = trial.suggest_float("step_cap_ms", step_min, step_max, log=True)
        excess = budget.excess(float(mib[m].sum()), float(sec[m].sum()))
        ch = choose(grid, m, latency_bound_ms=cap, energy_weight=ew)
        if excess > 0 or ch is None:
            return -excess - 1.0, 1e9, 1e9
        gain = float(np.mean([c.gain for c in ch]))
        e = float(np.mean([_ratio(c.joules_per_token, float(grid.plain_j_tok[c.batch - 1])) for c in ch]))
        lat = float(np.mean([c.step_ms / grid.plain_ms[c.batch - 1] for c in ch]))
        return gain, e, lat

    study = optuna.create_study(directions=["maximize", "minimize", "minimize"],
                                sampler=optuna.samplers.NSGAIISampler(seed=seed))
    for m in starts:
        study.enqueue_trial({**{f"tier_{uni[i]}": bool(m[i]) for i in free},
                             "energy_weight": 0.0, "step_cap_ms": step_max})
    study.optimize(evaluate, n_trials=max(trials, len(starts)))
    for t in sorted(study.best_trials, key=lambda t: -t.values[0]):
        tiers = tuple(u for u in uni if t.params.get(f"tier_{u}", True))
        front.append(FrontPoint(t.number, t.values[0], t.values[1], t.values[2], tiers))
    return study
