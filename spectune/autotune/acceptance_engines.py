"""Acceptance from SGLang's and TensorRT-LLM's own metrics: mean accepted drafts per K, differenced.

Neither engine exports per-position counts; both export how many drafts were accepted per request
and step, at a draft length K they also name:

    TensorRT-LLM  iteration stats (trtllm-serve GET /metrics, LLM.get_stats(); enable_iter_perf_stats),
                  one JSON object per iteration = one step: specDecodingStats {numDraftTokens T,
                  numAcceptedTokens A, numRequestsWithDraftTokens N} summed over the requests that drafted
                  (tensorrt_llm/_torch/pyexecutor/py_executor.py, _update_iter_stats; field names from
                  cpp/include/tensorrt_llm/executor/types.h SpecDecodingStats). K = T / N.
    SGLang        Prometheus gauges of the last decode-log window (--decode-log-interval batches, 40 by
                  default; sglang/srt/managers/scheduler_components/metrics_reporter.py):
                  sglang:spec_accept_length L (accepted drafts + the bonus token per request-step) and
                  sglang:spec_num_steps K (the active number of steps; --enable-metrics), with
                  sglang:spec_num_draft_tokens = K + 1 for a chain (topk 1).

With a chain drafter the first i drafts survive with probability s_i whatever K is, so one K gives
E_K = s_1 + ... + s_K (mean accepted drafts per request-step) and

    s_K = E_K - E_(K-1),   E_0 = 0

is determined for every K up to the largest seen when every K from 1 to it was seen (a schedule that
ran each length at some batch size); the curve past it is continued as for vLLM. Noise in the
differences is clipped into [0, s_(K-1)]. Anything else is refused with one line: a single K (only
the mean is known), a missing K, an iteration whose drafts had mixed lengths (T not a multiple of N),
or tree drafts (topk > 1). An SGLang window is read at the K both scrapes around it show (one that
changed between them is left out and counted); a switch to another tier and back inside one window
would go unseen, which cannot happen on a server without --speculative-adaptive.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spectune.autotune.acceptance import (
    AcceptanceError,
    AcceptanceModel,
    Component,
    extend_conditional,
    survival_to_conditional,
)
from spectune.autotune.acceptance_sources import _read_metrics_text

TRTLLM_PREFIX = "trtllm-stats:"
SGLANG_PREFIX = "sglang-metrics:"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_NUM_STEPS = "sglang:spec_num_steps"
SGLANG_DRAFT_TOKENS = "sglang:spec_num_draft_tokens"
MAX_K = 1024  # a draft length past this is not one


@dataclass
class AcceptedByK:
    """Accepted drafts and request-steps (or windows) per draft length K."""

    accepted: dict[int, float] = field(default_factory=dict)
    weight: dict[int, float] = field(default_factory=dict)

    def add(self, k: int, accepted: float, weight: float) -> None:
        self.accepted[k] = self.accepted.get(k, 0.0) + accepted
        self.weight[k] = self.weight.get(k, 0.0) + weight


def survival_from_k_means(by_k: AcceptedByK, where: str, *, feed: str) -> list[float]:
    """s_1..s_Kmax from E_K = accepted / weight per K (module doc); refused unless every K from 1 to
    the largest seen was seen. ``feed``: what to run instead, for the refusal."""
    ks = sorted(k for k, w in by_k.weight.items() if w > 0)
    if not ks:
        raise AcceptanceError(f"{where}: no speculative steps recorded (no drafts)")
    missing = [k for k in range(1, ks[-1] + 1) if k not in ks]
    if missing:
        seen = ", ".join(f"K={k}: {by_k.accepted[k] / by_k.weight[k]:.2f}" for k in ks)
        raise AcceptanceError(
            f"{where}: mean accepted drafts per step known only at {seen}; the engine does not export per-position "
            f"counts, so the curve needs every K from 1 to {ks[-1]} (missing {_ranges(missing)}): {feed}, or feed "
            "per-step traces (JSONL)"
        )
    survival, prev_e, prev_s = [], 0.0, 1.0
    for k in ks:
        e = by_k.accepted[k] / by_k.weight[k]
        if e > k + 1e-9:
            raise AcceptanceError(
                f"{where}: {e:.3f} accepted drafts per step at K={k}: more than K"
            )
        prev_s = min(prev_s, max(0.0, e - prev_e))
        survival.append(prev_s)
        prev_e = e
    return survival


def _ranges(ks: Sequence[int]) -> str:
    # [1, 2, 3, 5] -> "1-3, 5"
    out, start = [], ks[0]
    for i, a in enumerate(ks):
        if i + 1 == len(ks) or ks[i + 1] != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            if i + 1 < len(ks):
                start = ks[i + 1]
    return ", ".join(out)


def _model(survival: list[float], *, max_k: int, source: str) -> AcceptanceModel:
    accept = extend_conditional(survival_to_conditional(survival), max_k)
    return AcceptanceModel(source=source, components=(Component(1.0, accept),), max_k=max_k)


def _paths(spec: str, prefix: str) -> list[str]:
    body = spec[len(prefix) :] if spec.lower().startswith(prefix) else spec
    paths = [p for p in body.split(",") if p.strip()]
    if not paths:
        raise AcceptanceError(f"{spec}: no file or URL")
    return paths


def _name(paths: Sequence[str]) -> str:
    first = paths[0] if paths[0].lower().startswith("http") else Path(paths[0]).name
    return first + (f" +{len(paths) - 1} files" if len(paths) > 1 else "")


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM iteration stats


def _count(obj: dict, key: str, where: str) -> int:
    v = obj.get(key)
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or not math.isfinite(v)
        or v < 0
        or v != int(v)
    ):
        raise AcceptanceError(f"{where}: specDecodingStats.{key} must be a count >= 0, got {v!r}")
    return int(v)


def trtllm_iterations(text: str, where: str) -> list[tuple[str, dict]]:
    """The iteration-stats objects of one /metrics response (a JSON list) or of a JSONL file of them
    (one object, or one response list, per line), each with where it came from."""
    try:
        docs = [json.loads(text)]
        lines = False
    except json.JSONDecodeError:
        docs, lines = [], True
        for i, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise AcceptanceError(f"{where}:{i}: not JSON ({exc.msg})") from None
    out: list[tuple[str, dict]] = []
    for j, doc in enumerate(docs, start=1):
        at = f"{where}:{j}" if lines else where
        items = doc if isinstance(doc, list) else [doc]
        for it in items:
            if isinstance(it, str):  # some clients keep each stat as its JSON string
                try:
                    it = json.loads(it)
                except json.JSONDecodeError:
                    raise AcceptanceError(
                        f"{at}: an iteration entry is a string that is not JSON"
                    ) from None
            if not isinstance(it, dict):
                raise AcceptanceError(
                    f"{at}: expected TensorRT-LLM iteration stats (JSON objects), got {type(it).__name__}"
                )
            out.append((f"{at}: iteration {it.get('iter', len(out))}", it))
    return out


def trtllm_accepted_by_k(iterations: Sequence[tuple[str, dict]], where: str) -> AcceptedByK:
    by_k, seen = AcceptedByK(), False
    for at, it in iterations:
        spec = it.get("specDecodingStats")
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise AcceptanceError(f"{at}: specDecodingStats must be an object")
        seen = True
        t = _count(spec, "numDraftTokens", at)
        a = _count(spec, "numAcceptedTokens", at)
        n = _count(spec, "numRequestsWithDraftTokens", at)
        if t == 0:
            continue
        if n == 0 or a > t:
            raise AcceptanceError(
                f"{at}: {t} draft tokens, {a} accepted over {n} requests: inconsistent counts"
            )
        k, rest = divmod(t, n)
        if rest:
            raise AcceptanceError(
                f"{at}: {t} draft tokens over {n} requests: draft lengths differed within the iteration, so which "
                "positions were offered is not determined; feed per-step traces (JSONL)"
            )
        if k > MAX_K or a > n * k:
            raise AcceptanceError(
                f"{at}: draft length {k} with {a} accepted over {n} requests: not a draft length"
            )
        by_k.add(k, a, n)
    if not seen:
        raise AcceptanceError(
            f"{where}: no specDecodingStats in the iteration stats: was speculative decoding on, "
            "with enable_iter_perf_stats?"
        )
    return by_k


def load_trtllm(spec: str, *, max_k: int) -> AcceptanceModel:
    paths = _paths(spec, TRTLLM_PREFIX)
    iterations = [it for p in paths for it in trtllm_iterations(_read_metrics_text(p), p)]
    where = paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"
    by_k = trtllm_accepted_by_k(iterations, where)
    survival = survival_from_k_means(
        by_k,
        where,
        feed="run a draft_len_schedule whose lengths cover them at the batch sizes served",
    )
    steps = int(sum(by_k.weight.values()))
    ks = "/".join(map(str, sorted(by_k.weight)))
    return _model(
        survival,
        max_k=max_k,
        source=f"trtllm-stats:{_name(paths)} ({steps} request-steps at K {ks})",
    )


# ---------------------------------------------------------------------------------------------
# SGLang Prometheus gauges


def sglang_windows(text: str, where: str) -> dict[tuple, tuple[float, int]]:
    """{label set: (accept length L, steps K)} of one scrape."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise AcceptanceError(
            f"{where}: reading metrics needs prometheus-client (pip install prometheus-client)"
        ) from None
    values: dict[str, dict[tuple, float]] = {
        SGLANG_ACCEPT_LENGTH: {},
        SGLANG_NUM_STEPS: {},
        SGLANG_DRAFT_TOKENS: {},
    }
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in values:
                    v = float(sample.value)
                    if not math.isfinite(v) or v < 0:
                        raise AcceptanceError(f"{where}: {sample.name} is {v!r}")
                    values[sample.name][tuple(sorted(sample.labels.items()))] = v
    except AcceptanceError:
        raise
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise AcceptanceError(
            f"{where}: not a Prometheus text exposition: {str(exc)[:80]}"
        ) from None
    if not values[SGLANG_ACCEPT_LENGTH]:
        raise AcceptanceError(
            f"{where}: no {SGLANG_ACCEPT_LENGTH}: was speculative decoding on, with --enable-metrics?"
        )
    out = {}
    for labels, length in values[SGLANG_ACCEPT_LENGTH].items():
        steps = values[SGLANG_NUM_STEPS].get(labels, 0.0)
        if steps < 1 or steps != int(steps) or steps > MAX_K:
            raise AcceptanceError(
                f"{where}: {SGLANG_NUM_STEPS} is {steps:g} beside {SGLANG_ACCEPT_LENGTH}: the K of the "
                "window is not known (SGLang sets it when --enable-metrics is on)"
            )
        tokens = values[SGLANG_DRAFT_TOKENS].get(labels)
        if tokens is not None and tokens != steps + 1:
            raise AcceptanceError(
                f"{where}: {SGLANG_DRAFT_TOKENS} {tokens:g} is not {SGLANG_NUM_STEPS} + 1: tree drafts "
                "(topk > 1), not a chain"
            )
        if length and not 1.0 <= length <= steps + 1 + 1e-9:
            raise AcceptanceError(
                f"{where}: {SGLANG_ACCEPT_LENGTH} {length:g} outside 1..{steps + 1:g}"
            )
        out[labels] = (length, int(steps))
    return out


