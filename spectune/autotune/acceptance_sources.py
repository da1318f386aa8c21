"""Acceptance from what a server recorded: a vLLM Prometheus scrape, or per-step traces (JSONL).

vLLM counters (vllm/v1/spec_decode/metrics.py, labels model_name + engine from
vllm/v1/metrics/loggers.py; exposed with a ``_total`` suffix and a ``_created`` twin):

    vllm:spec_decode_num_drafts                 steps (per request) that proposed >= 1 draft   N
    vllm:spec_decode_num_draft_tokens           drafts proposed                                T
    vllm:spec_decode_num_accepted_tokens        drafts accepted                                A
    vllm:spec_decode_num_accepted_tokens_per_pos{position="0".."K-1"}   steps whose draft at
                                                that 0-based position was accepted             c_i

Fixed K (T == N * K): every step offered every position, so the survival is s_i = c_i / N exactly.
Variable K (T < N * K: a dynamic schedule ran several K): position i was offered only in the steps
with K_step > i, and vLLM does not export those counts, so c_i / N underestimates s_i (a 7/3/1
cycle reads -31 % on the mean). Offered counts are *determined* only where every draft of an
interval had one length, or the interval mixed two known Ks (#ks=K1,K2: two equations, two
unknowns). So a series of scrapes (files in time order, or a URL polled) is read as per-interval
deltas; each interval must be determined, else the source is refused with one line saying what to
feed instead (scrapes taken more often, the Ks the engine ran, or per-step traces).

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
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spectune.autotune.acceptance import (
    AcceptanceError,
    AcceptanceModel,
    Component,
    extend_conditional,
    survival_to_conditional,
)
from spectune.autotune.confidence import confidence_classes, verified_samples
from spectune.models.trace_steps import RequestSteps

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
MAX_METRICS_BYTES = 64 * 2**20  # a /metrics scrape is kilobytes; past this it is not one
MAX_LINE_CHARS = 2**20  # one trace record; a longer line is not one (e.g. /dev/zero)
MAX_POSITION = 1024  # per-position counters past this are not a draft length


# ---------------------------------------------------------------------------------------------
# vLLM Prometheus metrics


def _split_selector(spec: str) -> tuple[str, str | None]:
    # "metrics:FILE#model=NAME" -> (FILE, NAME); several files stay comma-joined
    paths, model, _ = split_spec(spec)
    return ",".join(paths), model


def _read_metrics_text(where: str) -> str:
    if where.lower().startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(where, timeout=FETCH_TIMEOUT_S) as resp:
                return _capped(resp.read(MAX_METRICS_BYTES + 1), where).decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise AcceptanceError(f"{where}: cannot fetch metrics: {reason}") from None
    try:
        with open(where, "rb") as fh:
            data = _capped(fh.read(MAX_METRICS_BYTES + 1), where)
    except OSError as exc:
        raise AcceptanceError(f"{where}: cannot read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AcceptanceError(f"{where}: not UTF-8 text (byte at offset {exc.start})") from None


def _capped(data: bytes, where: str) -> bytes:
    if len(data) > MAX_METRICS_BYTES:
        raise AcceptanceError(f"{where}: larger than {MAX_METRICS_BYTES // 2**20} MiB: not a metrics scrape")
    return data


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
                    value = float(sample.value)
                    if not (math.isfinite(value) and value >= 0):
                        raise AcceptanceError(f"{where}: {name}{_labels(sample.labels)} is {value!r}: a counter "
                                              "is a finite count >= 0")
                    rows.append((base, dict(sample.labels), value))
    except AcceptanceError:
        raise
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise AcceptanceError(f"{where}: not a Prometheus text exposition: {str(exc)[:80]}") from None
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
            if not 0 <= pos < MAX_POSITION:
                raise AcceptanceError(f"{where}: {METRIC_PER_POS} position {pos} is outside 0..{MAX_POSITION - 1}")
            per_pos[pos] = per_pos.get(pos, 0.0) + value  # sum over engines
        else:
            totals[base] = totals.get(base, 0.0) + value
    for name in (METRIC_DRAFTS, METRIC_DRAFT_TOKENS, METRIC_ACCEPTED):
        if name not in totals:
            raise AcceptanceError(f"{where}: missing counter {name}")
    k = max(per_pos) + 1 if per_pos else 0
    counters = SpecCounters(
        drafts=totals[METRIC_DRAFTS],
        draft_tokens=totals[METRIC_DRAFT_TOKENS],
        accepted=totals[METRIC_ACCEPTED],
        per_pos=tuple(per_pos.get(i, 0.0) for i in range(k)),
    )
    check_counters(counters, where)
    return counters


def check_counters(c: SpecCounters, where: str) -> None:
    """What one scrape of consistent counters satisfies: each draft step proposes >= 1 draft
    (T >= N), no more are accepted than proposed (A <= T), position i is accepted in at most the
    steps that accepted position i - 1 (c_i <= c_{i-1} <= N), and the positions add up to A."""
    slack = 1e-6 * max(1.0, c.draft_tokens)
    if c.draft_tokens + slack < c.drafts:
        raise AcceptanceError(f"{where}: {METRIC_DRAFT_TOKENS} ({c.draft_tokens:g}) is below {METRIC_DRAFTS} "
                              f"({c.drafts:g}): every draft step proposes at least one draft")
    if c.accepted > c.draft_tokens + slack:
        raise AcceptanceError(f"{where}: {METRIC_ACCEPTED} ({c.accepted:g}) exceeds {METRIC_DRAFT_TOKENS} "
                              f"({c.draft_tokens:g})")
    prev = c.drafts
    for i, ci in enumerate(c.per_pos):
        if ci > prev + slack:
            bound = METRIC_DRAFTS if i == 0 else f"position {i - 1}'s count"
            raise AcceptanceError(f"{where}: {METRIC_PER_POS}{{position=\"{i}\"}} ({ci:g}) exceeds {bound} "
                                  f"({prev:g}): a draft is accepted only after every earlier one")
        prev = ci
    if c.per_pos and abs(sum(c.per_pos) - c.accepted) > max(slack, 1e-3 * c.accepted):
        raise AcceptanceError(f"{where}: the per-position counts sum to {sum(c.per_pos):g}, "
                              f"{METRIC_ACCEPTED} is {c.accepted:g}")


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


def offered_counts(c: SpecCounters, where: str, ks: Sequence[int] | None = None) -> tuple[list[float], str]:
    """How often each position was offered in one interval, where the counters determine it.

    K = len(per_pos) (vLLM labels every position up to num_speculative_tokens). Determined when
    every draft had the same length: T == N * K, or T / N equals the largest or the smallest of
    the Ks the engine ran (``ks``: no mixture averages to an extreme), or, without ``ks``, T / N
    is an integer and no position past it accepted anything (read as one K); and when the engine
    ran two positive Ks, whose counts n_lo + n_hi = N, lo * n_lo + hi * n_hi = T solve exactly.
    Anything else raises one line saying why and what to feed instead."""
    n, t, k = c.drafts, c.draft_tokens, len(c.per_pos)
    tol = 1e-6 * max(1.0, t)
    if n <= 0:
        return [0.0] * k, "no drafts"
    if abs(t - n * k) <= tol:
        return [n] * k, f"K={k}"
    cands = sorted({int(x) for x in ks or () if 0 < int(x) <= k})
    mean = t / n
    mix: dict[int, float] | None = None
    if cands and abs(mean - cands[-1]) * n <= tol:
        mix = {cands[-1]: n}
    elif cands and abs(mean - cands[0]) * n <= tol:
        mix = {cands[0]: n}
    elif not cands and abs(mean - round(mean)) * n <= tol and round(mean) >= 1 and \
            all(ci == 0 for ci in c.per_pos[round(mean):]):
        # one K = T/N: longer drafts mixed in would have had to fail within T/N positions, every one
        mix = {round(mean): n}
    elif len(cands) == 2:
        lo, hi = cands
        n_hi = (t - n * lo) / (hi - lo)
        if -tol <= n_hi <= n + tol:
            mix = {lo: n - n_hi, hi: n_hi}
    if mix is None:
        ran = f"the Ks it ran ({', '.join(map(str, cands))})" if cands else "a single K"
        raise AcceptanceError(
            f"{where}: drafts per step averaged {mean:.2f} of at most {k}, not {ran}; vLLM does not export how often "
            "each position was offered, so the curve is not determined: scrape more often (--scrape-every) so each "
            "interval stays in one batch-size range, name the Ks the engine ran (#ks=K1,K2: exact for two), or "
            "feed per-step traces (JSONL)"
        )
    offered = [sum(cnt for kk, cnt in mix.items() if kk > i) for i in range(k)]
    for i, (ci, off) in enumerate(zip(c.per_pos, offered, strict=True)):
        if ci > off + tol:
            raise AcceptanceError(f"{where}: position {i} accepted {ci:g} times but was offered only {off:g} "
                                  f"times under Ks {sorted(mix)}: the Ks named do not match the counters")
    note = f"K={next(iter(mix))}" if len(mix) == 1 else "Ks " + "/".join(f"{kk}x{cnt:g}" for kk, cnt in sorted(mix.items()))
    return offered, note


def survival_from_counters(c: SpecCounters, where: str, *, ks: Sequence[int] | None = None) -> tuple[list[float], str]:
    """Survival s_1..s_K from one interval's counters and a note on how (see offered_counts)."""
    return survival_from_intervals([c], where, ks=ks)


