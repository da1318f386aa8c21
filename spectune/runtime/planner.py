"""Runtime planner: load a policy table at server start and answer ``plan(batch)`` per step.

``plan(b)`` is a host-side list lookup (no GPU work, no device value): it returns K (0 = the
drafter does not run), the verify budget B (draft tokens checked this step over all requests)
and the captured tier to replay (smallest tier >= b + B). ``plan_ride(b, P)`` is the same for a
step whose forward also carries P prompt tokens (mixed prefill): it may answer a smaller K there,
from a dict made once per estimate.

The online controller closes the loop. ``observe(accepted_per_pos, tested_per_pos)`` takes the
device's acceptance counters of the previous step (host copies, one step late):
  tested_per_pos[i]:   drafts at position i + 1 that were tested (granted, and position i accepted)
  accepted_per_pos[i]: of those, how many were accepted
so accepted / tested is the conditional acceptance a_{i+1}. Acceptance does not depend on the
batch size, so the evidence is pooled over every batch size; the decisions stay per batch size.

Estimate (counts decay by 1 - 1/window per observed step: about the last ``online.window``
steps, so the estimate describes the requests in flight now -- a window counted in drafts would
keep a long-gone request's deep positions, which the traffic now in flight no longer reaches):
  rho    = (sum_i A_i + d) / (sum_i T_i * prior_i + d)           pooled drift of the whole curve
  a_i    = (A_i + m * min(1, prior_i * rho)) / (T_i + m)        each position's own counts pull
                                                               it away from the drifted prior
  se_i   = sqrt(phi * a_i (1 - a_i) / (T_i + m)),  a_i^-/+ = a_i -/+ z * se_i
with m = ``SHRINK`` pseudo-drafts and d = ``DRIFT_SHRINK`` pseudo-accepts (as the counts decay
without new drafts the estimate returns to the prior and its bounds widen). Positions never
tested (deeper than any K run so far) follow the drifted prior with the prior's uncertainty.

Decision for batch b (every ``online.decide_every`` observed steps for the batch last planned;
sooner when the block so far holds ``EARLY_FOLD_DRAFTS`` tested first drafts and at least as many
as the estimate -- a cold start or a reset at a large batch, where one or two steps say what a
block would; and in ``plan`` when the batch size changes to one whose choice is that stale -- a
draining batch visits each size for a step or two -- and was made on an estimate that has moved
since: a rate by more than its interval's half-width, the evidence by a factor of two, a reset;
or is ``REUSE_FOLDS`` blocks old, or its close call's trial is due: ``Planner._stale``):
candidates are every K in [min_k, max_k] (K = 0 included) with every verify budget that fills a
captured tier (b*K if a tier holds it, else the largest tier that does not), each with its step
time from the cost model precomputed at load. Expected tokens of a candidate under rates a are
the uniform-spread count ``b + b * S_q + r * s_{q+1}`` (q, r = divmod(B, b); the device ranks by
per-request confidences, which can only do better). The controller moves from the current
choice to the candidate whose *lower bound* of the gain -- the smaller goodput ratio under a^-
and a^+ -- is largest, when that bound exceeds 1 + ``online.margin``. The pessimistic rates are
a_i on the positions the current shape reaches and a_i^- beyond: what a deeper shape adds is
its new positions; the shared ones count in both shapes' tokens alike (bounding them too would
count their uncertainty against every climb, and at batch 1 the deep positions, tested by probes
only, never get narrow enough for a climb to pass).

Calibration: requests differ, and the pooled conditional rates of a mixture mis-rank K (easy
requests reach the deep positions, and the in-flight mix itself moves with K). The tuner's exact
in-flight mixture model predicted each row's tokens per request at every K (``Row.tokens``); the
controller multiplies its prediction for a shape by f(K) = tokens_row(K) / (1 + S_K(prior))
(interpolated at B / b drafts per request), so at the tuned prior it ranks shapes exactly as the
tuner did, and under drift it scales the tuned mixture's shape by the measured rates. Before ``min_evidence``
tested first-position drafts, nothing moves. Every choice is a plan of its own batch
size, so a changed K is always a captured shape for the batch it is applied to.

Exploration (optimism under uncertainty): every ``probe_every``-th step runs the candidate that
is best under a^+ if that beats the current choice under a^+ -- a shape that could be better
given what is known -- among shapes of at most ``PROBE_STEP`` more drafts than the choice (a deep
probe is a costly step: K climbs a step at a time). How often a probe runs follows its cost and
what it may find: with loss = 1 - G(probe)/G(choice) under the point estimate and up =
G^+(probe)/G(choice) - 1 under the upper bounds, it runs every max(probe_every * loss / (loss +
up), loss / margin) steps (at least 1, at most ``probe_every``; every step when the point estimate
already prefers it; before ``min_evidence``, every ``probe_every`` steps). A probe near even with the choice and with room above it -- batch 1, where a
probe tests one request's deep positions and K + 2 costs about what K does -- runs often, so K
climbs in a short run; a costly probe runs rarely, and by the loss / margin term probing never
costs more than the margin by the point estimate. Deeper positions get tested, so K can climb past positions no shape has
tested yet. Probes are drafting shapes: a plain step measures nothing. Once the estimate is sure
the choice is best, no probe runs; as the counts decay without new drafts, the bounds widen and
probing resumes by itself -- except at K = 0, where no drafts arrive and the estimate only ages
(traffic that turned easier would go unseen for good): a batch size whose choice is plain keeps
K = 1 at its full budget as a probe, every max(1, loss * max(loss, ``BLIND_NEAR``) / (BLIND_NEAR *
``BLIND_COST`` * margin)) steps, at most ``BLIND_WAIT`` * probe_every, so K = 0 is a choice like
any other and is left again. Before any decision, a batch size the table runs at K = 0 probes K = 1.
As plain decoding stops the evidence, a drafting choice turns plain only on an estimate of at least
``PLAIN_EVIDENCE`` tested first drafts: after a reset the estimate is the one block that fired the
test, and at a wave's start that block is its least accepted steps (HumanEval n-gram at c = 64 on
the H200: a1 0.11 in a wave's first step, 0.34 later; plain chosen on it held 27-35 full-load steps
a run where K = 1 is 7.7 % faster). And a plain choice gets trials (below) of a close K = 1.

Acceptance that depends on K: the model above takes the rates measured at one K to hold at
another, and they need not (an n-gram match is a span, and a larger K crosses it in fewer steps,
so fewer steps start inside one: HumanEval n-gram at batch 32 accepts position 1 0.325 of the time
at K = 1 and 0.29 at K = 2, and the pooled rates rank K = 2 first where K = 1 is faster). So the
counts of each step well inside a run of one K (after ``REGIME_SETTLE`` steps of it: the first
steps start where the old K left the requests) also go to that K's own decayed counts, and each K
with counts of its own gets a correction of the pooled model, c_K = tokens per request at K under
its own rates (shrunk toward the pooled ones by ``REGIME_SHRINK`` pseudo-drafts) over those under
the pooled rates, with a relative error u_K (``_regimes``); every shape of that K scores c_K times
its pooled tokens. A K with counts of its own is not probed (one step of it inside another K's run
measures neither). Trials: a shape of another K within ``TRIAL_GAP`` of the choice (point
estimate; from a drafting choice once the choice has ``REGIME_SHRINK`` drafts of its own counts,
from a plain one at once: its tokens are the batch, and its K = 1 probes start where plain left the
requests, so they measure K = 1 low) whose own counts are missing, or whose gain is unresolved (it could beat the margin
within z * sqrt(u_K^2 + u_choice^2)), runs a block of ``TRIAL_STEPS`` steps in a row (longer below
batch 10, below), as often as what it loses allows (every block length * loss / (``TRIAL_COST`` *
margin) steps, so trials cost at most that fraction of the margin). The decision right after a trial takes the tried K if it scores at
least the choice: its tokens were measured in a block of their own, the choice's are a prediction
(a wrong move is a close call, and the old choice is tried in turn). Plain decoding is tried
that way once against a choice of K = 1 that was never weighed against it -- the table's, from a
start or a change, or one a trial took from plain on its point estimate -- from batch 10 and on
``PLAIN_TRY_EVIDENCE`` first drafts, where it is a close call still unresolved; not as a standing
close call (a plain block tests no draft). Page's test compares a block
of a K with counts of its own against those counts, so moving between K's is no shift. Where
acceptance does not depend on K, each K's counts agree with the pooled ones (c_K ~ 1) and a trial
confirms the model at a cost below TRIAL_COST * margin. They agree up to their noise only, and a
trial block of 16 steps sees the same few requests: on 0.9^i traffic at batch 16 qwen3-32b's
corrections read 0.95-1.05 and the choice wandered over K = 6-9 where K = 7 leads by 3 %. So from
batch 10 the decisions use each c_K shrunk toward 1 by an empirical-Bayes estimate of the spread
of the K's corrections beyond their errors, tau^2 = max(0, mean((c_K - 1)^2 - u_K^2)) over the K's
with REGIME_SHRINK first drafts of their own: c_K <- 1 + (c_K - 1) tau^2 / (tau^2 + u_K^2) (noise
shrinks to ~1, corrections several u_K apart keep most of theirs; ``_regimes``). A trial block tests at least
``TRIAL_DRAFTS`` first drafts: TRIAL_STEPS steps from batch 10, as many as test that many below it
(batch 1: 130 steps; a 16-step block there measured a handful of drafts, and trials of that length
took the tuned curve to 0.981 of the best fixed K in tests/autotune/test_heldout.py). Below batch
10, where no block of TRIAL_STEPS measures a K, three rules keep noise out: the decisions of a
batch size wait for its trial's end (at batch 1 a trial of K = 8 read c_K = 1.067 on its first 24
drafts and moved the choice to it), a correction counts only from TRIAL_DRAFTS first drafts of the
K's own (a few drafts of a deep K compound their noise over its positions and held a climbing
choice at K = 8 where K = 10 is best), and a K with counts of its own is still probed (probes climb
K a step at a time there; a trial of 130 steps would climb it slowly); a plain choice runs no trial
there (K = 1's blind probes measure it, where a 130-step trial of K = 1 cost 1 %). Simulated at c = 1 over the
five shipped H200 tables: trace sets +0.0..+1.4 %, the curves and the tuned acceptance level
(docs/BENCHMARKS.md section 6, "Trials below batch 10").

A change detector compares a fast window (``change_window`` steps) with the estimate:
    D = (A_fast - sum_i T_fast_i a_i) / sqrt(sum_i T_fast_i a_i (1 - a_i))
and D^2 > ``change_z``^2 * phi empties the estimate (``Planner.changes`` counts the resets): the new
traffic's pooled drift then scales the prior at every position, also at positions the old counts
would have kept stale because a lower acceptance no longer tests them. phi, the running mean of
D^2 on steps without a change (>= 1), is the overdispersion: requests differ, and when few of them
are in the window (batch 1) they move the estimate far more than binomial noise; phi widens the
bounds and the change test by as much. A decision's D^2 enters phi clipped at ``PHI_CLIP`` * phi
and phi stays <= ``PHI_MAX``: a gradual shift gives D^2 just under the change test decision after
decision, and learning from it would raise the test's own threshold until no shift is detected
and the upper bounds send the probes ever deeper (measured in a closed drift run that the bench
repeats: phi 1 -> 12.7 over six runs, auto 0.92-0.95 of the best fixed K; with the clip and the
cap 0.94-0.98). A shift can also come gradually, as the in-flight mix turns over while requests
finish, and stay under that test decision after decision (the fast window lags the shift and the
estimate follows part of it): a closed drift run of 48 requests at batch 16 (0.9^i, then 0.55^i)
kept K = 6 through its 0.55^i half with |D| <= 4.2. So each block of ``decide_every`` steps is
also tested, before it enters the estimate, against the estimate's own rates A_i / T_i (Page's
CUSUM test, ``Planner._page``): the block's deviations add up, and a sustained shift of a few
sigma per block fires within a few blocks; the block so far is also tested at every drafting
step, and a step that carries the sum past the limit ends the block there (a sharp shift is
acted on within a step or two, not at the block's end: drift at c = 64 on the H200 0.948 -> 0.997).
Beside the sum, a block of at least ``TRIAL_DRAFTS`` tested first drafts whose own |D_b| passes
``change_z`` fires the test alone (a Shewhart limit beside the CUSUM: at batch 256 one K = 1 probe
of a plain choice showed a shift by 6.9 sigma, below the sum's limit of 8.5 for one block, and
the next probe came ~9 steps later in a full-load window of ~40; drift at c = 256 in simulation
0.966 -> 0.976 of the best fixed K at full load). After a change the block that showed it is the new
estimate's first evidence, so the decision made then can already leave the old choice.

Batch 1 in two states: one request's drafts come in spans (an n-gram or suffix drafter copies a
stretch, then finds nothing), so at batch 1, where the counters are that request's, a step
planned after one whose first draft was accepted accepts more than one planned after a miss
(MT-Bench n-gram traces: a1 ~0.56 against ~0.14). Each batch-1 drafting step's counts go to the
state its plan was made in (a list of the plans in flight: an engine reads them a step or two
late); where the two first-position rates differ by more than z standard errors, a plan made
after a hit runs the best shape under that state's rates when it is deeper than the choice and
beats it there by the margin, and its counts stay out of the pooled estimate, so the choice
(with its probes) is made for the steps after a miss (``Planner._burst_plan``). Traffic whose
acceptance does not hang on the last step keeps one plan. A change of level forgets the pooled
estimate but not the two states where they show the contrast (their counts as of the fold
before the change): span traffic moves its level from request to request while a hit says as
much as before; forgotten at each change, at c = 1 the states rarely held the counts to act on.

Step times: the candidates' step times above are the cost model's; ``observe_time(batch, plan,
ms)`` takes each step's measured device time (the engine's CUDA events, once landed), and each
shape is scored at model ms x its own measured ratio, shrunk toward the ratio of the timed shapes
of its batch size (plain and drafting steps apart); an untimed shape's time counts as unresolved
by the profile's held-out median error in the trial test, so a close call is tried, and timed
(``Planner.observe_time`` states the details).

Batch sizes above the table's range reuse the last batch size's choice, with the budget cut to
fit the largest tier (counted in ``Planner.clamped``), where the cost model at the estimate's
point rates says it still beats plain decoding there, else plain; a batch larger than the largest tier gets
``tier=None`` (no captured graph: the caller runs eager, counted in ``Planner.uncaptured``).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from operator import add
from pathlib import Path
from typing import Any, Literal, NamedTuple

from spectune.errors import SpectuneError, TableError
from spectune.runtime.costs import CostModel
from spectune.runtime.table import DEFAULT_ACCEPTANCE, Row, Table, read_table

OnMismatch = Literal["warn", "refuse", "ignore"]
SHRINK = 32.0  # pseudo-drafts at prior * drift per position in the online rate estimate
DRIFT_SHRINK = 4.0  # pseudo-expected accepts at drift 1: with no evidence the estimate is the prior
PHI_WEIGHT = 0.05  # weight of one decision's D^2 in the overdispersion estimate phi
MIN_CHANGE_DRAFTS = 16.0  # tested drafts the fast window needs before the change test runs
PHI_CLIP = 4.0  # a decision's D^2 enters phi clipped at PHI_CLIP * phi (a shift must not teach phi)
PHI_MAX = 4.0  # overdispersion cap: a slow shift below the change test must not widen the bounds for good
PLAIN_EVIDENCE = 128.0  # tested first drafts a drafting choice needs before it may turn plain (``_decide``)
PLAIN_TRY_EVIDENCE = 16 * PLAIN_EVIDENCE  # tested first drafts before plain is tried against a K = 1 (``_decide``)
PLAIN_AGAIN = 0.5  # ... and again, where plain leads by its point estimate, this many x window steps after a try
EARLY_FOLD_DRAFTS = 4 * PLAIN_EVIDENCE  # a block holding this many first drafts, and as many as the estimate, is
# decided on at once (``observe``): at batch 256, two steps; below batch 64, never sooner than the block
PROBE_STEP = 2  # a probe runs at most this many drafts more than the current choice
BLIND_COST = 0.25  # a plain choice's K = 1 probe costs at most this fraction of the margin (as trials) ...
BLIND_WAIT = 16  # ... and runs at least every BLIND_WAIT * probe_every steps
BLIND_NEAR = 0.1  # beyond this loss, the probe budget falls as 1 / loss
CUSUM_SLACK = 0.5  # Page's test: a block's standardized deviation counts beyond this many sigma
CUSUM_LIMIT = 8.0  # ... and a change fires once the sum passes this (~10^4 blocks between false alarms)
REGIME_SETTLE = 2  # steps after K changes whose counters stay out of the new K's own counts
REGIME_SHRINK = 32.0  # pseudo-drafts at the pooled rate per position in a K's own estimate
REGIME_CLIP = 0.1  # a K's measured correction of the pooled model stays within 1 -/+ this
TRIAL_GAP = 0.05  # a shape of another K this close to the choice (point estimate) is a close call
TRIAL_STEPS = 16  # ... and is run for this many steps in a row (from batch 10; longer below: ``_trial_steps``)
TRIAL_COST = 0.25  # trials cost at most this fraction of the margin (point estimate)
TRIAL_DRAFTS = 4 * REGIME_SHRINK  # a trial block tests at least this many first drafts (longer below batch 10)
RIDE_MIN_K = 0  # the smallest K a riding step may run (``plan_ride``; 0: plain decoding)
TIME_PRIOR = 4.0  # pseudo-steps at the all-shapes ratio in one shape's measured-time ratio
TIME_WINDOW = 64.0  # steps one shape's (and the all-shapes) time ratio averages over, at most
TIME_ROBUST = 4.0  # steps of a shape after which one step's log ratio is clipped to ...
TIME_OUTLIER = 0.2  # ... within this of the shape's mean (a host stall is not the shape's cost)
TIME_POOL_OUTLIER = 1.0  # ... and within this of its pool's mean (the pools mix shapes)
REUSE_MOVE = 1.0  # a batch size met again keeps its choice while no rate of the estimate moved by more than
# this x its interval's half-width (a block of stationary traffic moves a rate by 0.1-0.3 of it) and no K's own
# correction by more than this x its own (z x its standard error), ...
REUSE_FOLDS = 16  # ... for at most this many x decide_every steps (the measured step times move too), and
# not past the step its last decision's close call falls due for a trial
BURST_DRAFTS = 32.0  # batch 1: first drafts each of the two states (after a hit / otherwise) needs before
# the controller may run a plan of its own after a hit (``_burst_plan``)
BURST_WINDOW = 4.0  # ... over this many x the estimate's window (steps after a hit are a small share)
BURST_STALE = 1  # ... a hit holds while at most this many plain steps have been observed since it
BURST_LAG = 8  # a batch-1 drafting plan whose counts have not come back within this many plans is dropped
NO_CORR = (1.0, 0.0, 0.0)  # (correction, its relative error, first-position counts) of a K without counts


class PolicyMismatch(SpectuneError):
    """The table was measured on another GPU than the one it is loaded on."""


class PolicyMismatchWarning(UserWarning):
    """Warned (not raised) when a table from another GPU is loaded with on_gpu_mismatch='warn'."""


class Plan(NamedTuple):  # a tuple: hashed in C (a step looks shapes up by plan a dozen times)
    k: int  # drafts proposed per request; 0 = plain decoding
    verify_budget: int  # draft tokens verified this step over all requests, <= batch * k
    tier: int | None  # captured token count replayed (>= batch + verify_budget); None = eager


@dataclass
class OnlineState:
    """Everything the controller learns while serving (``Planner.reset_online`` starts a fresh one;
    ``snapshot_online``/``restore_online`` copy it). Per batch size: the current choice, the probe
    shape, the observed step of the last decision. Per position: decayed counts of the slow
    estimate (A/T) and of the change detector's fast window (Af/Tf), the counts observed since
    they were last folded in (pa/pt, one block of ``decide_every`` steps), the estimate and its
    bounds."""

    choice: list[Plan]
    probe: list[Plan | None]
    every: list[int]  # probe interval in steps per batch size (``Planner._decide``)
    decided_at: list[int]
    decided_v: list[int]  # the estimate's version each batch size was last decided on (``Planner._moved``)
    A: list[float]
    T: list[float]
    Af: list[float]
    Tf: list[float]
    pa: list[float]
    pt: list[float]
    a: list[float]
    lo: list[float]
    hi: list[float]
    drift: float = 1.0
    # survival sums of the estimate (``_survival_sums``: a, hi) and of the pessimistic rates per
    # depth (a on the first ``depth`` positions, lo beyond), made from a/lo/hi when first asked
    # for after each estimate (``Planner._sums``)
    sums: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)
    phi: float = 1.0  # overdispersion of the acceptance counts (1 = binomial)
    rise: float = 0.0  # Page's sums of the blocks' deviations from the estimate (``Planner._page``)
    fall: float = 0.0
    block_fires: bool = False  # the last block folded passed the one-block limit (``Planner._block_fires``)
    steps: int = 0  # observed steps
    folded: int = 0  # observed steps already folded into A/T
    since_probe: int = 0
    pg_at: float = 0.0  # the block's tested first drafts at which its in-block change test runs next (``observe``)
    last_batch: int | None = None
    changes: int = 0  # change-detector resets
    probes: int = 0  # probe steps run
    clamped: int = 0  # batches above the table's range
    uncaptured: int = 0  # batches above the largest tier
    # per K (``Planner._regimes``): decayed counts of the steps run inside a settled run of that K
    # (RA/RT [K][K], last decayed at step Rat[K]); of the pending block, the K of its settled steps
    # (rk, 0: none yet), how many (rq) and the sum of its other steps' counts (ra/rt); the K of the
    # last plans returned and how many in a row (run_k/run_len); per K the correction (c, u,
    # first-position counts); per batch size the trial shape, its steps left and the step it started
    RA: list[list[float]] = field(default_factory=list)
    RT: list[list[float]] = field(default_factory=list)
    Rat: list[int] = field(default_factory=list)
    rk: int = 0
    rq: int = 0
    ra: list[float] = field(default_factory=list)
    rt: list[float] = field(default_factory=list)
    run_k: int = -1
    run_len: int = 0
    ride_step: bool = False  # the last plan was a riding step's other K (``plan_ride``)
    corr: list[tuple[float, float, float]] = field(default_factory=list)
    corr_wide: list[tuple[float, float, float]] = field(default_factory=list)  # (``_regimes``)
    trial: list[Plan | None] = field(default_factory=list)
    trial_left: list[int] = field(default_factory=list)
    trial_at: list[float] = field(default_factory=list)
    tried: list[int] = field(default_factory=list)  # K of a trial that ended, not yet judged (-1: none)
    # plain decoding is to be tried once against the batch size's drafting choice: the table's
    # (from a start or a change) or one a trial took from plain on its point estimate (and again,
    # where it leads, PLAIN_AGAIN windows after the step it was last tried from K = 1: ``plain_at``)
    try_plain: list[bool] = field(default_factory=list)
    plain_at: list[float] = field(default_factory=list)
    due: list[float] = field(default_factory=list)  # the step a close call's trial falls due (``_stale``)
    trials: int = 0  # trial blocks started
    # measured step times (``Planner.observe_time``; not traffic, so a change keeps them): per
    # (batch size, shape) the steps timed (capped at TIME_WINDOW) and the running mean of
    # log(measured / cost-model ms); the same over every timed step (``lg``)
    lt: dict[int, dict[Plan, tuple[float, float]]] = field(default_factory=dict)
    lg: list[tuple[float, float]] = field(default_factory=lambda: [(0.0, 0.0), (0.0, 0.0)])  # plain, drafting
    lb: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # the same per batch size
    timed: int = 0  # steps timed
    # shapes of riding steps (``Planner.plan_ride``) per (batch size, prompt tokens, choice), made
    # once per estimate
    ride: dict[tuple[int, int, Plan], Plan] = field(default_factory=dict)
    # the estimate's version (``Planner._version``): bumped where its tokens moved by REUSE_MOVE x
    # margin since the last bump (``v_ref``: the survival sums and corrections then), checked once per fold
    version: int = 0
    v_fold: int = -1
    v_ref: tuple[Any, ...] | None = None
    # batch 1 in two states (``Planner._burst_plan``): whether the newest drafting step observed at
    # batch 1 accepted its first draft (``hit``); decayed counts of the batch-1 steps planned
    # after a hit (hA/hT) and otherwise (mA/mT), last decayed at step h_at; the plan run after a
    # hit (None: the choice), and how many steps ran it
    hit: bool = False
    since_hit: int = 0  # plain steps observed at batch 1 since that drafting step
    plans: int = 0  # plans returned
    # batch-1 drafting plans whose counts have not come back yet (an engine reports a step's
    # counters a step or two late): (plan number, planned after a hit, ran the hit state's plan)
    pending: list[tuple[int, bool, bool]] = field(default_factory=list)
    hA: list[float] = field(default_factory=list)
    hT: list[float] = field(default_factory=list)
    mA: list[float] = field(default_factory=list)
    mT: list[float] = field(default_factory=list)
    h_at: int = 0
    h_fold: tuple[list[float], list[float], list[float], list[float], int] = ([], [], [], [], 0)  # (as of the last fold)
    burst: Plan | None = None
    bursts: int = 0
    # the planner's table it belongs to (max batch, tiers, largest K): its choices are shapes of
    # that table's captured tiers, so another table's planner refuses it (``restore_online``)
    owner: tuple[Any, ...] = ()

    def copy(self) -> OnlineState:
        out: dict[str, Any] = {}
        for f, v in vars(self).items():
            if isinstance(v, list):
                out[f] = [list(x) if isinstance(x, list) else x for x in v]
            elif isinstance(v, dict):  # (per batch size: a dict or a list of its own)
                out[f] = {key: dict(x) if isinstance(x, dict) else list(x) if isinstance(x, list) else x
                          for key, x in v.items()}
        return replace(self, **out)


def row_budget(row: Row, batch: int) -> int:
    """Verify budget of ``row`` at ``batch``."""
    if row.k <= 0:
        return 0
    if row.budget_mode == "fill-tier":
        assert row.tier is not None
        base = max(0, row.tier - batch)
    else:
        base = row.verify_budget
    return max(0, min(batch * row.k, base))


def step_ms(cost: CostModel, batch: int, k: int, tier: int, ride: int = 0, piece_kv: float = 0.0) -> float:
    """One step as the runtime runs it: drafter(b, K) + target(tier) + overhead(tier); the step
    pays for its padded tier, and a K = 0 step is plain decoding (no verification KV term). With
    ``ride`` prompt tokens after the tier's (mixed prefill: their bucket) the target and overhead
    run at tier + ride tokens (the weights are read once for both), plus ``piece_kv`` keys read by
    the pieces (their mean positions summed: ``prefill_plan.Riding.carried``)."""
    tokens = tier + ride
    ms = cost.drafter_ms(batch, k) + cost.target_ms(tokens, batch, verify=k > 0) + cost.overhead_ms(tokens)
    return ms + cost.params.target.kv_ms_per_mtok * piece_kv / 1e6 if piece_kv else ms


def smallest_tier(tiers: Sequence[int], tokens: int) -> int | None:
    i = bisect_left(tiers, tokens)
    return tiers[i] if i < len(tiers) else None


class Planner:
    """Flat lookup ``batch -> Plan`` (the table's rows, then the controller's choices), plus the
    online controller (its state: ``OnlineState``)."""

    def __init__(self, table: Table, *, file: str | os.PathLike[str] | None = None):
        if table.policy is None:
            raise TableError("policy", "missing: this is a cost-only profile (run `spectune tune`)", file)
        self.table = table
        self.policy = table.policy
        self.online = self.policy.online
        self.tiers: list[int] = list(self.policy.tiers)
        self.max_batch = self.policy.rows[-1].batch[1]
        self.cost = CostModel.of(table)
        # a shape not timed yet: its model time is as uncertain as the profile's held-out median
        self._time_err = max(0.01, table.costs.error.median_rel)
        self._keep = 1.0 - 1.0 / self.online.window  # per-step decay of the estimate's counts
        self._keep_fast = 1.0 - 1.0 / self.online.change_window
        self._keep_burst = 1.0 - 1.0 / (BURST_WINDOW * self.online.window)  # (``_burst_count``)
        self.k_lo = self.online.min_k
        self.k_hi = self.online.max_k if self.online.max_k is not None else table.workload.max_k
        self.k_hi = max(self.k_hi, max(r.k for r in self.policy.rows), 1)
        prior = list(self.online.prior) if self.online.prior else [DEFAULT_ACCEPTANCE] * self.k_hi
        self.prior = (prior + [prior[-1]] * self.k_hi)[: self.k_hi]
        self.ride_aware = True  # False: a riding step runs plan(batch), the rule before plan_ride (A/B)
        self._build_lookup()
        # before any decision, a batch size the table runs at K = 0 probes K = 1 (full budget)
        self._first_probe: list[Plan | None] = [
            None if self._table[b].k else next((p for p, _ in reversed(self._cands[b]) if p.k == 1), None)
            for b in range(self.max_batch + 1)]
        self._s = self._fresh_state()

    # -- load-time precomputation -------------------------------------------------------------

    def _build_lookup(self) -> None:
        # _table[b]: the row's plan at b; _cands[b]: (plan, step ms) of every candidate shape at b
        self._table: list[Plan] = [Plan(0, 0, None)] * (self.max_batch + 1)
        self._cands: list[list[tuple[Plan, float]]] = [[] for _ in range(self.max_batch + 1)]
        self._fac: list[dict[Plan, float]] = [{} for _ in range(self.max_batch + 1)]
        self._model_ms: list[dict[Plan, float]] = [{} for _ in range(self.max_batch + 1)]  # (``observe_time``)
        self._cand_ms: list[dict[Plan, float]] = [{} for _ in range(self.max_batch + 1)]
        # per candidate of each batch size, what ``_decide``'s loop reads and never changes:
        # (plan, model ms, q, r of the budget over b (q capped at max_k), K, calibration factor)
        self._loop: list[list[tuple[Plan, float, int, int, int, float]]] = [[] for _ in range(self.max_batch + 1)]
        self._blind: list[Plan | None] = [None] * (self.max_batch + 1)  # K = 1 at its full budget
        # a trial block's steps at batch b: TRIAL_STEPS, or as many as test TRIAL_DRAFTS first drafts
        self._trial_steps = [TRIAL_STEPS] + [max(TRIAL_STEPS, REGIME_SETTLE + math.ceil(TRIAL_DRAFTS / b))
                                             for b in range(1, self.max_batch + 1)]
        # batch sizes above the table's range: (drafting step ms, plain step ms, plain tier)
        self._outside_ms: dict[tuple[int, int, int], tuple[float, float, int]] = {}
        prior_sums = _survival_sums(self.prior)[1]
        for row in self.policy.rows:
            lo, hi = row.batch
            # tuned tokens per request at K / this model's at the prior (1 where the row has none)
            f_row = [1.0] * (self.k_hi + 1)
            if row.tokens:
                tok = (list(row.tokens) + [row.tokens[-1]] * self.k_hi)[: self.k_hi + 1]
                f_row = [t / (1.0 + prior_sums[k]) for k, t in enumerate(tok)]
            for b in range(lo, hi + 1):
                budget = row_budget(row, b)
                tier = smallest_tier(self.tiers, b + budget)
                self._table[b] = Plan(row.k if budget > 0 else 0, budget, tier)
                self._cands[b] = self._candidates(b, self._table[b])
                self._fac[b] = {p: _calibration(f_row, b, p.verify_budget) for p, _ in self._cands[b]}
                self._loop[b] = [(p, ms, *_split_budget(p.verify_budget, b, self.k_hi), p.k, self._fac[b][p])
                                 for p, ms in self._cands[b]]
                self._model_ms[b] = dict(self._cands[b])
                self._cand_ms[b] = dict(self._cands[b])  # (``_decide``: the candidates' own, never grows)
                self._blind[b] = next((p for p, _ in self._cands[b] if p.k == 1 and p.verify_budget == b), None)

    def _candidates(self, b: int, table_plan: Plan) -> list[tuple[Plan, float]]:
        """Step shapes at batch b that no other shape dominates (same tokens for less time):
        plain decoding; per K, its full budget b*K in the smallest tier that holds it; per tier t
        that b*k_hi overfills, the budget t - b that fills it with the smallest K that offers it
        (tokens depend on the budget only, and a larger K pays more drafter time)."""
        plans = {table_plan} if table_plan.tier is not None else set()
        if self.k_lo == 0:
            tier = smallest_tier(self.tiers, b)
            if tier is not None:
                plans.add(Plan(0, 0, tier))
        for k in range(max(1, self.k_lo), self.k_hi + 1):
            full = smallest_tier(self.tiers, b + b * k)
            if full is not None:
                plans.add(Plan(k, b * k, full))
        for tier in self.tiers:
            budget = tier - b
            k = max(self.k_lo, 1, -(-budget // b))
            if budget > 0 and k <= self.k_hi and budget < b * k:
                plans.add(Plan(k, budget, tier))
        return sorted(((p, step_ms(self.cost, b, p.k, p.tier)) for p in plans if p.tier is not None),
                      key=lambda pm: (pm[0].k, pm[0].verify_budget))

    # -- per step -------------------------------------------------------------------------------

    def plan(self, batch_size: int) -> Plan:
        s = self._s
        if batch_size != s.last_batch and 0 < batch_size <= self.max_batch \
                and s.steps - s.decided_at[batch_size] >= self.online.decide_every and self._stale(batch_size):
            self._decide(batch_size)  # a batch size reached again (or first) with a stale choice
            # (on the estimate of the last fold: at most decide_every - 1 steps old)
        s.last_batch = batch_size
        after_hit = batch_size == 1 and s.hit and s.since_hit <= BURST_STALE  # (``_burst_count``)
        if 0 < batch_size <= self.max_batch:
            plan = s.trial[batch_size]
            if plan is not None:  # a trial block of another K (``_decide``): no probes meanwhile
                s.trial_left[batch_size] -= 1
                if s.trial_left[batch_size] <= 0:  # ended: the next decision judges it
                    s.trial[batch_size], s.tried[batch_size] = None, plan.k
            elif after_hit and (burst := s.burst if s.burst is not None else self._blind[1]
                                if not s.choice[1].k and s.hT and s.hT[0] < BURST_DRAFTS else None):
                # after a hit at batch 1, the plan of that state (``_burst_plan``); under a plain
                # choice, K = 1 until that state has counts enough to decide on
                plan = burst
                s.bursts += 1
            else:
                plan = s.probe[batch_size]
                if plan is None or not self._probe_due(s.every[batch_size]):
                    plan = s.choice[batch_size]
        else:
            plan = self._plan_outside(batch_size)
        if plan.k == s.run_k:  # how many plans in a row ran this K (``observe``: settled blocks)
            s.run_len += 1
        else:
            s.run_k, s.run_len = plan.k, 1
        s.plans += 1
        if batch_size == 1 and plan.k:  # (``_burst_count``: the state it was planned in)
            s.pending.append((s.plans, after_hit, after_hit and plan is s.burst))
            if len(s.pending) > BURST_LAG:  # (a server that never observes: the list stays short)
                del s.pending[0]
        return plan

    def plan_ride(self, batch_size: int, ride: int) -> Plan:
        """``plan`` for a step whose forward also carries ``ride`` prompt tokens (mixed prefill:
        their bucket). The prompt tokens push the step past the compute knee, where each verify
        token costs more than in the choice's own step, so a riding step may run a smaller K:
        among the shapes no deeper than the choice (plain decoding too) and in no larger tier, the one that
        keeps the most tokens after paying for its time at what a millisecond yields at this
        batch size without the ride (the choice's tokens per ms, point estimate): tokens -
        value x step ms with the ride. The ride's own cost is the same for every shape and drops
        out. A trial's or a probe's step is judged the same way against its own shape. A riding
        step of another K neither extends nor breaks the run of the planned K, and its counters
        stay out of both K's own counts. The shape per (batch size, ride, plan) is made once per
        estimate (host time: a dict lookup). Simulated over the held-out sources
        (``benchmarks/sim_ride_aware.py``): -0.2..+5.7 % end to end, median +1.0 %."""
        plan = self.plan(batch_size)
        if ride <= 0 or not self.ride_aware or not 0 < batch_size <= self.max_batch or plan.k < 1 or plan.tier is None:
            return plan
        s = self._s
        key = (batch_size, ride, plan)
        shape = s.ride.get(key)
        if shape is None:
            shape = s.ride[key] = self._ride_shape(batch_size, ride, plan)
        if shape.k != plan.k:  # neither in the run of plan.k nor a run of its own: its counters
            s.run_len -= 1  # stay out of both K's own counts (``observe``), and the run goes on
            s.ride_step = True
        return shape

    def _ride_shape(self, b: int, ride: int, cur: Plan) -> Plan:
        assert cur.tier is not None
        sums, fac, cost = self._sums(-1), self._fac[b], self.cost
        cur_tok = _tokens(sums, b, cur.verify_budget) * fac.get(cur, 1.0)
        value = cur_tok / self._model_ms[b].get(cur, step_ms(cost, b, cur.k, cur.tier))
        best, best_net = cur, cur_tok - value * step_ms(cost, b, cur.k, cur.tier, ride)
        for p, _ in self._cands[b]:
            if p.k < RIDE_MIN_K or p.k > cur.k or p.tier is None or p.tier > cur.tier or p == cur:
                continue
            net = _tokens(sums, b, p.verify_budget) * fac[p] - value * step_ms(cost, b, p.k, p.tier, ride)
            if net > best_net:
                best, best_net = p, net
        return best

    def _probe_due(self, every: int) -> bool:
        s = self._s
        if not self.online.probe_every:
            return False
        s.since_probe += 1
        if s.since_probe < every:
            return False
        s.since_probe = 0
        s.probes += 1
        return True

    def _plan_outside(self, batch_size: int) -> Plan:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        s = self._s
        s.clamped += 1
        k = s.choice[self.max_batch].k
        budget = max(0, min(batch_size * k, self.tiers[-1] - batch_size)) if k else 0
        tier = smallest_tier(self.tiers, batch_size + budget)
        if tier is None:
            s.uncaptured += 1
            return Plan(0, 0, None)
        if budget <= 0:
            return Plan(0, 0, tier)
        pays, plain_tier = self._outside_pays(batch_size, k, budget, tier)
        return Plan(k, budget, tier) if pays else Plan(0, 0, plain_tier)

    def _outside_pays(self, batch_size: int, k: int, budget: int, tier: int) -> tuple[bool, int]:
        """No row here: the last row's K drafts on only while the cost model, at the estimate's
        point rates, still says it beats plain decoding at this batch (past the range the target
        turns compute-bound and a K that paid at the last row can cost more than it gives); and
        plain decoding's tier. The step times are made once per (batch, K, budget)."""
        key = (batch_size, k, budget)
        ms = self._outside_ms.get(key)
        if ms is None:
            plain_tier = smallest_tier(self.tiers, batch_size)
            ms = self._outside_ms[key] = (step_ms(self.cost, batch_size, k, tier),
                                          step_ms(self.cost, batch_size, 0, plain_tier or tier), plain_tier or tier)
        draft_ms, plain_ms, plain_tier = ms
        return _tokens(self._sums(-1), batch_size, budget) * plain_ms > batch_size * draft_ms, plain_tier

    def uniform_k(self, batch_size: int) -> int:
        """The K an engine that drafts every request alike (vLLM, SGLang, TensorRT-LLM: no verify
        budget, no tiers) runs at ``batch_size`` past the table's rows, by ``_plan_outside``'s rule:
        the last row's K (the controller's choice there), cut to what the largest tier holds for
        every request, while the cost model at the estimate's point rates says it beats plain
        decoding; else 0. Inside the rows: the row's K. Read only (no ``clamped`` count)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size <= self.max_batch:
            return self._table[batch_size].k
        k = min(self._s.choice[self.max_batch].k, (self.tiers[-1] - batch_size) // batch_size)
        if k <= 0:
            return 0
        tier = smallest_tier(self.tiers, batch_size * (k + 1))
        assert tier is not None  # batch_size * (k + 1) <= tiers[-1]
        return k if self._outside_pays(batch_size, k, batch_size * k, tier)[0] else 0

    def observe(self, accepted_per_pos: Any, tested_per_pos: Any) -> None:
        """Add one step's counters (a K = 0 step observes nothing: time still passes). The counts
        are summed per block of ``decide_every`` steps and folded into the decayed estimate at
        the block's end (host time: two list additions per step)."""
        s = self._s
        acc = _host_list(accepted_per_pos)
        off = _host_list(tested_per_pos)
        if acc and off and not (min(acc) >= 0.0 and min(off) >= 0.0 and sum(acc) + sum(off) < math.inf):
            # a NaN (which fails every comparison: the sum carries it) would stay in the estimate
            # for good, a negative count breaks the variances later (builtins: ~1 us a step)
            raise ValueError(f"observe: counters must be finite and >= 0, got accepted {acc}, tested {off}")
        n = self.k_hi
        if len(acc) != n or len(off) != n:  # counters of another width: cut or pad to k_hi
            m = min(len(acc), len(off), n)
            acc = acc[:m] + [0.0] * (n - m)
            off = off[:m] + [0.0] * (n - m)
        if s.last_batch == 1 and self._burst_count(acc, off):  # the hit state's own plan ran: its
            acc = off = [0.0] * n  # counts stay out of the pooled estimate, which then speaks for the other state
        s.pa = list(map(add, s.pa, acc))
        s.pt = list(map(add, s.pt, off))
        k = s.run_k  # a step well inside a run of K (of the last plans returned, so also with a
        ride, s.ride_step = s.ride_step, False  # copy a step late), not a riding step of another K
        if s.run_len > REGIME_SETTLE and k > 0 and (s.rk == k or not s.rk) and not ride:
            s.rk, s.rq = k, s.rq + 1
        elif k > 0:  # any other step: kept out of the block's K counts (``_fold_regime``)
            s.ra = list(map(add, s.ra, acc)) if s.ra else list(acc)
            s.rt = list(map(add, s.rt, off)) if s.rt else list(off)
        s.steps += 1
        every = self.online.decide_every
        if s.steps - s.folded < every and not (off[0] and (
                s.pt[0] >= EARLY_FOLD_DRAFTS and s.pt[0] >= s.T[0] or s.pt[0] >= s.pg_at and self._page_due())):
            return  # estimate, test and decide every decide_every observed steps; sooner when the
            # block so far holds enough first drafts to act on and as many as the estimate (after a
            # reset, a cold start or a long plain spell: at batch 256 two steps, where waiting out
            # the block ran the table's K = 1 for 3-9 steps of HumanEval n-gram that plain wins),
            # or when it already carries Page's test past its limit -- a shift shows in a step --
            # once it has tested as many first drafts as a block of batch 1 does (fewer are
            # noise, at batch 1 the early test cost 1 % on a drift and 0.6 % on a two-class mix),
            # and again each time they have doubled (``_page_due``: run every step, the test was
            # 8-12 % of a step's host time; the held-out matrix reads level with the doubling)
        block = self._fold()
        if self._changed():  # forget the old traffic (its deep positions would stay stale) and
            s.changes += 1  # its choices: back to the table until the new traffic is measured
            # the block that showed the change is the new traffic's first evidence: the decision
            # below uses it, not a block later
            self._reset_estimate(block)
            s.choice = list(self._table)
            s.probe = list(self._first_probe)
            s.every = [self.online.probe_every] * (self.max_batch + 1)
            self._clear_trials()
        self._decide()
        if s.hT:
            s.burst = self._burst_plan()
            s.h_fold = (s.hA, s.hT, s.mA, s.mT, s.h_at)  # (``_reset_estimate``; its lists are never changed in place)

    def observe_time(self, batch_size: int, plan: Plan, ms: float) -> None:
        """One step's measured time (the device time of a step the engine ran at ``batch_size``
        with ``plan``, read once its events have landed: a few steps late, never waiting). The
        cost model's time of a shape can be off by a few per cent where it matters (a GEMM tile,
        a drafter shape), and two shapes a per cent or two apart are ranked by it; so each shape
        keeps the running mean of log(measured / model) over its last ``TIME_WINDOW`` steps,
        and ``_decide`` scores it at model ms x exp(that mean shrunk by ``TIME_PRIOR``
        pseudo-steps toward the mean over the timed shapes of its pool at its batch size, else
        at every batch size -- the pools: plain steps, and drafting steps, whose drafter share
        the plain ones lack): a shape the trials or probes ran is ranked by what it cost here,
        one never run as the model ranks it beside the timed shapes of its batch size, with its
        time unresolved by the profile's held-out median error (a close call then gets a trial,
        which times it). One step's log ratio is clipped to within
        ``TIME_OUTLIER`` of its shape's mean once the shape has ``TIME_ROBUST`` steps (a stalled
        host shows in the device span, and is not the shape's cost). Off with
        ``online.time_feedback: false``."""
        if not self.online.time_feedback or not 0 < batch_size <= self.max_batch or plan.tier is None \
                or not 0.0 < ms < math.inf:  # (a NaN or an infinite span: no time to learn from)
            return
        model = self._model_ms[batch_size].get(plan)
        if model is None:  # a shape outside the candidates (the table's own plan is one of them)
            model = self._model_ms[batch_size][plan] = step_ms(self.cost, batch_size, plan.k, plan.tier)
        x = math.log(ms / model)
        s = self._s
        pool = 1 if plan.k else 0
        # (three running means of at most TIME_WINDOW values, inlined: this runs every step)
        n, m = s.lg[pool]
        x_all = x if n < TIME_ROBUST else m - TIME_POOL_OUTLIER if x < m - TIME_POOL_OUTLIER \
            else m + TIME_POOL_OUTLIER if x > m + TIME_POOL_OUTLIER else x
        n = n + 1.0 if n < TIME_WINDOW else n
        s.lg[pool] = (n, m + (x_all - m) / n)
        shapes = s.lt.get(batch_size)
        if shapes is None:
            shapes = s.lt[batch_size] = {}
            s.lb[batch_size] = [(0.0, 0.0), (0.0, 0.0)]
        at_b = s.lb[batch_size]
        n, m = at_b[pool]
        n = n + 1.0 if n < TIME_WINDOW else n
        at_b[pool] = (n, m + (x_all - m) / n)
        n, m = shapes.get(plan, (0.0, 0.0))
        if n >= TIME_ROBUST:
            x = m - TIME_OUTLIER if x < m - TIME_OUTLIER else m + TIME_OUTLIER if x > m + TIME_OUTLIER else x
        n = n + 1.0 if n < TIME_WINDOW else n
        shapes[plan] = (n, m + (x - m) / n)
        s.timed += 1

    def _pool_offsets(self, b: int) -> tuple[float, float]:
        """Mean log ratio of the plain steps' and of the drafting steps' measured times at batch b,
        else over every batch size (a pool without a timed step takes the other's): what a shape
        not timed yet is taken to be off by, so that beside the timed shapes of its batch size it
        ranks as the cost model ranks it. Plain decoding without a timed step takes the drafting
        pool's offset only where that is below 0: a drafting step slower than modelled may owe it
        to its drafter, which a plain step lacks. (Taken whole, a drafter 2.5x the profile's kept
        plain as slow as K = 1 in prediction, and a choice of K = 1 never ran plain to time it:
        0.92 of plain in simulation, 0.995-0.998 with this rule. Where the target is the slow
        part, the first plain step times it and the pool holds it from then on.)"""
        (n0, m0), (n1, m1) = self._s.lg
        g0, g1 = (m0 if n0 else min(0.0, m1)), (m1 if n1 else m0)
        at_b = self._s.lb.get(b)
        if at_b is not None:
            (n0, m0), (n1, m1) = at_b
            g0, g1 = (m0 if n0 else g0), (m1 if n1 else g1)
        return g0, g1

    def _timing(self, b: int, p: Plan) -> tuple[float, float]:
        """Measured-time factor of shape p at batch b (``observe_time``) and its relative error."""
        return self._shape_timing(self._s.lt.get(b, {}).get(p, (0.0, 0.0)), self._pool_offsets(b)[1 if p.k else 0])

    def _shape_timing(self, timed: tuple[float, float], g: float) -> tuple[float, float]:
        """Factor and relative error of a shape's time from its (steps, mean log ratio), shrunk
        toward its pool's offset ``g`` by TIME_PRIOR pseudo-steps."""
        n, m = timed
        w = n / (n + TIME_PRIOR)
        return math.exp(g + w * (m - g)), self._time_err * math.sqrt(TIME_PRIOR / (n + TIME_PRIOR))

    def _sums(self, depth: int) -> tuple[list[float], list[float]]:
        """Survival sums of the estimate's rates (``depth`` -1), of its upper bounds (-2), or of
        the pessimistic rates of a shape ``depth`` drafts deep (a on the first ``depth``
        positions, lo beyond), each made once per estimate."""
        s = self._s
        out = s.sums.get(depth)
        if out is None:
            rates = s.a if depth == -1 else s.hi if depth == -2 else s.a[:depth] + s.lo[depth:]
            out = s.sums[depth] = _survival_sums(rates)
        return out

    def _fold(self) -> tuple[list[float], list[float]] | None:
        """Decay the counts by the steps since the last fold and add the block's counts (a block's
        steps weigh alike: within ``decide_every`` steps the decay is at most a few per cent), then
        re-estimate; a block that carries Page's test past its limit is only returned (the change
        that follows estimates from it alone)."""
        s = self._s
        m = s.steps - s.folded
        if m <= 0:
            return None
        self._page()
        block = (s.pa, s.pt)
        if self._page_fired():  # a change (``_changed``): ``observe`` estimates afresh from the block
            return block  # alone (``_reset_estimate``), so folding it into the old counts would be lost work
        g, gf = self._keep ** m, self._keep_fast ** m
        s.A = [g * x + p for x, p in zip(s.A, s.pa, strict=True)]
        s.T = [g * x + p for x, p in zip(s.T, s.pt, strict=True)]
        s.Af = [gf * x + p for x, p in zip(s.Af, s.pa, strict=True)]
        s.Tf = [gf * x + p for x, p in zip(s.Tf, s.pt, strict=True)]
        self._fold_regime()
        s.pa, s.pt = [0.0] * self.k_hi, [0.0] * self.k_hi
        s.folded = s.steps
        s.pg_at = self.online.decide_every
        self._estimate()
        return block

    def _fold_regime(self) -> None:
        """Add the block's settled steps of K ``rk`` (its counts less those of its other steps) to
        K's own counts, decayed to now."""
        s = self._s
        k = s.rk
        if k and s.rq:
            acc, off = s.pa[:k], s.pt[:k]
            if s.rt:
                acc = [x - y for x, y in zip(acc, s.ra, strict=False)]
                off = [x - y for x, y in zip(off, s.rt, strict=False)]
            if off[0] > 0.0:
                if s.RT[k]:
                    g = self._keep ** (s.steps - s.Rat[k])
                    s.RA[k] = [g * x + y for x, y in zip(s.RA[k], acc, strict=True)]
                    s.RT[k] = [g * x + y for x, y in zip(s.RT[k], off, strict=True)]
                else:
                    s.RA[k], s.RT[k] = acc, off
                s.Rat[k] = s.steps
        s.rk, s.rq, s.ra, s.rt = 0, 0, [], []

    def _page(self) -> None:
        """Page's test (CUSUM) of the block about to be folded in, against the counts it has not
        entered yet: over the positions the estimate knows from counts of its own (T_i >= m)
          D_b = sum_i (A_b,i - T_b,i A_i / T_i) / sqrt(phi * sum_i T_b,i a_i (1 - a_i) (1 + T_b,i / T_i))
        (the last factor: the old rate's own uncertainty; the raw rates A_i / T_i, not the shrunk
        a_i, so a prior that does not fit stationary traffic is not taken for a shift), and
        rise = max(0, rise + D_b - slack), fall = max(0, fall - D_b - slack). A sustained shift of
        a few sigma per block crosses ``CUSUM_LIMIT`` in a few blocks, also one that the
        fast-window test never sees pass change_z. A block run at one K with counts of its own
        (``_regimes``) is tested against that K's counts on its positions: acceptance may depend on
        the K run, and a K that differs from the pooled mix is no shift."""
        d = self._page_d()
        s = self._s
        s.block_fires = d is not None and self._block_fires(d)  # (``_changed``)
        if d is not None:
            s.rise = max(0.0, s.rise + d - CUSUM_SLACK)
            s.fall = max(0.0, s.fall - d - CUSUM_SLACK)

    def _page_fired(self) -> bool:
        """Whether Page's test of the blocks folded so far (``_page``) signals a change."""
        s = self._s
        return max(s.rise, s.fall) > CUSUM_LIMIT or s.block_fires

    def _page_due(self) -> bool:
        """``_page_fires`` of the block so far, run where its tested first drafts have doubled since
        the last run in this block (from ``decide_every``): a handful of runs a block."""
        s = self._s
        s.pg_at = 2.0 * s.pt[0]
        return self._page_fires()

    def _page_fires(self) -> bool:
        """Whether the block so far, ended now, would carry Page's test past its limit."""
        d = self._page_d()
        s = self._s
        return d is not None and (max(s.rise + d, s.fall - d) - CUSUM_SLACK > CUSUM_LIMIT or self._block_fires(d))

    def _block_fires(self, d: float) -> bool:
        """The one-block limit beside Page's sum: the block so far tests at least ``TRIAL_DRAFTS``
        first drafts and its own D_b passes ``change_z``."""
        return self._s.pt[0] >= TRIAL_DRAFTS and abs(d) > self.online.change_z

    def _page_d(self) -> float | None:
        """The standardized deviation D_b of the block so far (``_page``); None without counts."""
        s = self._s
        x = e = v = 0.0
        As, Ts, k = s.A, s.T, s.rk
        if k and s.rq == s.steps - s.folded and s.RT[k]:
            g = self._keep ** (s.steps - s.Rat[k])
            if s.RT[k][0] * g >= SHRINK:
                As, Ts = [g * x for x in s.RA[k]] + As[k:], [g * x for x in s.RT[k]] + Ts[k:]
        for pa, t, a, A, T in zip(s.pa, s.pt, s.a, As, Ts, strict=True):
            if t and T >= SHRINK:
                w = a * (1.0 - a)
                x, e = x + pa, e + t * A / T
                v += t * (w if w > 1e-4 else 1e-4) * (1.0 + t / T)
        if v <= 0.0:  # (no minimum count: how many drafts a block tests depends on how many
            return None  # it accepted, and keeping only the blocks that tested many would bias D up)
        return (x - e) / math.sqrt(s.phi * v)

    def _burst_count(self, acc: list[float], off: list[float]) -> bool:
        """Batch 1: a drafting step's counts (one first draft tested) go to the state its plan was
        made in (after a hit or not: the oldest plan whose counts are due, ``pending``), both
        states' counts decayed to now; its first draft sets the state of the plans to come.
        Whether they are counts of the hit state's own plan (``_burst_plan``)."""
        s = self._s
        if off[0] <= 0.0:  # a plain step
            s.since_hit += 1
            return False
        s.hit, s.since_hit = 2.0 * acc[0] > off[0], 0  # (its first draft accepted; expected counts: most of it)
        while s.pending and s.pending[0][0] < s.plans - BURST_LAG:
            s.pending.pop(0)  # (counts an engine dropped: a run's start forgets the last run's)
        if not s.pending:
            return False
        _, after_hit, own = s.pending.pop(0)
        if off[0] != 1.0:  # several steps' counts at once: their states are not told apart
            del s.pending[:int(off[0]) - 1]
            return False
        if not s.hT:
            n = self.k_hi
            s.hA, s.hT, s.mA, s.mT = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        else:
            g = self._keep_burst ** (s.steps - s.h_at)
            s.hA, s.hT = [g * x for x in s.hA], [g * x for x in s.hT]
            s.mA, s.mT = [g * x for x in s.mA], [g * x for x in s.mT]
        s.h_at = s.steps
        if after_hit:
            s.hA, s.hT = list(map(add, s.hA, acc)), list(map(add, s.hT, off))
        else:
            s.mA, s.mT = list(map(add, s.mA, acc)), list(map(add, s.mT, off))
        return own

    def _two_states(self) -> bool:
        """Whether the steps after a hit accept their first draft more often than the others, by
        more than ``z`` standard errors, each state with ``BURST_DRAFTS`` first drafts."""
        s = self._s
        th, tm = s.hT[0], s.mT[0]
        if th < BURST_DRAFTS or tm < BURST_DRAFTS:
            return False
        ph, pm = min(s.hA[0], th) / th, min(s.mA[0], tm) / tm
        v = s.phi * (max(ph * (1.0 - ph), 1e-4) / th + max(pm * (1.0 - pm), 1e-4) / tm)
        return ph - pm > self.online.z * math.sqrt(v)

    def _burst_plan(self) -> Plan | None:
        """Batch 1 in two states. One request's drafts come in spans (an n-gram or suffix drafter
        copies a stretch, then finds nothing): a step after one whose first draft was accepted
        accepts more than one after a miss. Where the two states' first-position rates differ by
        more than ``z`` standard errors (each with ``BURST_DRAFTS`` first drafts), the step after a
        hit runs the best shape under that state's rates (each position shrunk toward the pooled
        rate x the state's drift against the pooled estimate, as ``_estimate`` shrinks toward the
        drifted prior) when it is deeper than the choice and beats it there by the margin; the
        choice (made on the other state's counts: the hit state's stay out of the pooled
        estimate while its own plan runs) runs after a miss, with its probes. None: the choice in
        both states (traffic whose acceptance does not hang on the last step)."""
        s = self._s
        if not self._cands[1] or not self._two_states():
            return None
        expect = sum(t * a for t, a in zip(s.hT, s.a, strict=True))
        rho = (sum(s.hA) + DRIFT_SHRINK) / (expect + DRIFT_SHRINK)
        rates = [((A if A < T else T) + SHRINK * min(1.0, a * rho)) / (T + SHRINK)
                 for A, T, a in zip(s.hA, s.hT, s.a, strict=True)]
        sums = _survival_sums(rates)
        fac = self._fac[1]
        cur = s.choice[1]
        best, best_g, cur_g = None, 0.0, 0.0
        for p, ms in self._cands[1]:
            g = _tokens(sums, 1, p.verify_budget) * fac[p] / (ms * self._timing(1, p)[0])
            if p == cur:
                cur_g = g
            if g > best_g:
                best, best_g = p, g
        if best is None or best.k <= cur.k or best_g <= cur_g * (1.0 + self.online.margin):
            return None
        return best

    def _estimate(self) -> None:
        s = self._s
        expect = sum(t * p for t, p in zip(s.T, self.prior, strict=True))
        drift = s.drift = (sum(s.A) + DRIFT_SHRINK) / (expect + DRIFT_SHRINK)
        z, phi, sqrt = self.online.z, s.phi, math.sqrt
        rates: list[float] = []
        lows: list[float] = []
        highs: list[float] = []
        rate, low, high = rates.append, lows.append, highs.append
        for A, T, p in zip(s.A, s.T, self.prior, strict=True):
            base = p * drift
            n = T + SHRINK
            a = ((A if A < T else T) + SHRINK * (base if base < 1.0 else 1.0)) / n
            v = a * (1.0 - a)
            e = z * sqrt(phi * (v if v > 1e-4 else 1e-4) / n)
            rate(a)
            low(a - e if a > e else 0.0)
            high(a + e if a + e < 1.0 else 1.0)
        s.a, s.lo, s.hi = rates, lows, highs
        s.sums = {}
        s.ride = {}
        self._regimes()

    def _regimes(self) -> None:
        """Each K's correction of the pooled model from its own counts (``RA/RT[K]``, steps run in a
        settled block of K): per position the K's own rate shrunk toward the pooled one,
          a_K,i = (RA_i + M a_i) / (RT_i + M),   M = ``REGIME_SHRINK``,
        the tokens per request at K under those rates over those under the pooled ones,
          c_K = (1 + S_K(a_K)) / (1 + S_K(a))   (clipped to 1 -/+ ``REGIME_CLIP``),
        and its relative standard error u_K (delta method over the positions, the data part of
        each shrunk rate: var = phi a_K,i (1 - a_K,i) RT_i / (RT_i + M)^2)."""
        s = self._s
        phi, corr = s.phi, [NO_CORR] * (self.k_hi + 1)
        lo_c, hi_c = 1.0 - REGIME_CLIP, 1.0 + REGIME_CLIP
        for k, T in enumerate(s.RT):
            if not T:
                continue
            g = self._keep ** (s.steps - s.Rat[k])
            if T[0] * g < 1e-3:  # long gone
                s.RA[k], s.RT[k] = [], []
                continue
            rates, var, surv_before = [], [], []  # (surv_before[i]: the product of the rates before i)
            surv, y_k, y_pool, sp = 1.0, 1.0, 1.0, 1.0
            for x, t, a in zip(s.RA[k], T, s.a, strict=False):
                x, t = g * x, g * t
                n = t + REGIME_SHRINK
                r = ((x if x < t else t) + REGIME_SHRINK * a) / n
                rates.append(r)
                var.append(phi * r * (1.0 - r) * t / (n * n))
                surv_before.append(surv)
                surv *= r
                sp *= a
                y_k += surv
                y_pool += sp
            # dY/da_i = s_{i-1} * h_i,  h_K = 1,  h_i = 1 + a_{i+1} h_{i+1}
            h, v2 = 1.0, 0.0
            for i in range(len(rates) - 1, -1, -1):
                d = surv_before[i] * h
                v2 += d * d * var[i]
                h = 1.0 + rates[i] * h
            c = y_k / y_pool
            corr[k] = (lo_c if c < lo_c else hi_c if c > hi_c else c, math.sqrt(v2) / y_k, T[0] * g)
        s.corr = s.corr_wide = corr
        # from batch 10 (``_decide``'s ``wide``) each K's correction is shrunk toward the pooled
        # model by how far the corrections of the K's with REGIME_SHRINK first drafts of their own
        # differ beyond their errors (empirical Bayes: tau^2 = max(0, mean((c_K - 1)^2 - u_K^2)),
        # c_K <- 1 + (c_K - 1) tau^2 / (tau^2 + u_K^2)): where acceptance does not depend on K they
        # differ by noise alone and the choice is made on the pooled rates; where it does (n-gram
        # spans, several u_K apart) most of each is kept
        own = [x for x in corr if x[2] >= REGIME_SHRINK]
        if own:
            tau2 = max(0.0, sum((c - 1.0) ** 2 - u * u for c, u, _ in own) / len(own))
            s.corr_wide = [(1.0 + ((c - 1.0) * tau2 / (tau2 + u * u) if tau2 else 0.0) if n else c, u, n)
                           for c, u, n in corr]

    def _changed(self) -> bool:
        """Change test; also learns the overdispersion ``phi`` = E[D^2] of a stationary stream
        (requests differ, and a few requests in the window move the estimate more than binomial
        noise would: at batch 1 the window holds only a handful of them)."""
        s = self._s
        if self._page_fired():
            return True
        e = v = 0.0
        for t, a in zip(s.Tf, s.a, strict=True):
            e += t * a
            v += t * a * (1.0 - a)
        if sum(s.Tf) < MIN_CHANGE_DRAFTS or v <= 0.0:
            return False
        d2 = (sum(s.Af) - e) ** 2 / v
        if d2 > self.online.change_z ** 2 * s.phi:
            return True
        s.phi = min(PHI_MAX, max(1.0, (1.0 - PHI_WEIGHT) * s.phi + PHI_WEIGHT * min(d2, PHI_CLIP * s.phi)))
        return False

    def _stale(self, b: int) -> bool:
        """Whether ``plan`` decides batch size b again on meeting it with a choice older than the last
        fold: where the estimate moved since that decision (``_version``), a trial of b ended (to be
        judged), the step has come from which that decision would have started a close call's
        trial, or the decision is REUSE_FOLDS x decide_every steps old (the measured step times
        move too). Otherwise a decision would return the choice it returned before, and is not
        made: a server's batch walks, so most steps meet a batch size whose choice predates the
        last fold, and re-deciding each was a third of the host time there. The fold's own
        decision of the batch it ran (``observe``) is made every fold as before."""
        s = self._s
        return s.decided_v[b] != self._version() or s.tried[b] >= 0 or s.steps >= s.due[b] \
            or s.steps - s.decided_at[b] >= REUSE_FOLDS * self.online.decide_every

    def _version(self) -> int:
        """The estimate's version, checked at most once per fold: bumped where, since the last bump,
        a position's rate moved by more than REUSE_MOVE x its interval's half-width (the z
        bounds), a K's own correction by more than REUSE_MOVE x z x its standard error, the
        evidence crossed min_evidence or PLAIN_EVIDENCE or doubled or halved (the bounds narrow or
        widen by a third: a lower bound's gate may open); and at every reset. Stationary traffic
        moves a rate by 0.1-0.3 of its half-width a fold, and a decision turns on such a move only
        where the call was already that close."""
        s = self._s
        if s.v_fold == s.folded and s.v_ref is not None:
            return s.version
        s.v_fold = s.folded
        ev = self.evidence
        ref = (s.a, s.corr, ev >= self.online.min_evidence, ev >= PLAIN_EVIDENCE, ev)
        old = s.v_ref
        if old is not None and old[2:4] == ref[2:4] and 0.5 * old[4] <= ev <= 2.0 * old[4] \
                and not _moved(old, ref, s.lo, s.hi, self.online.z):
            return s.version
        if old is not None:  # (a new estimate after a reset: bumped there)
            s.version += 1
        s.v_ref = ref
        return s.version

    def _decide(self, b: int | None = None) -> None:
        s = self._s
        b = s.last_batch if b is None else b
        if b is None or not 0 < b <= self.max_batch or not self._cands[b]:
            return
        s.decided_at[b], s.decided_v[b], s.due[b] = s.steps, s.version, math.inf  # (``_stale``: a version
        # not checked at this fold is the one before it; where a check bumps it, b is decided again)
        if s.trial[b] is not None and self._trial_steps[b] > TRIAL_STEPS:
            return  # a long trial (below batch 10) is judged at its end, not on its first few drafts
        cur = s.choice[b]
        cur_ms = self._cand_ms[b].get(cur)
        if cur_ms is None:
            return
        timed = self.online.time_feedback and s.timed > 0  # shapes scored at their measured times
        ut_cur = 0.0
        if timed:  # (``_timing``, its pool offsets read once for the loop below)
            shapes = s.lt.get(b, {})
            g0, g1 = self._pool_offsets(b)
            f0, f1, u_none = math.exp(g0), math.exp(g1), self._time_err
            f_cur, ut_cur = self._shape_timing(shapes.get(cur, (0.0, 0.0)), g1 if cur.k else g0)
            cur_ms *= f_cur
        # pessimistic rates of a deeper shape: the point estimate on the positions the current
        # shape already reaches (they count alike in both shapes' tokens), the lower bounds beyond
        depth = -(-cur.verify_budget // b)
        sums = [self._sums(min(depth, self.k_hi)), self._sums(-1), self._sums(-2)]
        # each K's correction from its own counts (``_regimes``); where one block of TRIAL_STEPS
        # does not measure a K (``wide`` false: its trials run longer), only from TRIAL_DRAFTS
        # first drafts of its own (fewer, applied at batch 1, cost HumanEval n-gram 0.993 -> 0.971
        # of the best fixed K under the bench's protocol)
        trials = self.online.probe_every > 0
        wide = b * (TRIAL_STEPS - REGIME_SETTLE) >= TRIAL_DRAFTS
        corr = s.corr_wide if wide else [x if x[2] >= TRIAL_DRAFTS else (1.0, x[1], x[2]) for x in s.corr]
        c_cur, u_cur, n_cur = corr[cur.k]
        cur_fac = self._fac[b][cur] * c_cur
        tok_cur = [_tokens(x, b, cur.verify_budget) * cur_fac for x in sums]
        need = tok_cur[1] * (1.0 + self.online.margin) / cur_ms  # point-estimate goodput to beat
        trial: Plan | None = None  # the best unresolved close call of another K
        trial_g = tok_cur[1] / cur_ms * (1.0 - TRIAL_GAP)
        z = self.online.z
        tried, s.tried[b] = s.tried[b], -1
        tried_p: Plan | None = None  # the best shape of the K a trial just measured
        tried_g = tok_cur[1] / cur_ms
        best, best_lb = cur, 1.0 + self.online.margin
        blind = self._blind[b]  # K = 1 at its full budget (a plain choice's probe: every request drafts)
        blind_g = 0.0
        if self.evidence < self.online.min_evidence:
            best_lb = math.inf  # too little evidence to move; probes still run
        thin = cur.k > 0 and self.evidence < PLAIN_EVIDENCE
        probe: Plan | None = None
        (s_lo, S_lo), (s_mid, S_mid), (s_hi, S_hi) = sums
        probe_g = tok_cur[2] / cur_ms  # a probe must beat the choice if acceptance is high
        probe_k = cur.k + PROBE_STEP  # K climbs a step at a time: a deep probe costs a deep step
        fac = self._fac[b]  # (below: ``_tokens`` of the chosen shapes)
        best_ms = probe_ms = cur_ms
        ut = 0.0
        cur_k, sqrt = cur.k, math.sqrt
        # plain decoding tried once against a choice of K = 1 never weighed against it: the table's
        # (a start, a change) or one a trial took from plain on its point estimate. Without it only a
        # gain past the margin by its lower bound returned to plain: MT-Bench n-gram at batch 64 kept
        # the table's K = 1 after a change, 0.985 of plain in simulation and 0.981 on an H100, where
        # plain leads by 1.2-2 %. Not as a standing close call: a plain block tests no draft, and on
        # span traffic the drafting steps after it accept less (tried at every tie, K = 1's lead of
        # 5 % on MT-Bench n-gram read 0.984). From a deeper K the way to plain is through K = 1, and
        # on PLAIN_TRY_EVIDENCE first drafts: tried from the table's K after each change, on a
        # post-change estimate of 500-800 drafts, HumanEval n-gram at batch 64 lost 0.5 % where K = 1
        # leads by 11 %. Tried again PLAIN_AGAIN windows after a try, where plain then leads by the
        # point estimate: a change fires on a run of well-accepted requests, and the try after it is
        # judged on an estimate of those same requests (MT-Bench n-gram at batch 64 over 512
        # requests then ran K = 1 for ~600 steps: 0.989 of plain in simulation, 0.996 tried again)
        try_plain = cur_k == 1 and wide and self.evidence >= PLAIN_TRY_EVIDENCE \
            and (s.try_plain[b] or s.steps - s.plain_at[b] >= PLAIN_AGAIN * self.online.window)
        again = try_plain and not s.try_plain[b]  # (tried before: again only where plain leads)
        for p, ms, q, r, k, f_p in self._loop[b]:  # _tokens inlined: this loop is the controller's host time
            if timed:  # (``_timing`` inlined: a shape not timed takes its pool's offset)
                nm = shapes.get(p)
                if nm is None:
                    ms *= f1 if k else f0
                    ut = u_none
                else:
                    f_t, ut = self._shape_timing(nm, g1 if k else g0)
                    ms *= f_t
            c, u, n_k = corr[k]
            c *= f_p
            if k and k <= probe_k and (n_k < REGIME_SHRINK or k == cur_k or not wide):
                t_hi = (b + b * S_hi[q] + r * s_hi[q + 1]) * c
                if t_hi > probe_g * ms:
                    # optimistic: best under the upper bounds (a K measured in a block of its own is
                    # not probed: one step of it inside another K's run measures neither; trials do)
                    probe, probe_g, probe_ms = p, t_hi / ms, ms
            t_mid = (b + b * S_mid[q] + r * s_mid[q + 1]) * c
            if p is blind:  # (also where it is the choice: a choice that turns plain from it)
                blind_g = t_mid / ms
            if p is cur:
                continue
            if k != cur_k and t_mid > trial_g * ms and (k or try_plain and (
                    not again or t_mid * cur_ms > tok_cur[1] * ms)) and (k and n_k < REGIME_SHRINK or t_mid * (
                    1.0 + z * sqrt(u * u + u_cur * u_cur + ut * ut + ut_cur * ut_cur)) > need * ms):
                trial, trial_g = p, t_mid / ms  # unresolved: no counts of its own, or it may still win
                # (by its tokens, or by a time not measured yet: a trial times it too)
            if k == tried and t_mid > tried_g * ms:
                tried_p, tried_g = p, t_mid / ms
            if t_mid <= need * ms or (not k and thin):
                continue  # the point estimate's gain is below the margin, so is its lower bound
                # (or plain, which would stop the evidence, on too little of it: ``PLAIN_EVIDENCE``)
            t_lo = (b + b * S_lo[q] + r * s_lo[q + 1]) * c
            t_hi = (b + b * S_hi[q] + r * s_hi[q + 1]) * c
            lb = min(t_lo / tok_cur[0], t_hi / tok_cur[2]) * cur_ms / ms
            if lb > best_lb:
                best, best_lb, best_ms = p, lb, ms
        if best == cur and tried_p is not None and trials:
            # a trial block just measured its K at least as good as the choice (point estimate): the
            # pooled bounds guard positions no shape has tested, but this K's tokens were measured
            # in a block of their own, and the choice is a prediction (a wrong move is a close call,
            # and the old choice is tried in turn)
            best = tried_p
        if best != cur:
            s.choice[b] = best
            s.trial[b] = None
            if not cur.k:  # from plain: tried back once where a trial took it on its point estimate
                s.try_plain[b] = best is tried_p
        elif trial is not None and trials and s.trial[b] is None and best_lb != math.inf \
                and (n_cur >= REGIME_SHRINK if cur.k else wide):
            # a close call of another K without counts of its own (or one whose gain they do not
            # resolve): the pooled rates may not hold at its K, so run it for a block and let its
            # own counts correct its prediction; as often as what it loses (point estimate)
            # allows, so trials cost at most TRIAL_COST * margin. Plain decoding needs no counts
            # of its own (its tokens are the batch): without trials from it, a plain choice saw a
            # close K = 1 only through single probe steps, which measure a K = 1 run's acceptance
            # low where acceptance depends on K (MT-Bench n-gram at batch 16: a1 0.08-0.12 from
            # probes, 0.15 in runs of K = 1; auto stayed plain for ~100 steps where K = 1 is best).
            # Below batch 10 not from plain: a trial there is long (130 steps at batch 1) and K = 1's
            # blind probes keep it measured (trials of K = 1 from plain at batch 1 cost MT-Bench
            # n-gram 1 % under the bench's protocol: 0.976 -> 0.966 of plain on the H100's table)
            loss = 1.0 - trial_g * cur_ms / tok_cur[1]
            steps = self._trial_steps[b]
            wait = steps * loss / (TRIAL_COST * max(self.online.margin, 1e-3)) if loss > 0.0 else 0.0
            if s.steps - s.trial_at[b] >= wait:
                s.trial[b], s.trial_left[b], s.trial_at[b] = trial, steps, s.steps
                s.trials += 1
                s.try_plain[b] = s.try_plain[b] and trial.k > 0
                if not trial.k:
                    s.plain_at[b] = s.steps
            else:  # (``_stale``: the step from which this decision would start the trial)
                s.due[b] = s.trial_at[b] + wait
        s.probe[b] = probe = probe if probe != best else None
        s.every[b] = every = self.online.probe_every
        if probe is None and not best.k and blind is not None and every:
            # plain decoding tests no draft: the estimate that chose it can only age, and traffic
            # that turned easier goes unseen (a drift run at batch 256 ran K = 0 for all its 63
            # full-load steps, 0.92 of fixed K = 1 on the H200); so K = 1 at its full budget stays
            # a probe (every request drafts: an unbiased sample of the first position, where a
            # budget that ranks requests tests the confident ones), as rarely as its loss allows:
            # probing costs BLIND_COST * margin (point estimate) while K = 1 loses <= BLIND_NEAR,
            # less beyond (a larger loss needs a larger shift to overturn), and it runs at least
            # every BLIND_WAIT probe intervals
            s.probe[b] = blind
            loss = 1.0 - blind_g * best_ms / (_tokens(sums[1], b, 0) * fac[best])
            m = self.online.margin or 1e-3
            wait = loss * max(loss, BLIND_NEAR) / (BLIND_COST * m * BLIND_NEAR)
            s.every[b] = max(1, min(BLIND_WAIT * every, math.ceil(wait)))
        elif probe is not None and every and best_lb != math.inf:  # the cadence needs min_evidence too
            # a probe costs what its point estimate loses against the choice and may find what its
            # upper bound gains over it: it runs the more often the larger that upside is against
            # the cost (a cheap probe with room above runs often, a costly or a hopeless one rarely)
            g_best = _tokens(sums[1], b, best.verify_budget) * fac[best] / best_ms
            loss = 1.0 - _tokens(sums[1], b, probe.verify_budget) * fac[probe] / probe_ms / g_best
            up = probe_g / g_best - 1.0
            if loss <= 0.0:
                s.every[b] = 1
            elif up > 0.0:  # and never so often that probing costs more than the margin
                n = max(every * loss / (loss + up), loss / self.online.margin if self.online.margin else every)
                s.every[b] = max(1, min(every, math.ceil(n)))

    # -- what the controller knows --------------------------------------------------------------

    @property
    def evidence(self) -> float:
        """Tested first-position drafts in the estimate (decayed count)."""
        return self._s.T[0] if self._s.T else 0.0

    @property
    def rates(self) -> list[float]:
        """Live estimate of the conditional acceptance per draft position [max_k] (the table's
        prior until evidence arrives): what the allocation ranks requests against."""
        return list(self._s.a)

    @property
    def rate_bounds(self) -> tuple[list[float], list[float]]:
        """Lower and upper confidence bounds of ``rates``."""
        return list(self._s.lo), list(self._s.hi)

    @property
    def drift(self) -> float:
        """Pooled drift of the live acceptance over the table's prior (1 = as tuned)."""
        return self._s.drift

    @property
    def phi(self) -> float:
        return self._s.phi

    @property
    def changes(self) -> int:
        return self._s.changes

    @property
    def probes(self) -> int:
        return self._s.probes

    @property
    def trials(self) -> int:
        """Trial blocks started (``_decide``: a close call of another K run for a block)."""
        return self._s.trials

    @property
    def clamped(self) -> int:
        return self._s.clamped

    @property
    def uncaptured(self) -> int:
        return self._s.uncaptured

    def timed_shapes(self, batch_size: int) -> dict[Plan, tuple[float, float]]:
        """Shapes timed at ``batch_size`` (``observe_time``): steps counted (at most TIME_WINDOW)
        and the measured / cost-model time ratio (the running geometric mean)."""
        return {p: (n, math.exp(m)) for p, (n, m) in self._s.lt.get(batch_size, {}).items()}

    def choice(self, batch_size: int) -> Plan:
        """The controller's current plan at ``batch_size`` (no probe, trial or decision: read only)."""
        return self._s.choice[batch_size]

    def choices(self) -> dict[int, Plan]:
        """Batch sizes whose plan the controller changed from the table's row, and the plan."""
        return {b: p for b, p in enumerate(self._s.choice) if b and p != self._table[b]}

    def draft_shapes(self, max_batch: int) -> dict[int, int]:
        """Every K > 0 a plan may draft at batch sizes 1..``max_batch``, and the largest of those
        batch sizes it may draft at: the table's rows, every shape the controller may move to,
        probe or try (batch 1's plan after a hit and a riding step's smaller K are among them),
        and past the table's rows the K of its last. An engine captures these drafter shapes
        before serving: the controller reaches K the table never runs (0.9^i at batch 16: K 7-9
        where the row's K is 4), and a (rows, K) graph captured when first planned stalls that
        step for the capture (5 such captures cost ~0.2 s of a 1 s run on an H100)."""
        out: dict[int, int] = {}
        for b in range(1, min(max_batch, self.max_batch) + 1):
            for p, _ in self._cands[b]:
                if p.k:
                    out[p.k] = b
        if max_batch > self.max_batch:  # (``_plan_outside``: the choice at the last row's batch size)
            for p, _ in self._cands[self.max_batch]:
                if p.k:
                    out[p.k] = max_batch
        return dict(sorted(out.items()))

    def snapshot_online(self) -> OnlineState:
        """A copy of the controller's state, for ``restore_online``."""
        return self._s.copy()

    def restore_online(self, state: OnlineState) -> None:
        """Take back a ``snapshot_online`` of this planner (or of one loaded from the same table): a
        state of another table would plan shapes of tiers this one never captured."""
        mine = self._owner()
        if state.owner != mine:
            def says(o: tuple[Any, ...]) -> str:
                return f"max batch {o[0]}, {len(o[1])} tiers, K <= {o[2]}" if o else "no table"
            raise ValueError(f"restore_online: the state belongs to another table ({says(state.owner)}; "
                             f"this planner's: {says(mine)})")
        self._s = state.copy()

    def _owner(self) -> tuple[int, tuple[int, ...], int]:
        return self.max_batch, tuple(self.tiers), self.k_hi

    def fresh(self) -> Planner:
        """A planner of this table with a fresh online state, as ``Planner(self.table)`` builds it,
        sharing this one's load-time lookup (built once: ~75 ms for a table of batch 256, which a
        simulation that runs a fresh planner per run or per bisection step paid each time).
        What the two share is read-only or a cache of model times (``_model_ms``, ``_outside_ms``)."""
        out = copy.copy(self)
        out._fresh_state()
        return out

    def reset_online(self) -> None:
        """Forget the live estimate and every online choice: back to the table."""
        self._s = self._fresh_state()

    def _fresh_state(self) -> OnlineState:
        self._s = OnlineState(
            choice=list(self._table), probe=list(self._first_probe),
            every=[self.online.probe_every] * (self.max_batch + 1),
            decided_at=[-self.online.decide_every] * (self.max_batch + 1), decided_v=[-1] * (self.max_batch + 1),
            A=[], T=[], Af=[], Tf=[], pa=[], pt=[], a=[], lo=[], hi=[], owner=self._owner())
        self._clear_trials()
        self._reset_estimate()
        return self._s

    def _clear_trials(self) -> None:
        s, n = self._s, self.max_batch + 1
        s.trial, s.trial_left, s.trial_at, s.tried = [None] * n, [0] * n, [-math.inf] * n, [-1] * n
        s.try_plain = [True] * n
        s.plain_at = [-math.inf] * n
        s.due = [math.inf] * n

    def _reset_estimate(self, block: tuple[list[float], list[float]] | None = None) -> None:
        """Forget the counts and the change test's sums, and estimate from the prior and ``block``
        (accepted, tested per position) alone."""
        s, n = self._s, self.k_hi
        s.A, s.T, s.Af, s.Tf, s.pa, s.pt = ([0.0] * n for _ in range(6))
        if block is not None:
            s.A, s.T, s.Af, s.Tf = list(block[0]), list(block[1]), list(block[0]), list(block[1])
        s.RA, s.RT, s.Rat = [[] for _ in range(n + 1)], [[] for _ in range(n + 1)], [0] * (n + 1)
        s.rk, s.rq, s.ra, s.rt = 0, 0, [], []
        s.rise = s.fall = 0.0
        s.block_fires = False
        # the two states' counts as of the fold before this one are kept where they show the
        # contrast (``_two_states``): it outlives a change of level (span traffic moves its level
        # from request to request, while a hit says as much as before); this fold's steps stay out
        # (where the level moved, more of the old level's steps are hits: a contrast of its own)
        s.hA, s.hT, s.mA, s.mT, s.h_at = s.h_fold
        if not s.hT or not self._two_states():
            s.hA, s.hT, s.mA, s.mT = [], [], [], []
        s.h_fold = (s.hA, s.hT, s.mA, s.mT, s.h_at)
        s.burst = None
        s.folded = s.steps
        s.pg_at = self.online.decide_every
        s.version, s.v_ref = s.version + 1, None  # (``_version``: a new estimate, decided on afresh)
        self._estimate()


def _moved(old: tuple[Any, ...], new: tuple[Any, ...], lo: list[float], hi: list[float], z: float) -> bool:
    """Whether, between two ``_version`` references (rates, corrections), a rate moved by more than
    REUSE_MOVE x its half-width (hi - lo) / 2, or a K's correction c by more than REUSE_MOVE x z x
    its standard error (c u: ``_regimes``)."""
    f = 0.5 * REUSE_MOVE
    for u, v, x, y in zip(old[0], new[0], lo, hi, strict=True):
        if abs(u - v) > f * (y - x):
            return True
    g = REUSE_MOVE * z
    return any(u is not v and abs(u[0] - v[0]) > g * v[0] * v[1] for u, v in zip(old[1], new[1], strict=True))


def _calibration(f: Sequence[float], batch: int, budget: int) -> float:
    """The tuned/modelled token ratio ``f`` [max_k + 1] at budget B over b requests: interpolated
    at B / b drafts per request."""
    q, r = divmod(budget, batch)
    if q >= len(f) - 1:
        return f[-1]
    return f[q] + (f[q + 1] - f[q]) * r / batch


def _split_budget(budget: int, batch: int, top: int) -> tuple[int, int]:
    """q, r = divmod(budget, batch), q capped at ``top`` positions (r = 0 there): ``_tokens``'s
    split, made once per candidate at load."""
    q, r = divmod(budget, batch)
    return (top, 0) if q >= top else (q, r)


def _survival_sums(rates: Sequence[float]) -> tuple[list[float], list[float]]:
    """s[j] = prod(a_1..a_j) and S[j] = s_1 + ... + s_j for j = 0..len (s[0] = 1, S[0] = 0);
    s has one more entry, 0.0, so s[q + 1] exists for every q <= len."""
    x, y = 1.0, 0.0
    s, S = [1.0], [0.0]
    s_add, S_add = s.append, S.append
    for a in rates:
        x *= a
        y += x
        s_add(x)
        S_add(y)
    s_add(0.0)
    return s, S


def _tokens(sums: tuple[list[float], list[float]], batch: int, budget: int) -> float:
    """Emitted tokens of ``batch`` like requests sharing ``budget`` drafts evenly (O(1)):
    b + b * S_q + r * s_{q+1},  q, r = divmod(budget, b)."""
    s, S = sums
    q, r = divmod(budget, batch)
    if q >= len(S) - 1:  # more budget than positions: every request gets all of them
        q, r = len(S) - 1, 0
    return batch + batch * S[q] + r * s[q + 1]


def _host_list(x: Any) -> list[float]:
    if hasattr(x, "tolist"):  # a host tensor or array (the pinned copy of the device counters)
        x = x.tolist()
    return x if type(x) is list else [float(v) for v in x]


def current_gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def check_gpu(table: Table, *, on_gpu_mismatch: OnMismatch = "warn", gpu_name: str | None = None,
              file: str | os.PathLike[str] | None = None) -> None:
    if on_gpu_mismatch == "ignore":
        return
    current = gpu_name if gpu_name is not None else current_gpu_name()
    if current is None:
        return  # no GPU to compare with (CPU simulation)
    if _same_gpu(current, table.hardware.gpu):
        return
    where = f"{file}: " if file is not None else ""
    msg = f"{where}hardware.gpu: table measured on {table.hardware.gpu!r}, this GPU is {current!r}"
    if file is not None:
        mine = _tables_of_gpu(Path(file).parent, current, table)
        msg += (f"; this GPU's table of the same workload beside it: {', '.join(mine)}" if mine else
                "; no table of this GPU for this workload beside it (`spectune profile` on this GPU, then `spectune tune`)")
    if on_gpu_mismatch == "refuse":
        raise PolicyMismatch(msg)
    warnings.warn(msg, PolicyMismatchWarning, stacklevel=3)


def _same_gpu(a: str, b: str) -> bool:
    return a.strip().lower() == b.strip().lower()


def _tables_of_gpu(folder: Path, gpu: str, table: Table) -> list[str]:
    """Policy tables in ``folder`` measured on ``gpu`` for ``table``'s workload (target, drafter,
    dtype, attention): what to load instead of a table of another GPU. Read only on a mismatch."""
    w, out = table.workload, []
    for f in sorted(folder.glob("*.policy.yaml")):
        try:
            other = read_table(f)
        except (OSError, SpectuneError):
            continue  # (a file that does not parse is not a suggestion)
        o = other.workload
        if _same_gpu(other.hardware.gpu, gpu) and other.policy is not None and \
                (o.target, o.drafter, o.dtype, o.attention) == (w.target, w.drafter, w.dtype, w.attention):
            out.append(f.name)
    return out


def load(path: str | os.PathLike[str], *, on_gpu_mismatch: OnMismatch = "warn",
         gpu_name: str | None = None) -> Planner:
    """Read and validate a policy table, check its GPU, and build the planner."""
    if on_gpu_mismatch not in ("warn", "refuse", "ignore"):
        raise ValueError(f"on_gpu_mismatch must be warn, refuse or ignore, got {on_gpu_mismatch!r}")
    table = read_table(path)
    if table.policy is None:
        raise TableError("policy", "missing: this is a cost-only profile (run `spectune tune`)", path)
    check_gpu(table, on_gpu_mismatch=on_gpu_mismatch, gpu_name=gpu_name, file=path)
    return Planner(table, file=path)