def sglang_accepted_by_k(scrapes: Sequence[tuple[str, str]], where: str) -> tuple[AcceptedByK, int]:
    """Each new window (the gauges changed since the scrape before) whose K is the same at both ends
    counts once at that K (windows weigh equally: the gauges carry no step counts); a window whose
    ends show different Ks may have run either and is left out. Returns the windows left out too."""
    series = [(w, sglang_windows(text, w)) for w, text in scrapes]
    if len(series) < 2:
        raise AcceptanceError(
            f"{where}: one scrape: the K of its window is not known; feed a series of scrapes "
            "(time order), taken more often than the decode-log interval"
        )
    by_k, left_out = AcceptedByK(), 0
    for (_, before), (_, after) in zip(series, series[1:], strict=False):
        for labels, (length, k) in after.items():
            prev = before.get(labels)
            if prev is None or prev == (length, k) or length == 0:
                continue  # the same window scraped again, or no decode batch yet
            if prev[1] != k:
                left_out += 1
                continue
            by_k.add(k, length - 1.0, 1.0)
    return by_k, left_out


def load_sglang(spec: str, *, max_k: int) -> AcceptanceModel:
    paths = _paths(spec, SGLANG_PREFIX)
    where = paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"
    by_k, left_out = sglang_accepted_by_k([(p, _read_metrics_text(p)) for p in paths], where)
    survival = survival_from_k_means(
        by_k,
        where,
        feed="serve with adaptive tiers (or runs at fixed --speculative-num-steps) that cover them, "
        "scraped more often than --decode-log-interval",
    )
    windows = int(sum(by_k.weight.values()))
    ks = "/".join(map(str, sorted(by_k.weight)))
    note = f", {left_out} left out: K changed" if left_out else ""
    return _model(
        survival,
        max_k=max_k,
        source=f"sglang-metrics:{_name(paths)} ({windows} windows at K {ks}{note})",
    )
