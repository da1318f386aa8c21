"""SGLang: ``--speculative-adaptive-config`` JSON plus the server flags that make it route right.

Rules read from SGLang 0.5.23 (docs/EXPORTS.md cites the files):

    _load_adaptive_config        digit-string keys are batch-size slots, each with candidate_steps,
                                 a non-empty list of ints >= 0; other keys are knobs merged into
                                 every slot; at least one slot
    AdaptiveSpeculativeParams    _route(b): pad b up to the next captured CUDA-graph batch size
                                 (b itself past the largest), then the slot with the largest key
                                 <= that (the first slot below the smallest key)
    adaptive_unsupported_reason  adaptive runs with EAGLE / EAGLE3, topk 1, no attention DP
    _init_adaptive_speculative_params  --speculative-num-steps must be one of the candidates;
                                 speculative_num_draft_tokens becomes steps + 1
    generate_decode_cuda_graph_batch_sizes  the default speculative capture list

A slot with one candidate pins K. Padding happens before routing, so a range whose upper bound is
not a captured batch size leaks its top batch sizes into the next slot: the export adds every
range's ``hi`` to ``--cuda-graph-bs-decode`` (beside SGLang's default list) and a K = 0 slot past
the policy's last range.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from spectune.autotune.engine_schedule import ExportError, Range, check_schedule

VERSIONS = ("0.5.23",)
METHODS = ("EAGLE", "EAGLE3")  # adaptive_unsupported_reason: the only algorithms adaptive runs with


def default_cuda_graph_bs(max_bs: int) -> list[int]:
    """SGLang's speculative decode capture list up to ``max_bs`` (generate_decode_cuda_graph_batch_sizes)."""
    bs = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    bs = [b for b in bs if b <= max_bs]
    return bs if max_bs in bs else [*bs, max_bs]


def cuda_graph_bs_for(schedule: Sequence[Range], max_bs: int) -> list[int]:
    """The default list plus every range's upper bound: each batch size then pads inside its range."""
    return sorted(set(default_cuda_graph_bs(max_bs)) | {hi for _, hi, _ in schedule if hi <= max_bs})


def export_sglang(schedule: Sequence[Range]) -> dict[str, Any]:
    # one slot per range, keyed by its lower bound; a single candidate pins K for that range;
    # past the last range K = 0
    check_schedule(schedule, "schedule")
    cfg: dict[str, Any] = {str(lo): {"candidate_steps": [k]} for lo, _, k in schedule}
    last_hi, last_k = schedule[-1][1], schedule[-1][2]
    if last_k != 0:
        cfg[str(last_hi + 1)] = {"candidate_steps": [0]}
    validate_sglang(cfg)
    return cfg


def server_flags_sglang(schedule: Sequence[Range], *, method: str | None, model: str | None,
                        config_path: str, max_bs: int) -> list[str]:
    algo = (method or "").upper()
    if algo not in METHODS:
        raise ExportError(f"sglang: --method must be {' or '.join(METHODS)} (adaptive speculation runs only "
                          f"with those), got {method!r}")
    if model is None:
        raise ExportError("sglang: --drafter-model is required (--speculative-draft-model-path)")
    steps = max(k for _, _, k in schedule)
    return [
        "--speculative-algorithm", algo, "--speculative-draft-model-path", model,
        "--speculative-eagle-topk", "1", "--speculative-num-steps", str(steps),
        "--speculative-num-draft-tokens", str(steps + 1),
        "--speculative-adaptive", "--speculative-adaptive-config", config_path,
        "--cuda-graph-bs-decode", *(str(b) for b in cuda_graph_bs_for(schedule, max_bs)),
    ]


def validate_sglang(cfg: Any) -> None:
    """SGLang's _load_adaptive_config rules plus ours: a slot at batch 1."""
    if not isinstance(cfg, dict):
        raise ExportError("sglang: adaptive config must be a JSON object")
    keys = []
    for key, entry in cfg.items():
        if not isinstance(key, str) or not key.isdigit():
            continue  # shared knobs (ema_alpha, ...) merged into every slot
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


def route_sglang(cfg: dict[str, Any], cuda_graph_bs: Sequence[int] | None, batch: int) -> int:
    """The K SGLang runs at ``batch``: pad to a captured size, then the largest slot key <= it."""
    graphs = sorted(cuda_graph_bs) if cuda_graph_bs else None
    padded = batch
    if graphs is not None:
        i = bisect.bisect_left(graphs, batch)
        padded = graphs[i] if i < len(graphs) else batch
    keys = sorted(int(k) for k in cfg if k.isdigit())
    slot = keys[max(0, bisect.bisect_right(keys, padded) - 1)]
    return max(cfg[str(slot)]["candidate_steps"])


def import_sglang(cfg: Any, *, max_batch: int) -> list[Range]:
    """Slots -> ranges [key, next key - 1]; the last slot runs to ``max_batch``; a K = 0 slot past
    ``max_batch`` (our tail) is dropped. A slot with several candidates imports as its largest."""
    validate_sglang(cfg)
    slots = sorted((int(key), max(entry["candidate_steps"])) for key, entry in cfg.items() if key.isdigit())
    slots = [s for s in slots if s[0] <= max_batch]
    out = []
    for i, (lo, k) in enumerate(slots):
        hi = slots[i + 1][0] - 1 if i + 1 < len(slots) else max_batch
        out.append((lo, hi, k))
    return out
