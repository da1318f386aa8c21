"""Policy rows -> the engines' own batch-size schedules (vLLM, SGLang, TensorRT-LLM) and back.

Engines only see K per batch-size range (the verify budget and tiers are spectune's own), so a
policy becomes a *schedule*: inclusive ``(lo, hi, k)`` ranges covering 1..max_batch, adjacent
ranges with the same K merged. Each format has ``export_<fmt>(schedule) -> dict``,
``validate_<fmt>(config)`` re-implementing the engine's parser rules (plus ours: contiguous from 1,
K <= the maximum), and ``import_<fmt>(config) -> schedule``. docs/EXPORTS.md lists the engine files
these rules were checked against.

    vLLM          speculative_config {"num_speculative_tokens": maxK,
                  "num_speculative_tokens_per_batch_size": [[lo, hi, K], ...]}   (JSON)
    SGLang        --speculative-adaptive-config file {"1": {"candidate_steps": [K]}, "17": ...}
                  keys are batch-size lower bounds                               (JSON)
    TensorRT-LLM  speculative_config {max_draft_len: maxK, draft_len_schedule: {hi: K, ...}}
                  keys are batch-size upper bounds; past the last key K = 0      (YAML)
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import yaml

from spectune.errors import SpectuneError
from spectune.runtime.table import Table

FORMATS = ("vllm", "sglang", "trtllm")
VLLM_KEY = "num_speculative_tokens_per_batch_size"
SGLANG_STRATEGIES = ("ema", "throughput_aware")

Range = tuple[int, int, int]  # (lo, hi, k), inclusive batch sizes


class ExportError(SpectuneError):
    """A policy cannot be expressed in, or a config breaks the rules of, an engine's format."""


# ---------------------------------------------------------------------------------------------
# schedule


def schedule_from_rows(rows: Sequence[Any]) -> list[Range]:
    """Policy rows (``batch=[lo, hi]``, ``k``) -> merged contiguous schedule."""
    out: list[Range] = []
    for row in rows:
        lo, hi = row.batch
        if out and out[-1][2] == row.k and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi, row.k)
        else:
            out.append((lo, hi, row.k))
    check_schedule(out, "policy.rows")
    return out


def schedule_from_table(table: Table, file: str = "policy") -> list[Range]:
    if table.policy is None:
        raise ExportError(f"{file}: has no policy section (a cost-only profile); run `spectune tune` first")
    return schedule_from_rows(table.policy.rows)