def survival_from_intervals(intervals: Sequence[SpecCounters], where: str, *,
                            ks: Sequence[int] | None = None) -> tuple[list[float], str]:
    """s_i = sum of accepted_i / sum of offered_i over intervals, each interval's offered counts
    determined exactly (offered_counts) or the whole series refused."""
    if not intervals or sum(c.drafts for c in intervals) <= 0:
        raise AcceptanceError(f"{where}: {METRIC_DRAFTS} did not grow: no speculative steps were recorded")
    k = max(len(c.per_pos) for c in intervals)
    if k == 0:
        raise AcceptanceError(f"{where}: missing {METRIC_PER_POS}; per-position counts are needed")
    accepted, offered, notes = [0.0] * k, [0.0] * k, []
    for j, c in enumerate(intervals):
        label = where if len(intervals) == 1 else f"{where}: interval {j + 1} of {len(intervals)}"
        interval_offered, note = offered_counts(c, label, ks)
        notes.append(note)
        for i in range(len(c.per_pos)):
            accepted[i] += c.per_pos[i]
            offered[i] += interval_offered[i]
    survival, prev = [], 1.0
    for ci, off in zip(accepted, offered, strict=True):
        if off <= 0:
            break  # never offered: extend_conditional continues the curve
        prev = min(prev, ci / off)
        survival.append(prev)
    kinds = sorted({n for n in notes if n != "no drafts"})
    if len(intervals) == 1:
        return survival, f"{notes[0]} fixed" if notes[0].startswith("K=") else notes[0]
    return survival, f"{len(intervals)} intervals: {', '.join(kinds)}"


