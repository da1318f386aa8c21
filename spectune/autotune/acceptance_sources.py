"""Acceptance from what a server recorded: a vLLM Prometheus scrape, or per-step traces (JSONL).

vLLM counters (vllm/v1/spec_decode/metrics.py, labels model_name + engine from
vllm/v1/metrics/loggers.py; exposed with a ``_total`` suffix and a ``_created`` twin):

    vllm:spec_decode_num_drafts                 steps (per request) that proposed >= 1 draft   N
    vllm:spec_decode_num_draft_tokens           drafts proposed                                T
    vllm:spec_decode_num_accepted_tokens        drafts accepted                                A
    vllm:spec_decode_num_accepted_tokens_per_pos{position="0".."K-1"}   steps whose draft at
                                                that 0-based position was accepted             c_i

Fixed K (T == N * K): every step offered every position, so the survival is s_i = c_i / N exactly.
Variable K (T < N * K: a policy or the drafter proposed fewer drafts in some steps): position i was
offered only in the steps with K_step >= i, so c_i / N underestimates s_i, and the ratio
c_i / c_{i-1} is biased too (it also counts the steps that stopped at i - 1). The offered counts are
not exported; we estimate them with the least-spread K distribution that has the observed mean
T / N (every step drafted floor(T/N) or ceil(T/N)), clamp them to >= c_i, take
s_i = min(s_{i-1}, c_i / offered_i) and warn (AcceptanceWarning). Exact when K was fixed, close
when few steps drafted short (drafts cut at the length limit, n-gram misses).

Traces: one JSON object per line,
    {"request": "r1", "step": 3, "offered": 5, "accepted": 2, "conf": [0.9, 0.7, 0.4, 0.3, 0.2]}
(``conf`` optional: drafter confidence per offered position; other keys are ignored). In one step,
position i is a *trial* when offered >= i and the first i - 1 drafts were accepted, a *success*
when accepted >= i. A request's counts are fitted with a mixture of per-position Bernoulli classes
by EM (1..4 classes, chosen by BIC); each class's rates get a small prior toward the pooled rates,
so requests with few steps inform but do not dominate. Calibration: P(accept | confidence bin) over
the offered positions that were reached, made monotone by pooling adjacent violators. When every
offered draft carries a ``conf``, the classes are groups of *steps* by their calibrated confidence
instead, with rates from what those steps accepted (``spectune.autotune.confidence``): a
budget ranked by the drafter's confidences is then a budget ranked by these classes.
"""

from __future__ import annotations

import gzip
import json
import math
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spectune.autotune.acceptance import (
    AcceptanceError,
    AcceptanceModel,
    AcceptanceWarning,
    Component,
    extend_conditional,
    survival_to_conditional,
)
from spectune.autotune.confidence import confidence_classes

METRIC_DRAFTS = "vllm:spec_decode_num_drafts"
METRIC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
METRIC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
METRIC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SPEC_METRICS = (METRIC_DRAFTS, METRIC_DRAFT_TOKENS, METRIC_ACCEPTED, METRIC_PER_POS)
FETCH_TIMEOUT_S = 5.0
PRIOR_STRENGTH = 2.0  # pseudo-trials pulling each class's rate toward the pooled rate
MAX_CLASSES = 4
MIN_REQUESTS_PER_CLASS = 10
CALIBRATION_BINS = 10


# ---------------------------------------------------------------------------------------------
# vLLM Prometheus metrics


def _split_selector(spec: str) -> tuple[str, str | None]:
    # "metrics:FILE#model=NAME" -> (FILE, NAME)
    body = spec[len("metrics:"):] if spec.lower().startswith("metrics:") else spec
    model = None
    if "#" in body:
        body, frag = body.rsplit("#", 1)
        if not frag.startswith("model="):
            raise AcceptanceError(f"{spec}: unknown selector #{frag} (use #model=NAME)")
        model = frag[len("model="):]
    return body, model


