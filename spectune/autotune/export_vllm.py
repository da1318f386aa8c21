"""vLLM: ``--speculative-config`` JSON with a dynamic batch-size schedule.

Rules read from vLLM 0.33.0 (docs/EXPORTS.md cites the files):

    SpeculativeConfig.__post_init__  without ``model``, only ngram / ngram_gpu / suffix / mtp
                                     (and a few more) name their own drafter; any other method,
                                     or no method, fails "num_speculative_tokens was provided but
                                     without speculative model"
    validate_and_normalize_dynamic_sd_schedule   [[lo, hi, K], ...]: lo, hi > 0, lo <= hi, K >= 0,
                                     sorted, non-overlapping, first lo == 1
    build_dynamic_sd_schedule_lookup dense K per batch 1..max_num_seqs: a gap inherits the previous
                                     K, batch sizes past the last range keep the last K, every K
                                     is clamped to num_speculative_tokens

So the export names the method (and the drafter where the method needs one) and its ranges reach
max_num_seqs: past the table's rows ``export_table`` continues with the runtime planner's K there
(``Planner.uniform_k``), and a schedule that stops short gets a ``[hi + 1, max_num_seqs, 0]`` tail:
without it batch sizes past the last range would keep its K where the schedule means K = 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spectune.autotune.engine_schedule import (
    ExportError,
    Range,
    check_schedule,
    int_field,
    positive_field,
)

VERSIONS = ("0.33",)  # vLLM versions whose code these rules were read from
KEY = "num_speculative_tokens_per_batch_size"
# vLLM's default max_num_seqs on a >= 70 GiB GPU (H100/H200, not A100): EngineArgs.get_batch_default_values
DEFAULT_MAX_NUM_SEQS = 1024
# methods whose drafter vLLM finds without `model` (SpeculativeConfig.__post_init__)
METHODS_WITHOUT_MODEL = ("ngram", "ngram_gpu", "suffix", "mtp")
METHODS_WITH_MODEL = ("eagle", "eagle3", "draft_model", "dflash", "dspark")
METHODS = METHODS_WITHOUT_MODEL + METHODS_WITH_MODEL


def export_vllm(
    schedule: Sequence[Range], *, method: str | None, model: str | None = None,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> dict[str, Any]:
    """The ``--speculative-config`` object vLLM's SpeculativeConfig accepts as it is."""
    check_schedule(schedule, "schedule")
    if method is None:
        raise ExportError(f"vllm: --method is required ({', '.join(METHODS)}); vLLM refuses a "
                          "speculative config without a method or drafter model")
    if method not in METHODS:
        raise ExportError(f"vllm: unknown method {method!r} (choose from {', '.join(METHODS)})")
    if method in METHODS_WITH_MODEL and model is None:
        raise ExportError(f"vllm: method {method} needs --drafter-model (a checkpoint path or hub id)")
    if max_num_seqs < 1:
        raise ExportError(f"vllm: --max-num-seqs must be >= 1, got {max_num_seqs}")
    ranges = [[lo, min(hi, max_num_seqs), k] for lo, hi, k in schedule if lo <= max_num_seqs]
    last_hi = ranges[-1][1]
    if last_hi < max_num_seqs:  # past the policy: K = 0, not the last range's K
        if ranges[-1][2] == 0:
            ranges[-1][1] = max_num_seqs
        else:
            ranges.append([last_hi + 1, max_num_seqs, 0])
    cfg: dict[str, Any] = {"method": method}
    if model is not None and method not in ("ngram", "ngram_gpu", "suffix"):
        cfg["model"] = model
    cfg["num_speculative_tokens"] = max(k for _, _, k in ranges)  # sizes the buffers: the largest K
    if cfg["num_speculative_tokens"] == 0:
        raise ExportError(f"vllm: K is 0 at every batch size up to --max-num-seqs {max_num_seqs}")
    cfg[KEY] = ranges
    validate_vllm(cfg)
    return cfg


def server_flags_vllm(cfg: dict[str, Any], *, max_num_seqs: int, config_json: str) -> list[str]:
    return ["--speculative-config", config_json, "--max-num-seqs", str(max_num_seqs)]


def validate_vllm(cfg: Any) -> None:
    """vLLM's parser rules (module doc) plus ours: contiguous ranges, K <= num_speculative_tokens."""
    if not isinstance(cfg, dict):
        raise ExportError("vllm: speculative_config must be a JSON object")
    method, model = cfg.get("method"), cfg.get("model")
    if model is None and method not in METHODS_WITHOUT_MODEL:
        raise ExportError("vllm: method: needs one of "
                          f"{', '.join(METHODS_WITHOUT_MODEL)} or a drafter `model` (got method={method!r})")
    max_k = positive_field(cfg, "num_speculative_tokens", "vllm: num_speculative_tokens")
    entries = cfg.get(KEY)
    if not isinstance(entries, list) or not entries:
        raise ExportError(f"vllm: {KEY}: must be a non-empty list of [lo, hi, K]")
    prev_hi = 0
    for i, entry in enumerate(entries):
        where = f"vllm: {KEY}[{i}]"
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ExportError(f"{where}: must be a 3-item [lo, hi, K], got {entry!r}")
        lo, hi, k = (int_field(v, where) for v in entry)
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


def lookup_vllm(cfg: dict[str, Any], max_num_seqs: int) -> list[int]:
    """K per batch size 1..max_num_seqs as vLLM's build_dynamic_sd_schedule_lookup fills it
    (index 0 unused): gaps inherit, the tail keeps the last K, K clamped to the maximum."""
    max_k = int(cfg["num_speculative_tokens"])
    dense = [0] * (max_num_seqs + 1)
    nxt, last = 1, 0
    for lo, hi, k in sorted(cfg[KEY], key=lambda e: e[0]):
        for b in range(nxt, min(lo, max_num_seqs + 1)):
            dense[b] = min(max_k, last)
        for b in range(max(lo, nxt), min(hi, max_num_seqs) + 1):
            dense[b] = min(max_k, k)
        nxt, last = max(nxt, hi + 1), k
    for b in range(nxt, max_num_seqs + 1):
        dense[b] = min(max_k, last)
    return dense


def import_vllm(cfg: Any) -> list[Range]:
    validate_vllm(cfg)
    return [(int(lo), int(hi), int(k)) for lo, hi, k in cfg[KEY]]