def counter_deltas(scrapes: Sequence[SpecCounters], where: str) -> list[SpecCounters]:
    """Per-interval increments of consecutive scrapes; a counter that went down is refused."""
    out = []
    for j in range(1, len(scrapes)):
        a, b = scrapes[j - 1], scrapes[j]
        k = max(len(a.per_pos), len(b.per_pos))
        pa = list(a.per_pos) + [0.0] * (k - len(a.per_pos))
        pb = list(b.per_pos) + [0.0] * (k - len(b.per_pos))
        d = SpecCounters(b.drafts - a.drafts, b.draft_tokens - a.draft_tokens, b.accepted - a.accepted,
                         tuple(y - x for x, y in zip(pa, pb, strict=True)))
        if min(d.drafts, d.draft_tokens, d.accepted, *d.per_pos) < 0:
            raise AcceptanceError(f"{where}: scrape {j + 1}: a counter went down since scrape {j} (server restarted?); "
                                  "feed scrapes of one server run")
        out.append(d)
    return out


def split_spec(spec: str) -> tuple[list[str], str | None, list[int] | None]:
    # "metrics:A.prom,B.prom#model=NAME&ks=7,3" -> ([A.prom, B.prom], NAME, [7, 3])
    body = spec[len("metrics:"):] if spec.lower().startswith("metrics:") else spec
    model, ks = None, None
    if "#" in body:
        body, frag = body.rsplit("#", 1)
        for part in frag.split("&"):
            if part.startswith("model="):
                model = part[len("model="):]
            elif part.startswith("ks="):
                try:
                    ks = [int(x) for x in part[len("ks="):].split(",") if x.strip()]
                except ValueError:
                    raise AcceptanceError(f"{spec}: #ks= must list integers, e.g. #ks=7,3") from None
            else:
                raise AcceptanceError(f"{spec}: unknown selector #{part} (use #model=NAME, #ks=K1,K2)")
    return [p for p in body.split(",") if p], model, ks


