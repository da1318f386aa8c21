"""Policy rows -> the engines' own configs, complete enough to paste (vLLM, SGLang, TensorRT-LLM).

Engines only see K per batch-size range (the verify budget and tiers are spectune's own), so a
policy becomes a *schedule* (:mod:`spectune.autotune.engine_schedule`). One module per engine holds
``export_<fmt>``, ``validate_<fmt>`` (the engine's parser rules, plus ours: contiguous from 1,
K <= the maximum), the engine's own lookup (``lookup_vllm``, ``route_sglang``,
``draft_len_trtllm``: the K it runs at each batch size) and ``import_<fmt>``. docs/EXPORTS.md lists
the engine files and versions these rules were read from.

    vLLM          --speculative-config {"method", "model", "num_speculative_tokens": maxK,
                  "num_speculative_tokens_per_batch_size": [[lo, hi, K], ..., [hi+1, max_num_seqs, 0]]}
    SGLang        --speculative-adaptive-config {"1": {"candidate_steps": [K]}, "17": ...} (keys are
                  lower bounds) and --cuda-graph-bs-decode with every range's upper bound
    TensorRT-LLM  extra options YAML {max_batch_size, speculative_config: {decoding_type,
                  max_draft_len, speculative_model, draft_len_schedule: {hi: K, ...}}}
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from spectune.autotune import export_sglang as sgl
from spectune.autotune import export_trtllm as trt
from spectune.autotune import export_vllm as vll
from spectune.autotune.engine_schedule import (  # noqa: F401  (re-exported)
    ExportError,
    Range,
    check_schedule,
    schedule_from_rows,
    schedule_from_table,
)
from spectune.autotune.export_sglang import export_sglang, import_sglang, validate_sglang  # noqa: F401
from spectune.autotune.export_trtllm import export_trtllm, import_trtllm, validate_trtllm  # noqa: F401
from spectune.autotune.export_vllm import export_vllm, import_vllm, validate_vllm  # noqa: F401
from spectune.runtime.table import Table

FORMATS = ("vllm", "sglang", "trtllm")
VERSIONS = {"vllm": vll.VERSIONS, "sglang": sgl.VERSIONS, "trtllm": trt.VERSIONS}
CONFIG_FILE = {"vllm": "spec.json", "sglang": "adaptive.json", "trtllm": "extra_llm_api_options.yaml"}


@dataclass(frozen=True)
class EngineExport:
    fmt: str
    engine_version: str
    config: dict[str, Any]
    text: str  # the config file's text
    flags: tuple[str, ...]  # server flags to paste (naming the config file where it is one)
    max_batch: int  # the largest batch size the flags let the engine run


def _version(fmt: str, engine_version: str | None) -> str:
    known = VERSIONS[fmt]
    if engine_version is None:
        return known[0]
    for v in known:
        if engine_version == v or engine_version.startswith(v + "."):
            return v
    raise ExportError(f"{fmt}: --engine-version {engine_version!r}: rules known for {', '.join(known)} "
                      "(docs/EXPORTS.md says which code each was read from)")


def export_schedule(
    schedule: Sequence[Range], fmt: str, *, method: str | None = None, model: str | None = None,
    max_batch: int | None = None, engine_version: str | None = None, config_path: str | None = None,
) -> EngineExport:
    """``max_batch``: vLLM --max-num-seqs (default vLLM's, 1024 on H100/H200), SGLang's largest
    captured batch and TensorRT-LLM max_batch_size (default: the schedule's last batch size)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    version = _version(fmt, engine_version)
    path = config_path or CONFIG_FILE[fmt]
    if max_batch is not None and max_batch < 1:
        raise ExportError(f"{fmt}: --max-batch must be >= 1, got {max_batch}")
    if fmt == "vllm":
        seqs = max_batch if max_batch is not None else vll.DEFAULT_MAX_NUM_SEQS
        cfg = export_vllm(schedule, method=method, model=model, max_num_seqs=seqs)
        text = render(fmt, cfg)
        flags = vll.server_flags_vllm(cfg, max_num_seqs=seqs, config_json=json.dumps(cfg, separators=(",", ":")))
        return EngineExport(fmt, version, cfg, text, tuple(flags), seqs)
    top = max_batch if max_batch is not None else schedule[-1][1]
    if fmt == "sglang":
        cfg = export_sglang(schedule)
        flags = sgl.server_flags_sglang(schedule, method=method, model=model, config_path=path, max_bs=top)
        return EngineExport(fmt, version, cfg, render(fmt, cfg), tuple(flags), top)
    cfg = export_trtllm(schedule, method=method, model=model, max_batch_size=top, keys=version)
    flags = trt.server_flags_trtllm(config_path=path, max_batch_size=top)
    return EngineExport(fmt, version, cfg, render(fmt, cfg), tuple(flags), top)


def engine_k(export: EngineExport, batch: int) -> int:
    """The K the engine runs at ``batch`` under the exported config and flags (its own lookup)."""
    if export.fmt == "vllm":
        return vll.lookup_vllm(export.config, export.max_batch)[batch]
    if export.fmt == "sglang":
        i = export.flags.index("--cuda-graph-bs-decode")
        graphs = [int(f) for f in export.flags[i + 1:] if f.isdigit()]
        return sgl.route_sglang(export.config, graphs, batch)
    return trt.draft_len_trtllm(export.config, batch, keys=export.engine_version)


def render(fmt: str, cfg: dict[str, Any]) -> str:
    """vLLM and SGLang read JSON; TensorRT-LLM's extra options file is YAML."""
    if fmt == "trtllm":
        return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False)
    text = json.dumps(cfg, indent=2)
    # keep innermost integer lists ([lo, hi, K], [K]) on one line
    return re.sub(r"\[\s+([-\d,\s]+?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text) + "\n"


def flags_line(export: EngineExport) -> str:
    return " ".join(shlex.quote(f) for f in export.flags)


def export_table(table: Table, fmt: str, *, file: str = "policy", method: str | None = None,
                 model: str | None = None, max_batch: int | None = None, engine_version: str | None = None,
                 config_path: str | None = None) -> EngineExport:
    """A policy table -> the engine config and flags (validated against the engine's rules); every
    error names ``file``."""
    try:
        top = max_batch if max_batch is not None else vll.DEFAULT_MAX_NUM_SEQS if fmt == "vllm" else None
        return export_schedule(schedule_from_table(table, file, top), fmt, method=method, model=model,
                               max_batch=max_batch, engine_version=engine_version, config_path=config_path)
    except ExportError as exc:
        if str(exc).startswith(f"{file}:"):
            raise
        raise ExportError(f"{file}: {exc}") from None