def _read_metrics_text(where: str) -> str:
    if where.lower().startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(where, timeout=FETCH_TIMEOUT_S) as resp:
                return resp.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise AcceptanceError(f"{where}: cannot fetch metrics: {reason}") from None
    try:
        return Path(where).read_text()
    except OSError as exc:
        raise AcceptanceError(f"{where}: cannot read: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class SpecCounters:
    drafts: float  # N
    draft_tokens: float  # T
    accepted: float  # A
    per_pos: tuple[float, ...]  # [K] c_i, 0-based position i-1


def parse_vllm_metrics(text: str, where: str, model: str | None = None) -> SpecCounters:
    """Sum vLLM's spec-decode counters over engines (one model_name) from an exposition text."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise AcceptanceError(f"{where}: reading metrics needs prometheus-client (pip install prometheus-client)") from None
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    models: set[str] = set()
    rows = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if name.endswith("_created"):
                    continue
                base = name[: -len("_total")] if name.endswith("_total") else name
                if base in SPEC_METRICS:
                    rows.append((base, dict(sample.labels), float(sample.value)))
    except ValueError as exc:
        raise AcceptanceError(f"{where}: not a Prometheus text exposition: {exc}") from None
    if not rows:
        raise AcceptanceError(
            f"{where}: no vLLM spec-decode series ({', '.join(SPEC_METRICS)}); was speculative decoding on?"
        )
    for _, labels, _ in rows:
        if "model_name" in labels:
            models.add(labels["model_name"])
    if model is None and len(models) > 1:
        raise AcceptanceError(
            f"{where}: several models ({', '.join(sorted(models))}); pick one with metrics:FILE#model=NAME"
        )
    if model is not None and model not in models:
        raise AcceptanceError(f"{where}: no series for model_name={model!r} (found: {', '.join(sorted(models)) or 'none'})")
    for base, labels, value in rows:
        if model is not None and labels.get("model_name") != model:
            continue
        if base == METRIC_PER_POS:
            try:
                pos = int(labels["position"])
            except (KeyError, ValueError):
                raise AcceptanceError(f"{where}: {METRIC_PER_POS} has a bad position label {labels.get('position')!r}") from None
            per_pos[pos] = per_pos.get(pos, 0.0) + value  # sum over engines
        else:
            totals[base] = totals.get(base, 0.0) + value
    for name in (METRIC_DRAFTS, METRIC_DRAFT_TOKENS, METRIC_ACCEPTED):
        if name not in totals:
            raise AcceptanceError(f"{where}: missing counter {name}")
    k = max(per_pos) + 1 if per_pos else 0
    return SpecCounters(
        drafts=totals[METRIC_DRAFTS],
        draft_tokens=totals[METRIC_DRAFT_TOKENS],
        accepted=totals[METRIC_ACCEPTED],
        per_pos=tuple(per_pos.get(i, 0.0) for i in range(k)),
    )


def survival_from_counters(c: SpecCounters, where: str) -> tuple[list[float], str]:
    """Survival s_1..s_K from the counters, and a note on how (module doc: fixed vs variable K)."""
    n, t = c.drafts, c.draft_tokens
    if n <= 0:
        raise AcceptanceError(f"{where}: {METRIC_DRAFTS} is 0: no speculative steps were recorded")
    k = len(c.per_pos)
    if k == 0:
        raise AcceptanceError(f"{where}: missing {METRIC_PER_POS}; per-position counts are needed")
    if abs(t - n * k) <= 1e-9 * max(1.0, t):
        return [min(1.0, ci / n) for ci in c.per_pos], f"K={k} fixed"
    mean_k = t / n
    offered = [n * min(1.0, max(0.0, mean_k - i)) for i in range(k)]  # least-spread estimate
    survival, prev = [], 1.0
    for ci, off in zip(c.per_pos, offered, strict=True):
        off = max(off, ci)
        s = min(prev, ci / off) if off > 0 else 0.0
        survival.append(s)
        prev = s
    note = f"variable K: mean {mean_k:.2f} of {k}, offered counts estimated"
    warnings.warn(
        f"{where}: drafts per step varied (mean {mean_k:.2f} of max {k}); vLLM does not export how often "
        "each position was offered, so those counts were estimated (see spectune.autotune.acceptance_sources)",
        AcceptanceWarning,
        stacklevel=3,
    )
    return survival, note


def load_metrics(spec: str, *, max_k: int) -> AcceptanceModel:
    where, model = _split_selector(spec)
    counters = parse_vllm_metrics(_read_metrics_text(where), where, model)
    survival, note = survival_from_counters(counters, where)
    accept = extend_conditional(survival_to_conditional(survival), max_k)
    name = Path(where).name if not where.lower().startswith("http") else where
    label = f"vllm-metrics:{name}" + (f"#model={model}" if model else "")
    source = f"{label} ({int(counters.drafts)} drafts, {note})"
    return AcceptanceModel(source=source, components=(Component(1.0, accept),), max_k=max_k)


# ---------------------------------------------------------------------------------------------
# per-step traces


@dataclass(frozen=True)
class TraceCounts:
    requests: tuple[str, ...]  # [R]
    trials: np.ndarray  # [R, P] steps in which position i was offered with all earlier accepted
    successes: np.ndarray  # [R, P] of those, steps that accepted position i
    conf: np.ndarray  # [M] drafter confidence of reached offered positions
    conf_accepted: np.ndarray  # [M] bool, was that position accepted
    steps: int
    step_offered: np.ndarray | None = None  # [S] per step, in file order
    step_accepted: np.ndarray | None = None  # [S]
    step_conf: np.ndarray | None = None  # [S, max_k] raw conf, NaN where not offered or absent


def _field_int(obj: dict, key: str, where: str, lo: int = 0) -> int:
    if key not in obj:
        raise AcceptanceError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise AcceptanceError(f"{where}: field {key!r} must be an integer, got {v!r}")
    if v < lo:
        raise AcceptanceError(f"{where}: field {key!r} must be >= {lo}, got {v}")
    return v


def _open_text(path: str):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_traces(path: str, *, max_k: int) -> TraceCounts:
    """Count per-request trials and successes per position (module doc); errors name file:line."""
    index: dict[str, int] = {}
    trials: list[np.ndarray] = []
    succ: list[np.ndarray] = []
    conf: list[float] = []
    conf_ok: list[bool] = []
    step_rows: list[tuple[int, int, list[float] | None]] = []
    steps = 0
    try:
        fh = _open_text(path)
    except OSError as exc:
        raise AcceptanceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        try:
            lines = list(fh)
        except (OSError, EOFError, UnicodeDecodeError) as exc:
            raise AcceptanceError(f"{path}: cannot read: {exc}") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AcceptanceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise AcceptanceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if "request" not in obj:
            raise AcceptanceError(f"{where}: missing field 'request'")
        if not isinstance(obj["request"], str | int) or isinstance(obj["request"], bool):
            raise AcceptanceError(f"{where}: field 'request' must be a string or integer")
        _field_int(obj, "step", where)
        offered = _field_int(obj, "offered", where)
        accepted = _field_int(obj, "accepted", where)
        if accepted > offered:
            raise AcceptanceError(f"{where}: field 'accepted' ({accepted}) exceeds 'offered' ({offered})")
        confs = obj.get("conf")
        if confs is not None:
            if not isinstance(confs, list) or len(confs) != offered:
                raise AcceptanceError(f"{where}: field 'conf' must be a list of {offered} numbers (one per offered draft)")
            for j, c in enumerate(confs):
                if isinstance(c, bool) or not isinstance(c, int | float) or not 0.0 <= c <= 1.0:
                    raise AcceptanceError(f"{where}: field 'conf'[{j}] must be a number in [0, 1], got {c!r}")
        rid = str(obj["request"])
        if rid not in index:
            index[rid] = len(index)
            trials.append(np.zeros(max_k))
            succ.append(np.zeros(max_k))
        r = index[rid]
        reached = min(accepted + 1, offered, max_k)  # positions 1..reached were trials
        trials[r][:reached] += 1
        succ[r][: min(accepted, max_k)] += 1
        if confs is not None:
            for j in range(min(accepted + 1, offered)):
                conf.append(float(confs[j]))
                conf_ok.append(j < accepted)
        step_rows.append((offered, accepted, confs))
        steps += 1
    if steps == 0:
        raise AcceptanceError(f"{path}: no trace records")
    step_conf = np.full((steps, max_k), np.nan)
    for s, (offered, _, confs) in enumerate(step_rows):
        if confs is not None:
            n = min(offered, max_k)
            step_conf[s, :n] = np.asarray(confs[:n], dtype=float)
    return TraceCounts(
        requests=tuple(index),
        trials=np.array(trials),
        successes=np.array(succ),
        conf=np.array(conf),
        conf_accepted=np.array(conf_ok, dtype=bool),
        steps=steps,
        step_offered=np.array([r[0] for r in step_rows], dtype=np.int64),
        step_accepted=np.array([r[1] for r in step_rows], dtype=np.int64),
        step_conf=step_conf,
    )


@dataclass(frozen=True)
class MixtureFit:
    weights: np.ndarray  # [C]
    rates: np.ndarray  # [C, P] conditional acceptance per class
    loglik: float
    bic: float


def _loglik_matrix(s: np.ndarray, f: np.ndarray, rates: np.ndarray) -> np.ndarray:
    # [R, C]: sum_i s_ri log a_ci + f_ri log(1 - a_ci)
    a = np.clip(rates, 1e-6, 1 - 1e-6)
    return s @ np.log(a).T + f @ np.log1p(-a).T


def fit_bernoulli_mixture(
    trials: np.ndarray, successes: np.ndarray, n_classes: int, *, iters: int = 200, tol: float = 1e-7
) -> MixtureFit:
    """EM for a mixture of per-position Bernoulli classes over requests (trials/successes [R, P])."""
    s, f = successes, trials - successes
    n_req = s.shape[0]
    pooled = (s.sum(0) + 0.5) / (trials.sum(0) + 1.0)  # [P]
    # start: classes = quantile groups of the requests' overall acceptance
    score = (s.sum(1) + PRIOR_STRENGTH * pooled.mean()) / (trials.sum(1) + PRIOR_STRENGTH)
    order = np.argsort(-score, kind="stable")
    resp = np.zeros((n_req, n_classes))
    for c, group in enumerate(np.array_split(order, n_classes)):
        resp[group, c] = 1.0
    prev = -math.inf
    for _ in range(iters):
        nk = resp.sum(0) + 1e-12
        weights = nk / n_req
        rates = (resp.T @ s + PRIOR_STRENGTH * pooled) / (resp.T @ trials + PRIOR_STRENGTH)  # [C, P]
        log_joint = _loglik_matrix(s, f, rates) + np.log(weights)
        top = log_joint.max(1, keepdims=True)
        norm = top[:, 0] + np.log(np.exp(log_joint - top).sum(1))
        resp = np.exp(log_joint - norm[:, None])
        loglik = float(norm.sum())
        if loglik - prev < tol * abs(loglik):
            break
        prev = loglik
    n_params = n_classes * s.shape[1] + n_classes - 1
    return MixtureFit(weights=weights, rates=rates, loglik=loglik, bic=-2 * loglik + n_params * math.log(n_req))


def fit_mixture(trials: np.ndarray, successes: np.ndarray) -> MixtureFit:
    """The BIC-best mixture of 1..MAX_CLASSES classes (a class needs ~MIN_REQUESTS_PER_CLASS requests)."""
    most = max(1, min(MAX_CLASSES, trials.shape[0] // MIN_REQUESTS_PER_CLASS))
    fits = [fit_bernoulli_mixture(trials, successes, c) for c in range(1, most + 1)]
    return min(fits, key=lambda fit: fit.bic)


def calibrate(conf: np.ndarray, accepted: np.ndarray, bins: int = CALIBRATION_BINS) -> tuple[tuple[float, float], ...] | None:
    """(bin upper edge, P(accept | confidence in bin)) over equal-width bins, made non-decreasing."""
    if conf.size == 0:
        return None
    idx = np.minimum((conf * bins).astype(int), bins - 1)
    count = np.bincount(idx, minlength=bins).astype(float)
    hits = np.bincount(idx, weights=accepted.astype(float), minlength=bins)
    blocks = [[hits[b] / count[b], count[b], [b]] for b in range(bins) if count[b] > 0]
    merged: list[list] = []  # pool adjacent violators: [rate, weight, bins]
    for block in blocks:
        merged.append(block)
        while len(merged) > 1 and merged[-2][0] > merged[-1][0]:
            r2, w2, b2 = merged.pop()
            r1, w1, b1 = merged.pop()
            merged.append([(r1 * w1 + r2 * w2) / (w1 + w2), w1 + w2, b1 + b2])
    return tuple(((b + 1) / bins, float(rate)) for rate, _, members in merged for b in members)


def load_traces(spec: str, *, max_k: int) -> AcceptanceModel:
    """Traces with a confidence on every offered draft: classes of steps by calibrated confidence
    (``spectune.autotune.confidence``); otherwise the per-request Bernoulli mixture."""
    path = spec[len("traces:"):] if spec.lower().startswith("traces:") else spec
    counts = read_traces(path, max_k=max_k)
    seen = np.nonzero(counts.trials.sum(0) > 0)[0]
    if seen.size == 0:
        raise AcceptanceError(f"{path}: no step offered any draft")
    depth = int(seen[-1]) + 1  # positions with data
    calibration = calibrate(counts.conf, counts.conf_accepted)
    n_req = len(counts.requests)
    if calibration is not None and _conf_on_every_draft(counts):
        comps = _confidence_components(counts, depth, max_k, calibration)
        source = (f"traces:{Path(path).name} ({n_req} requests, {counts.steps} steps, {len(comps)} classes of "
                  f"steps by drafter confidence through a {len(calibration)}-bin calibration table)")
    else:
        comps = _request_components(counts, depth, max_k)
        source = f"traces:{Path(path).name} ({n_req} requests, {counts.steps} steps, {len(comps)} classes)"
    return AcceptanceModel(source=source, components=tuple(comps), max_k=max_k, calibration=calibration)


def _conf_on_every_draft(counts: TraceCounts) -> bool:
    assert counts.step_offered is not None and counts.step_conf is not None
    cols = np.arange(counts.step_conf.shape[1])[None, :]
    offered = cols < counts.step_offered[:, None]
    return bool(offered.any()) and not bool(np.isnan(counts.step_conf[offered]).any())


def _confidence_components(counts: TraceCounts, depth: int, max_k: int,
                           calibration: tuple[tuple[float, float], ...]) -> list[Component]:
    assert counts.step_offered is not None and counts.step_accepted is not None and counts.step_conf is not None
    weights, survival = confidence_classes(counts.step_offered, counts.step_accepted, counts.step_conf,
                                           depth, calibration)
    comps = [Component(float(w), extend_conditional(survival_to_conditional(list(s)), max_k))
             for w, s in zip(weights, survival, strict=True)]
    comps.sort(key=lambda c: -sum(c.survival(max_k)))  # easiest class first
    return comps


def _request_components(counts: TraceCounts, depth: int, max_k: int) -> list[Component]:
    fit = fit_mixture(counts.trials[:, :depth], counts.successes[:, :depth])
    comps = [
        Component(float(w), extend_conditional([float(a) for a in rates], max_k))
        for w, rates in zip(fit.weights, fit.rates, strict=True)
    ]
    total = sum(c.weight for c in comps)
    comps = [Component(c.weight / total, c.accept) for c in comps]
    comps.sort(key=lambda c: -sum(c.survival(max_k)))  # easiest class first
    return comps
