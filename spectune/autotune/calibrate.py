"""Calibrate a profile's cost model to the user's own engine from the engine's benchmark outputs.

Each result file becomes decode-step points ``(batch b, draft length K, context c, ms per step)``:

    vllm bench latency --output-json F    {"avg_latency", "latencies": [s], "percentiles"} (vllm/benchmarks/
                                          latency.py); batch, input and output lengths are not in it: from
                                          F.pytorch.json beside it (SAVE_TO_PYTORCH_BENCHMARK_FORMAT=1, its
                                          "args") or F#batch=B&input=I&output=O. step = median latency /
                                          output_len (one prefill amortised), K = 0 only
    vllm bench serve --save-result        max_concurrency, median_tpot_ms, total_input/output_tokens,
                                          completed; with speculation spec_decode_num_drafts,
                                          spec_decode_draft_tokens, spec_decode_acceptance_length
                                          (vllm/benchmarks/serve.py). b = max_concurrency, K = draft
                                          tokens / drafts (one fixed K), step = TPOT x acceptance length
    sglang bench_one_batch (result.jsonl) per line batch_size, input_len, output_len,
                                          median_decode_latency [s] (sglang/benchmark/one_batch.py), K = 0
    sglang bench_serving (JSONL)          max_concurrency, median_tpot_ms, accept_length, server_info
                                          (speculative_num_steps) (sglang/benchmark/serving.py)
    vLLM dynamic-SD profiler              dynamic_speculative_config.json: batch_stats {batch: {K: median
      (vllm/v1/spec_decode/dynamic/       ITL ms}} from `vllm bench serve` per (K, max concurrency), K 0 =
      generate_config.py, not in 0.33)    no speculation; its manager scores K by accepted length / ITL, so
                                          an ITL is one step. The context is not in it: F#context=C

The correction keeps the cost model's shape and rescales its parts (NNLS on relative error):

    engine_ms(b, K, c) ~ a_w * weight + a_t * (target(b(K+1)) - weight + overhead) + a_d * drafter(b, K)

a_d stays 1 without a K > 0 point. Every third point (sorted by batch, K) is held out to report the
error, the profile is then refitted on all points and written with the parts scaled (its measured
points scaled by the same ratio, so the residual grid keeps its shape), ``costs.error`` = the
held-out calibration error, and no policy (tune it again).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from spectune.autotune.fit import _nnls_rel
from spectune.errors import SpectuneError
from spectune.runtime.costs import CostModel
from spectune.runtime.table import CostError, Table

HOLD_OUT_EVERY = 3


class CalibrationError(SpectuneError):
    """An engine result file that cannot be read, or too few points to calibrate."""


@dataclass(frozen=True)
class EnginePoint:
    source: str  # file[:line]
    batch: int
    k: int
    context: float
    ms: float  # one decode step of the whole batch


@dataclass(frozen=True)
class Calibration:
    table: Table
    scales: dict[str, float]  # weight, token, drafter
    points: list[EnginePoint]
    held_out: int
    error_before: tuple[
        float, float
    ]  # median, max relative error on the held-out points, uncalibrated
    error_after: tuple[float, float]  # the same, calibrated on the other points


# ---------------------------------------------------------------------------------------------
# reading the engines' outputs


def _num(obj: dict, key: str, where: str) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise CalibrationError(f"{where}: field {key!r} must be a number, got {v!r}")
    return float(v)


def _selector(spec: str) -> tuple[str, dict[str, int]]:
    path, _, frag = spec.partition("#")
    out = {}
    for part in filter(None, frag.split("&")):
        key, _, value = part.partition("=")
        if key not in ("batch", "input", "output", "k", "context") or not value.isdigit():
            raise CalibrationError(
                f"{spec}: bad selector {part!r} (use #batch=B&input=I&output=O, #k=K, #context=C)"
            )
        out[key] = int(value)
    return path, out


def _vllm_latency(obj: dict, path: str, sel: dict[str, int]) -> EnginePoint:
    args: dict[str, Any] = dict(sel)
    pt = Path(path).with_suffix(".pytorch.json")
    if pt.exists() and not {"batch", "output"} <= args.keys():
        records = json.loads(pt.read_text())
        a = records[0]["benchmark"]["extra_info"]["args"] if records else {}
        args = {
            "batch": a.get("batch_size"),
            "input": a.get("input_len"),
            "output": a.get("output_len"),
            **sel,
        }
        if a.get("speculative_config"):
            raise CalibrationError(
                f"{path}: a latency run with speculation: its step count depends on acceptance; "
                "use `vllm bench serve --save-result` at fixed K for drafter points"
            )
    if not args.get("batch") or not args.get("output"):
        raise CalibrationError(
            f"{path}: vllm bench latency output names no batch size or output length; "
            f"write it as {path}#batch=B&input=I&output=O"
        )
    lat = obj["latencies"]
    if not isinstance(lat, list) or not lat:
        raise CalibrationError(f"{path}: field 'latencies' must be a non-empty list of seconds")
    step = float(np.median(lat)) / args["output"] * 1e3
    return EnginePoint(path, int(args["batch"]), 0, args.get("input", 0) + args["output"] / 2, step)


def _serve(obj: dict, where: str, sel: dict[str, int], engine: str) -> EnginePoint:
    conc = obj.get("max_concurrency")
    if not isinstance(conc, int) or conc < 1:
        raise CalibrationError(
            f"{where}: field 'max_concurrency' must be set (run the bench with --max-concurrency)"
        )
    tpot = _num(obj, "median_tpot_ms", where)
    done = max(1.0, _num(obj, "completed", where))
    context = (
        _num(obj, "total_input_tokens", where) / done
        + _num(obj, "total_output_tokens", where) / done / 2
    )
    if engine == "vllm":
        drafts = obj.get("spec_decode_num_drafts") or 0
        k = round(obj.get("spec_decode_draft_tokens", 0) / drafts) if drafts else 0
        if drafts and abs(obj["spec_decode_draft_tokens"] - k * drafts) > 1e-6 * drafts:
            raise CalibrationError(
                f"{where}: drafts per step varied; calibrate on runs at one fixed K"
            )
        accept = _num(obj, "spec_decode_acceptance_length", where) if drafts else 1.0
    else:
        info = obj.get("server_info") or {}
        k = sel.get(
            "k",
            int(info.get("speculative_num_steps") or 0) if info.get("speculative_algorithm") else 0,
        )
        accept = _num(obj, "accept_length", where) if k else 1.0
    return EnginePoint(where, conc, k, context, tpot * accept)


def _sglang_one_batch(obj: dict, where: str) -> EnginePoint:
    b = _num(obj, "batch_size", where)
    step = _num(obj, "median_decode_latency", where) * 1e3
    return EnginePoint(
        where, int(b), 0, _num(obj, "input_len", where) + _num(obj, "output_len", where) / 2, step
    )


def _int_key(key: Any, where: str, lo: int) -> int:
    try:
        value = int(key)
    except (TypeError, ValueError):
        value = lo - 1
    if value < lo or str(key).strip() != str(value):
        raise CalibrationError(f"{where}: key {key!r} must be an integer >= {lo}")
    return value


def _vllm_dynamic_sd(obj: dict, where: str, sel: dict[str, int]) -> list[EnginePoint]:
    stats = obj["batch_stats"]
    if not isinstance(stats, dict) or not stats:
        raise CalibrationError(
            f"{where}: field 'batch_stats' must be a non-empty {{batch: {{K: ITL ms}}}} object"
        )
    if "context" not in sel:
        raise CalibrationError(
            f"{where}: a vLLM dynamic-SD profile does not record the context length; write it as "
            f"{where}#context=C (the mean prompt + half the output tokens of its bench)"
        )
    out = []
    for bkey, row in stats.items():
        b = _int_key(bkey, f"{where}: batch_stats", 1)
        if not isinstance(row, dict) or not row:
            raise CalibrationError(
                f"{where}: batch_stats[{bkey!r}] must be a non-empty {{K: ITL ms}} object"
            )
        for kkey in row:
            k = _int_key(kkey, f"{where}: batch_stats[{bkey!r}]", 0)
            ms = _num(row, kkey, f"{where}: batch_stats[{bkey!r}]")
            out.append(EnginePoint(f"{where}#batch={b}&k={k}", b, k, float(sel["context"]), ms))
    return out


def read_engine_results(spec: str) -> list[EnginePoint]:
    """One result file (JSON or JSONL, format detected by its fields) -> decode-step points."""
    path, sel = _selector(spec)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        objs = [(path, json.loads(text))]
    except json.JSONDecodeError:
        objs = []
        for i, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    objs.append((f"{path}:{i}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise CalibrationError(f"{path}:{i}: not JSON ({exc.msg})") from None
    out = []
    for where, obj in objs:
        if not isinstance(obj, dict):
            raise CalibrationError(f"{where}: expected a JSON object")
        if "batch_stats" in obj:
            out.extend(_vllm_dynamic_sd(obj, where, sel))
        elif "median_decode_latency" in obj:
            out.append(_sglang_one_batch(obj, where))
        elif "avg_latency" in obj and "latencies" in obj:
            out.append(_vllm_latency(obj, path, sel))
        elif "median_tpot_ms" in obj:
            out.append(
                _serve(
                    obj,
                    where,
                    sel,
                    "sglang" if "accept_length" in obj or "server_info" in obj else "vllm",
                )
            )
        else:
            raise CalibrationError(
                f"{where}: not a vllm bench latency/serve, vLLM dynamic-SD profile or sglang "
                "bench_one_batch/bench_serving result (no avg_latency, median_tpot_ms, "
                "batch_stats or median_decode_latency)"
            )
    if any(p.ms <= 0 or p.batch < 1 for p in out):
        raise CalibrationError(f"{path}: a step time or batch size is not positive")
    return out


# ---------------------------------------------------------------------------------------------
# fitting the correction


def _features(model: CostModel, p: EnginePoint) -> np.ndarray:
    # [3]: weight-bound part, per-token part (target past the weight floor + runtime overhead), drafter
    n = p.batch * (p.k + 1)
    weight = model.params.target.weight_ms
    target = model.target_ms(n, p.batch, p.context)
    return np.array(
        [weight, target - weight + model.overhead_ms(n), model.drafter_ms(p.batch, p.k, p.context)]
    )


def _fit(x: np.ndarray, y: np.ndarray, drafter: bool) -> np.ndarray:
    if drafter:
        coef, _ = _nnls_rel(x, y)
        return coef
    coef, _ = _nnls_rel(x[:, :2], y - x[:, 2])
    return np.array([coef[0], coef[1], 1.0])


def _rel_errors(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> np.ndarray:
    return np.abs(x @ coef / y - 1.0)


def calibrate_profile(table: Table, points: Sequence[EnginePoint]) -> Calibration:
    if len(points) < 3:
        raise CalibrationError(
            f"need at least 3 engine result points to calibrate, got {len(points)}"
        )
    base = CostModel.of(table, residuals=False)
    pts = sorted(points, key=lambda p: (p.batch, p.k, p.context))
    x = np.stack([_features(base, p) for p in pts])  # [P, 3]
    y = np.array([p.ms for p in pts])  # [P]
    drafter = any(p.k > 0 for p in pts)
    held = np.arange(len(pts)) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1
    train_coef = _fit(x[~held], y[~held], drafter)
    before = _rel_errors(x[held], y[held], np.ones(3))
    after = _rel_errors(x[held], y[held], train_coef)
    coef = _fit(x, y, drafter)
    scales = {"weight": float(coef[0]), "token": float(coef[1]), "drafter": float(coef[2])}
    err = CostError(
        held_out=int(held.sum()), median_rel=float(np.median(after)), max_rel=float(np.max(after))
    )
    return Calibration(
        scaled_table(table, scales, err, len(pts)),
        scales,
        pts,
        int(held.sum()),
        (float(np.median(before)), float(np.max(before))),
        (err.median_rel, err.max_rel),
    )


def scaled_table(table: Table, scales: dict[str, float], error: CostError, n_points: int) -> Table:
    """The profile with its cost parts scaled; measured points scaled by new fit / old fit."""
    m = table.costs.model
    w, t, d = scales["weight"], scales["token"], scales["drafter"]
    target = replace(
        m.target,
        weight_ms=m.target.weight_ms * w,
        token_ms=m.target.token_ms * t,
        compute_ms=m.target.compute_ms * t,
        kv_ms_per_mtok=m.target.kv_ms_per_mtok * t,
        kv_verify_ms_per_mtok=m.target.kv_verify_ms_per_mtok * t,
    )
    dr = m.drafter
    drafter = replace(
        dr,
        fixed_ms=dr.fixed_ms * d,
        step_ms=dr.step_ms * d,
        token_ms=dr.token_ms * d,
        compute_ms=dr.compute_ms * d,
        kv_ms_per_mtok=dr.kv_ms_per_mtok * d,
    )
    overhead = replace(
        m.overhead,
        base_ms=m.overhead.base_ms * t,
        token_ms=m.overhead.token_ms * t,
        source=f"calibrated to {n_points} engine results (scales weight {w:.3f}, token {t:.3f}, "
        f"drafter {d:.3f})",
    )
    params = replace(m, target=target, drafter=drafter, overhead=overhead)
    old, new = (
        CostModel(m, table.workload.drafter_kind, table.workload.context_len),
        CostModel(params, table.workload.drafter_kind, table.workload.context_len),
    )
    pts = []
    for p in table.costs.points:
        ratio = _ratio(old, new, p)
        pts.append(replace(p, ms=p.ms * ratio) if p.ms is not None and ratio is not None else p)
    costs = replace(table.costs, model=params, error=error, points=pts, measurements=None)
    return replace(table, costs=costs, policy=None, acceptance=None)


def _ratio(old: CostModel, new: CostModel, p: Any) -> float | None:
    if p.kind in ("target", "tier"):
        a, b = old.target_ms(p.tokens, p.batch), new.target_ms(p.tokens, p.batch)
    elif p.kind == "drafter" and p.k:
        a, b = old.drafter_ms(p.batch, p.k), new.drafter_ms(p.batch, p.k)
    elif p.kind == "overhead":
        a, b = old.overhead_ms(p.tokens), new.overhead_ms(p.tokens)
    else:
        return None
    return b / a if a > 0 else None