def check_schedule(schedule: Sequence[Range], where: str) -> None:
    """Our rules, common to every format: ranges from 1, ascending, no gap or overlap, K >= 0."""
    if not schedule:
        raise ExportError(f"{where}: empty schedule")
    expect = 1
    for i, (lo, hi, k) in enumerate(schedule):
        for name, v in (("lo", lo), ("hi", hi), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ExportError(f"{where}[{i}]: {name} must be an integer, got {v!r}")
        if not 1 <= lo <= hi:
            raise ExportError(f"{where}[{i}]: range [{lo}, {hi}] must have 1 <= lo <= hi")
        if lo != expect:
            what = "gap" if lo > expect else "overlap"
            raise ExportError(f"{where}[{i}]: {what}: range starts at {lo}, expected {expect}")
        if k < 0:
            raise ExportError(f"{where}[{i}]: K must be >= 0, got {k}")
        expect = hi + 1
    if max(k for _, _, k in schedule) == 0:
        raise ExportError(f"{where}: K is 0 everywhere; run the engine without speculative decoding")


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExportError(f"{where}: must be an integer, got {value!r}")
    return value


def _max_k(cfg: dict[str, Any], key: str, where: str) -> int:
    # the engine's required largest draft length, a positive integer
    if key not in cfg:
        raise ExportError(f"{where}: missing")
    max_k = _int(cfg[key], where)
    if max_k <= 0:
        raise ExportError(f"{where}: must be > 0, got {max_k}")
    return max_k


# ---------------------------------------------------------------------------------------------
# vLLM


def export_vllm(schedule: Sequence[Range], *, method: str | None = None, model: str | None = None) -> dict[str, Any]:
    check_schedule(schedule, "schedule")
    cfg: dict[str, Any] = {}
    if method is not None:
        cfg["method"] = method
    if model is not None:
        cfg["model"] = model
    cfg["num_speculative_tokens"] = max(k for _, _, k in schedule)  # buffer sizing: the largest K
    cfg[VLLM_KEY] = [[lo, hi, k] for lo, hi, k in schedule]
    validate_vllm(cfg)
    return cfg


def validate_vllm(cfg: Any) -> None:
    """vLLM's rules (validate_and_normalize_dynamic_sd_schedule) plus contiguity and K <= max."""
    if not isinstance(cfg, dict):
        raise ExportError("vllm: speculative_config must be a JSON object")
    max_k = _max_k(cfg, "num_speculative_tokens", "vllm: num_speculative_tokens")
    entries = cfg.get(VLLM_KEY)
    if not isinstance(entries, list) or not entries:
        raise ExportError(f"vllm: {VLLM_KEY}: must be a non-empty list of [lo, hi, K]")
    prev_hi = 0
    for i, entry in enumerate(entries):
        where = f"vllm: {VLLM_KEY}[{i}]"
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ExportError(f"{where}: must be a 3-item [lo, hi, K], got {entry!r}")
        lo, hi, k = (_int(v, where) for v in entry)
        if lo <= 0 or hi <= 0:
            raise ExportError(f"{where}: batch-size range ({lo}, {hi}) must be positive")
        if lo > hi:
            raise ExportError(f"{where}: range start {lo} > end {hi}")
        if k < 0:
            raise ExportError(f"{where}: K must be >= 0, got {k}")
        if k > max_k:
            raise ExportError(f"{where}: K={k} exceeds num_speculative_tokens={max_k} (vLLM would clamp it)")
        if i == 0 and lo != 1:
            raise ExportError(f"{where}: the first range must start at 1, got {lo}")
        if lo <= prev_hi:
            raise ExportError(f"{where}: ranges must be sorted and non-overlapping ({lo} <= previous end {prev_hi})")
        if lo != prev_hi + 1:
            raise ExportError(f"{where}: gap: starts at {lo}, expected {prev_hi + 1}")
        prev_hi = hi


def import_vllm(cfg: Any) -> list[Range]:
    validate_vllm(cfg)
    return [(int(lo), int(hi), int(k)) for lo, hi, k in cfg[VLLM_KEY]]


# ---------------------------------------------------------------------------------------------
# SGLang (--speculative-adaptive --speculative-adaptive-config FILE)


def export_sglang(schedule: Sequence[Range]) -> dict[str, Any]:
    # one slot per range, keyed by its lower bound; a single candidate pins K for that range
    check_schedule(schedule, "schedule")
    cfg: dict[str, Any] = {"strategy": "ema"}
    for lo, _, k in schedule:
        cfg[str(lo)] = {"candidate_steps": [k]}
    validate_sglang(cfg)
    return cfg


def validate_sglang(cfg: Any) -> None:
    """SGLang's rules (_load_adaptive_config, resolve_adaptive_strategy) plus a slot at batch 1."""
    if not isinstance(cfg, dict):
        raise ExportError("sglang: adaptive config must be a JSON object")
    strategy = cfg.get("strategy", "ema")
    if strategy not in SGLANG_STRATEGIES:
        raise ExportError(f"sglang: strategy: must be 'ema' or 'throughput_aware', got {strategy!r}")
    keys = []
    for key, entry in cfg.items():
        if not isinstance(key, str) or not key.isdigit():
            continue  # shared knobs (strategy, ema_alpha, ...) merged into every slot
        if not isinstance(entry, dict):
            raise ExportError(f"sglang: {key}: must be an object with candidate_steps")
        steps = entry.get("candidate_steps")
        if (
            not isinstance(steps, list)
            or not steps
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps)
        ):
            raise ExportError(f"sglang: {key}.candidate_steps: must be a non-empty list of non-negative ints, got {steps!r}")
        keys.append(int(key))
    if not keys:
        raise ExportError('sglang: needs at least one integer-string batch-size key, e.g. {"1": {"candidate_steps": [3]}}')
    if min(keys) != 1:
        raise ExportError(f"sglang: the smallest batch-size key must be 1, got {min(keys)}")


