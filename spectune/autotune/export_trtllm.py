"""TensorRT-LLM: the extra LLM API options YAML (``max_batch_size`` and ``speculative_config``).

Rules read from NVIDIA/TensorRT-LLM ``tensorrt_llm/llmapi/llm_args.py`` (docs/EXPORTS.md cites the
commits; the release wheel installs only from NVIDIA's own index, so it was not run here):

    DecodingBaseConfig            speculative_config is a tagged union on ``decoding_type``
                                  (Eagle, Eagle3, NGram, DraftTarget, MTP, ...); ``max_draft_len``,
                                  ``speculative_model`` (alias speculative_model_dir), strict keys
    validate_draft_len_schedule_and_sort
        upper (newer code)        keys >= 1, lengths >= 0, the smallest key maps to max_draft_len,
                                  every length <= max_draft_len; a key is the *upper* bound of its
                                  range (bisect_left) and batch sizes past the last key draft 0
        lower (older code)        the same checks, but key 1 is required and keys are *lower*
                                  thresholds (bisect_right): the last key's length runs on
    max_concurrency               mutually exclusive with draft_len_schedule (never written)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from spectune.autotune.engine_schedule import (
    ExportError,
    Range,
    check_schedule,
    int_field,
    positive_field,
)

VERSIONS = ("upper", "lower")  # key semantics of the newer and the older draft_len_schedule code
DECODING_TYPES = {"eagle": "Eagle", "eagle3": "Eagle3", "ngram": "NGram", "draft_model": "DraftTarget", "mtp": "MTP"}
METHODS_WITHOUT_MODEL = ("ngram", "mtp")


def export_trtllm(schedule: Sequence[Range], *, method: str | None, model: str | None = None,
                  max_batch_size: int, keys: str = "upper") -> dict[str, Any]:
    check_schedule(schedule, "schedule")
    if method is None or method.lower() not in DECODING_TYPES:
        raise ExportError(f"trtllm: --method is required, one of {', '.join(DECODING_TYPES)} "
                          f"(it sets decoding_type), got {method!r}")
    method = method.lower()
    if method not in METHODS_WITHOUT_MODEL and model is None:
        raise ExportError(f"trtllm: method {method} needs --drafter-model (speculative_model)")
    if keys not in VERSIONS:
        raise ExportError(f"trtllm: unknown --engine-version {keys!r} (choose from {', '.join(VERSIONS)})")
    ranges = [(lo, min(hi, max_batch_size), k) for lo, hi, k in schedule if lo <= max_batch_size]
    max_k = max(k for _, _, k in ranges)
    if ranges[0][2] != max_k:
        raise ExportError(
            f"trtllm: draft_len_schedule's smallest key must map to max_draft_len; the policy drafts "
            f"K={ranges[0][2]} at batch 1 but K={max_k} at a larger batch"
        )
    if keys == "upper":
        sched = {hi: k for _, hi, k in ranges}  # past the last key: 0
    else:
        sched = {lo: k for lo, _, k in ranges}
        if ranges[-1][2] != 0:
            sched[ranges[-1][1] + 1] = 0  # the last threshold's length runs on: stop it
    spec: dict[str, Any] = {"decoding_type": DECODING_TYPES[method], "max_draft_len": max_k}
    if model is not None and method not in METHODS_WITHOUT_MODEL:
        spec["speculative_model"] = model
    spec["draft_len_schedule"] = sched
    cfg = {"max_batch_size": max_batch_size, "speculative_config": spec}
    validate_trtllm(cfg, keys=keys)
    return cfg


def server_flags_trtllm(*, config_path: str, max_batch_size: int) -> list[str]:
    return ["--extra_llm_api_options", config_path, "--max_batch_size", str(max_batch_size)]


def validate_trtllm(cfg: Any, *, keys: str = "upper") -> None:
    """TensorRT-LLM's validate_draft_len_schedule_and_sort (module doc) and the fields it needs."""
    spec = cfg.get("speculative_config") if isinstance(cfg, dict) else None
    if not isinstance(spec, dict):
        raise ExportError("trtllm: speculative_config: must be a mapping")
    if spec.get("decoding_type") not in DECODING_TYPES.values():
        raise ExportError(f"trtllm: speculative_config.decoding_type: must be one of "
                          f"{', '.join(DECODING_TYPES.values())}, got {spec.get('decoding_type')!r}")
    max_k = positive_field(spec, "max_draft_len", "trtllm: speculative_config.max_draft_len")
    if "max_concurrency" in spec:
        raise ExportError("trtllm: speculative_config: max_concurrency and draft_len_schedule are mutually exclusive")
    sched = spec.get("draft_len_schedule")
    if not isinstance(sched, dict) or not sched:
        raise ExportError("trtllm: speculative_config.draft_len_schedule: must be a non-empty mapping")
    for key, k in sched.items():
        where = f"trtllm: speculative_config.draft_len_schedule[{key!r}]"
        int_field(key, where)
        int_field(k, where)
        if key < 1:
            raise ExportError(f"{where}: batch-size key must be >= 1")
        if k < 0:
            raise ExportError(f"{where}: draft length must be >= 0, got {k}")
        if k > max_k:
            raise ExportError(f"{where}: draft length {k} exceeds max_draft_len={max_k}")
    if keys == "lower" and 1 not in sched:
        raise ExportError("trtllm: speculative_config.draft_len_schedule: must include batch size 1")
    smallest = min(sched)
    if sched[smallest] != max_k:
        raise ExportError(
            f"trtllm: speculative_config.draft_len_schedule[{smallest}]: the smallest key must map to "
            f"max_draft_len={max_k}, got {sched[smallest]}"
        )


def draft_len_trtllm(cfg: dict[str, Any], batch: int, *, keys: str = "upper") -> int:
    """The draft length TensorRT-LLM runs at ``batch`` (get_draft_len_for_batch_size)."""
    sched = sorted(cfg["speculative_config"]["draft_len_schedule"].items())
    bounds = [b for b, _ in sched]
    if keys == "upper":
        i = bisect.bisect_left(bounds, batch)
        return sched[i][1] if i < len(sched) else 0
    i = bisect.bisect_right(bounds, batch) - 1
    return sched[i][1] if i >= 0 else 0


def import_trtllm(cfg: Any, *, keys: str = "upper") -> list[Range]:
    validate_trtllm(cfg, keys=keys)
    items = sorted(cfg["speculative_config"]["draft_len_schedule"].items())
    if keys == "upper":
        out, lo = [], 1
        for hi, k in items:
            out.append((lo, hi, k))
            lo = hi + 1
        return out
    max_batch = int(cfg.get("max_batch_size") or items[-1][0])
    bounds = [b for b, _ in items] + [max_batch + 1]
    return [(lo, bounds[i + 1] - 1, k) for i, (lo, k) in enumerate(items) if lo <= max_batch]