def metrics_model(texts: Sequence[tuple[str, str]], *, max_k: int, model: str | None = None,
                  ks: Sequence[int] | None = None) -> AcceptanceModel:
    """(where, exposition text) scrapes in time order -> acceptance. One scrape: counts since the
    server started; several: the per-interval deltas (the first scrape is the baseline)."""
    scrapes = [parse_vllm_metrics(text, where, model) for where, text in texts]
    first = texts[0][0]
    label_where = first if len(texts) == 1 else f"{first} .. {texts[-1][0]}"
    intervals = scrapes if len(scrapes) == 1 else counter_deltas(scrapes, label_where)
    survival, note = survival_from_intervals(intervals, label_where, ks=ks)
    accept = extend_conditional(survival_to_conditional(survival), max_k)
    name = Path(first).name if not first.lower().startswith("http") else first
    label = f"vllm-metrics:{name}" + (f" +{len(texts) - 1} scrapes" if len(texts) > 1 else "") + \
        (f"#model={model}" if model else "")
    drafts = sum(c.drafts for c in intervals)
    return AcceptanceModel(source=f"{label} ({int(drafts)} drafts, {note})", components=(Component(1.0, accept),),
                           max_k=max_k)


def poll_scrapes(url: str, *, every_s: float, for_s: float,
                 sleep: Callable[[float], None] = time.sleep) -> list[tuple[str, str]]:
    """Scrape ``url`` every ``every_s`` seconds for ``for_s`` seconds (at least two scrapes)."""
    if every_s <= 0 or for_s < every_s:
        raise AcceptanceError(f"{url}: need --scrape-every > 0 and --scrape-for >= --scrape-every")
    count = int(for_s // every_s) + 1
    out = []
    for j in range(count):
        if j:
            sleep(every_s)
        out.append((url, _read_metrics_text(url)))
    return out


def load_metrics(spec: str, *, max_k: int) -> AcceptanceModel:
    paths, model, ks = split_spec(spec)
    if not paths:
        raise AcceptanceError(f"{spec}: no scrape file or URL")
    return metrics_model([(p, _read_metrics_text(p)) for p in paths], max_k=max_k, model=model, ks=ks)


# ---------------------------------------------------------------------------------------------
# per-step traces


DECLINED = ("rejected", "offered")  # how a trace's declined drafts are read (``read_traces``)


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
    step_request: np.ndarray | None = None  # [S] index into ``requests``


def recorded_steps(counts: TraceCounts) -> tuple[RequestSteps, ...]:
    """Each request's recorded steps in file order (what a token replay plays)."""
    assert counts.step_request is not None and counts.step_offered is not None
    assert counts.step_accepted is not None and counts.step_conf is not None
    out = []
    for r, name in enumerate(counts.requests):
        mine = counts.step_request == r
        out.append(RequestSteps(name, counts.step_offered[mine], counts.step_accepted[mine], counts.step_conf[mine]))
    return tuple(out)


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


def read_traces(path: str, *, max_k: int, declined: str = "rejected") -> TraceCounts:
    """Count per-request trials and successes per position (module doc); errors name file:line.

    ``declined``: "rejected" (per planned draft) counts position i as a trial in every step that
    accepted the i - 1 before it, up to the set's K (the largest ``offered`` in the file), so a
    draft the drafter declined reads as the step's first rejection; "offered" (per offered draft)
    counts a position only in the steps that offered it."""
    if declined not in DECLINED:
        raise AcceptanceError(f"{path}: declined must be one of {', '.join(DECLINED)}, got {declined!r}")
    index: dict[str, int] = {}
    trials: list[np.ndarray] = []
    succ: list[np.ndarray] = []
    conf: list[float] = []
    conf_ok: list[bool] = []
    step_rows: list[tuple[int, int, list[float] | None]] = []
    step_request: list[int] = []
    steps = 0
    try:
        fh = _open_text(path)
    except OSError as exc:
        raise AcceptanceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        try:
            lines = list(_capped_lines(fh, path))
        except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile, zlib.error) as exc:
            raise AcceptanceError(f"{path}: cannot read: {str(exc)[:80]}") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AcceptanceError(f"{where}: not valid JSON ({exc.msg})") from None
        except RecursionError:
            raise AcceptanceError(f"{where}: not a trace record: nested too deeply") from None
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
        step_request.append(index[rid])
        if confs is not None:
            for j in range(min(accepted + 1, offered)):
                conf.append(float(confs[j]))
                conf_ok.append(j < accepted)
        step_rows.append((offered, accepted, confs))
        steps += 1
    if steps == 0:
        raise AcceptanceError(f"{path}: no trace records")
    set_k = max(row[0] for row in step_rows)
    for r, (offered, accepted, _) in zip(step_request, step_rows, strict=True):
        # positions 1..reached were trials: up to what the step offered, or (per planned draft)
        # up to the set's K, a declined draft being the step's first rejection
        reached = min(accepted + 1, offered if declined == "offered" else set_k, max_k)
        trials[r][:reached] += 1
        succ[r][: min(accepted, max_k)] += 1
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
        step_request=np.array(step_request, dtype=np.int64),
    )