def import_sglang(cfg: Any, *, max_batch: int) -> list[Range]:
    """Slots -> ranges [key, next key - 1]; the last slot runs to ``max_batch``. A slot with
    several candidates (the engine adapts among them) imports as its largest candidate."""
    validate_sglang(cfg)
    slots = sorted((int(key), max(entry["candidate_steps"])) for key, entry in cfg.items() if key.isdigit())
    if slots[-1][0] > max_batch:
        raise ExportError(f"sglang: slot {slots[-1][0]} starts past max_batch={max_batch}")
    out = []
    for i, (lo, k) in enumerate(slots):
        hi = slots[i + 1][0] - 1 if i + 1 < len(slots) else max_batch
        out.append((lo, hi, k))
    return out


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM (speculative_config in the extra LLM API options YAML)


def export_trtllm(schedule: Sequence[Range], *, method: str | None = None, model: str | None = None) -> dict[str, Any]:
    # keys are upper bounds: K applies to batch sizes up to the key; past the last key K = 0
    check_schedule(schedule, "schedule")
    max_k = max(k for _, _, k in schedule)
    if schedule[0][2] != max_k:
        raise ExportError(
            f"trtllm: draft_len_schedule's smallest key must map to max_draft_len; the policy drafts "
            f"K={schedule[0][2]} at batch 1 but K={max_k} at a larger batch"
        )
    spec: dict[str, Any] = {}
    if method is not None:
        spec["decoding_type"] = method
    if model is not None:
        spec["speculative_model"] = model
    spec["max_draft_len"] = max_k
    spec["draft_len_schedule"] = {hi: k for _, hi, k in schedule}
    cfg = {"speculative_config": spec}
    validate_trtllm(cfg)
    return cfg


def validate_trtllm(cfg: Any) -> None:
    """TensorRT-LLM's rules (DecodingBaseConfig.validate_draft_len_schedule_and_sort)."""
    spec = cfg.get("speculative_config") if isinstance(cfg, dict) else None
    if not isinstance(spec, dict):
        raise ExportError("trtllm: speculative_config: must be a mapping")
    max_k = _max_k(spec, "max_draft_len", "trtllm: speculative_config.max_draft_len")
    sched = spec.get("draft_len_schedule")
    if not isinstance(sched, dict) or not sched:
        raise ExportError("trtllm: speculative_config.draft_len_schedule: must be a non-empty mapping")
    for key, k in sched.items():
        where = f"trtllm: speculative_config.draft_len_schedule[{key!r}]"
        _int(key, where)
        _int(k, where)
        if key < 1:
            raise ExportError(f"{where}: batch-size key must be >= 1")
        if k < 0:
            raise ExportError(f"{where}: draft length must be >= 0, got {k}")
        if k > max_k:
            raise ExportError(f"{where}: draft length {k} exceeds max_draft_len={max_k}")
    smallest = min(sched)
    if sched[smallest] != max_k:
        raise ExportError(
            f"trtllm: speculative_config.draft_len_schedule[{smallest}]: the smallest key must map to "
            f"max_draft_len={max_k}, got {sched[smallest]}"
        )


def import_trtllm(cfg: Any) -> list[Range]:
    validate_trtllm(cfg)
    out, lo = [], 1
    for hi, k in sorted(cfg["speculative_config"]["draft_len_schedule"].items()):
        out.append((lo, hi, k))
        lo = hi + 1
    return out


# ---------------------------------------------------------------------------------------------
# one entry point for the CLI


def export_schedule(
    schedule: Sequence[Range], fmt: str, *, method: str | None = None, model: str | None = None
) -> dict[str, Any]:
    if fmt == "vllm":
        return export_vllm(schedule, method=method, model=model)
    if fmt == "sglang":
        return export_sglang(schedule)
    if fmt == "trtllm":
        return export_trtllm(schedule, method=method, model=model)
    raise ExportError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")


def render(fmt: str, cfg: dict[str, Any]) -> str:
    """vLLM and SGLang read JSON; TensorRT-LLM's extra options file is YAML."""
    if fmt == "trtllm":
        return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)
    text = json.dumps(cfg, indent=2)
    # keep innermost integer lists ([lo, hi, K], [K]) on one line
    return re.sub(r"\[\s+([-\d,\s]+?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text) + "\n"


def export_table(table: Table, fmt: str, *, file: str = "policy", method: str | None = None, model: str | None = None) -> str:
    """A policy table -> the engine config text (validated against the engine's rules); every
    error names ``file``."""
    try:
        return render(fmt, export_schedule(schedule_from_table(table, file), fmt, method=method, model=model))
    except ExportError as exc:
        if str(exc).startswith(f"{file}:"):
            raise
        raise ExportError(f"{file}: {exc}") from None