def _capped_lines(fh, path: str):
    while True:
        line = fh.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        if len(line) > MAX_LINE_CHARS:
            raise AcceptanceError(f"{path}: a line longer than {MAX_LINE_CHARS} characters: not a trace file")
        yield line


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


Table = tuple[tuple[float, float], ...]


def position_tables(requests: Sequence[RequestSteps], k: int) -> tuple[Table | None, list[Table | None]]:
    """Calibration fitted on ``requests``' verified drafts: one table over all positions, and one
    per draft position 1..k (a position without samples falls back to the one table)."""
    conf, ok, pos = verified_samples(requests)
    table = calibrate(conf, ok)
    return table, [calibrate(conf[pos == j], ok[pos == j]) or table for j in range(1, k + 1)]

def load_traces(spec: str, *, max_k: int) -> AcceptanceModel:
    """Traces with a confidence on every offered draft: classes of steps by calibrated confidence
    (``spectune.autotune.confidence``); otherwise the per-request Bernoulli mixture. Per planned
    draft by default (a declined draft is a rejection, as the runtime counts and pays it);
    ``FILE#declined=offered`` reads the acceptance of the offered drafts alone (per-request
    mixture), for an engine that verifies only what its drafter offered."""
    path = spec[len("traces:"):] if spec.lower().startswith("traces:") else spec
    path, declined = _declined_selector(path)
    counts = read_traces(path, max_k=max_k, declined=declined)
    seen = np.nonzero(counts.trials.sum(0) > 0)[0]
    if seen.size == 0:
        raise AcceptanceError(f"{path}: no step offered any draft")
    depth = int(seen[-1]) + 1  # positions with data
    calibration = calibrate(counts.conf, counts.conf_accepted)
    n_req, note = len(counts.requests), _declined_note(counts, declined)
    if calibration is not None and declined == "rejected" and _conf_on_every_draft(counts):
        comps = _confidence_components(counts, depth, max_k, calibration)
        source = (f"traces:{Path(path).name} ({n_req} requests, {counts.steps} steps, {len(comps)} classes of "
                  f"steps by drafter confidence through a {len(calibration)}-bin calibration table{note})")
    else:
        comps = _request_components(counts, depth, max_k)
        source = f"traces:{Path(path).name} ({n_req} requests, {counts.steps} steps, {len(comps)} classes{note})"
    # per planned draft, the simulator replays the recorded steps token by token, as the bench does
    replay = recorded_steps(counts) if declined == "rejected" else None
    return AcceptanceModel(source=source, components=tuple(comps), max_k=max_k, calibration=calibration,
                           replay=replay)


def _declined_selector(path: str) -> tuple[str, str]:
    """``FILE#declined=rejected|offered`` -> (FILE, mode); no selector: per planned draft."""
    path, sep, selector = path.partition("#")
    if not sep:
        return path, "rejected"
    key, eq, value = selector.partition("=")
    if key.strip() != "declined" or not eq or value.strip() not in DECLINED:
        raise AcceptanceError(f"{path}: unknown selector {selector!r}; use #declined={' or #declined='.join(DECLINED)}")
    return path, value.strip()


def _declined_note(counts: TraceCounts, declined: str) -> str:
    """Where steps offered fewer drafts than the set's most (an n-gram or suffix drafter without a
    long enough match), a note saying how the declined drafts were read and how many there were:
    per planned draft, a declined draft is a rejection (the runtime plans the step's shape before
    the drafter offers, pays for the slot and counts it rejected: ``Engine._count_declined``);
    per offered draft, only the offered drafts count (``benchmarks/sim_declined_drafts.py``
    compares the two)."""
    offered = counts.step_offered
    if offered is None or offered.size == 0:
        return ""
    none, fewer = float(np.mean(offered == 0)), float(np.mean((offered > 0) & (offered < offered.max())))
    if none == 0.0 and fewer == 0.0:
        return ""
    how = "per planned draft, a declined one rejected" if declined == "rejected" else "per offered draft"
    return f"; {how}: {none:.0%} of steps offered none, {fewer:.0%} fewer than {int(offered.max())}"


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
