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
                                          (speculative_num_steps; a PD router's: its "decode"[0], as
                                          sglang/benchmark/serving.py reads it), K = num steps, or
                                          F#k=K where server_info is null
    vLLM dynamic-SD profiler              dynamic_speculative_config.json: batch_stats {batch: {K: median
      (vllm/v1/spec_decode/dynamic/       ITL ms}} from `vllm bench serve` per (K, max concurrency), K 0 =
      generate_config.py, not in 0.33)    no speculation; its manager scores K by accepted length / ITL, so
                                          an ITL is one step. The context is not in it: F#context=C

``#key=V`` only fills in what a file does not record; one the format does not take, or one that
contradicts the file, is refused. Every field is type- and range-checked (an acceptance length lies
in [1, K + 1]): bad input is a one-line CalibrationError naming the file and the field.

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


def _num(
    obj: Any,
    key: str | int,
    where: str,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    above: float | None = None,
    integer: bool = False,
    name: str | None = None,
    why: str = "",
) -> float:
    """``obj[key]`` (an object's field or a list's item): a finite number (an int if ``integer``) in
    [lo, hi] (and > ``above``), else the one-line error naming the file and the field (``name``: its
    path, default the key)."""
    try:
        v = obj[key]
    except (KeyError, IndexError, TypeError):
        v = None
    typed = not isinstance(v, bool) and isinstance(v, int if integer else int | float)
    try:
        f = float(v) if typed else math.nan
    except OverflowError:  # an integer past float range
        f = math.inf
    ok = math.isfinite(f) and lo <= f <= hi and (above is None or f > above)
    if not ok:
        bounds = [f"> {above:g}"] if above is not None else []
        if math.isfinite(lo) and math.isfinite(hi):
            bounds.append(f"in [{lo:g}, {hi:g}]")
        elif math.isfinite(lo) or math.isfinite(hi):
            bounds.append(f">= {lo:g}" if math.isfinite(lo) else f"<= {hi:g}")
        what = " ".join(["an integer" if integer else "a number", *bounds])
        raise CalibrationError(
            f"{where}: field {name or str(key)!r} must be {what}, got {v!r}"
            + (f" ({why})" if why else "")
        )
    return f


_SELECTOR_MIN = {"batch": 1, "input": 0, "output": 1, "k": 0, "context": 1}


def _selector(spec: str) -> tuple[str, dict[str, int]]:
    path, _, frag = spec.partition("#")
    out = {}
    for part in filter(None, frag.split("&")):
        key, _, value = part.partition("=")
        if key not in _SELECTOR_MIN or not (value.isascii() and value.isdigit()):
            raise CalibrationError(
                f"{spec}: bad selector {part!r} (use #batch=B&input=I&output=O, #k=K, #context=C)"
            )
        if int(value) < _SELECTOR_MIN[key]:
            raise CalibrationError(
                f"{spec}: bad selector {part!r}: {key} must be >= {_SELECTOR_MIN[key]}"
            )
        out[key] = int(value)
    return path, out


def _fill(
    where: str, sel: dict[str, int], fmt: str, recorded: dict[str, tuple[str, Any]]
) -> dict[str, Any]:
    """The selector fills in what a file does not record: ``recorded`` {key: (the file's field,
    its value or None)} lists the keys a format takes. A key it does not take, or one contradicting
    the file, is refused (ignoring it would label the points with what the user did not mean)."""
    out = {key: value for key, (_, value) in recorded.items()}
    for key, value in sel.items():
        if key not in recorded:
            takes = f"it takes only {', '.join(recorded)}" if recorded else "the file records it"
            raise CalibrationError(
                f"{where}: selector {key}={value} does not apply to a {fmt} result ({takes})"
            )
        field, have = recorded[key]
        if have is not None and have != value:
            raise CalibrationError(
                f"{where}: selector {key}={value} contradicts the file's {field} {have!r}"
            )
        out[key] = value
    return out


def _read_text(path: str | Path) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if data[:2] == b"\x1f\x8b":
        raise CalibrationError(f"{path}: gzip-compressed; decompress it first (gunzip)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CalibrationError(
            f"{path}: not UTF-8 text at byte {exc.start} (the engines write UTF-8 JSON)"
        ) from None


def _pytorch_args(pt: Path) -> dict:
    """The run's arguments from vLLM's SAVE_TO_PYTORCH_BENCHMARK_FORMAT record (a list, one record
    per metric, each with benchmark.extra_info.args = vars(args); vllm/benchmarks/lib/utils.py)."""
    try:
        records = json.loads(_read_text(pt))
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{pt}: not JSON ({exc.msg})") from None
    try:
        args = records[0]["benchmark"]["extra_info"]["args"]
    except (KeyError, IndexError, TypeError):
        args = None
    if not isinstance(args, dict):
        raise CalibrationError(
            f"{pt}: field '[0].benchmark.extra_info.args' missing or not an object "
            "(not vLLM's SAVE_TO_PYTORCH_BENCHMARK_FORMAT record)"
        )
    return args


_LATENCY_ARGS = {"batch": ("batch_size", 1), "input": ("input_len", 0), "output": ("output_len", 1)}


def _vllm_latency(obj: dict, where: str, path: str, sel: dict[str, int]) -> EnginePoint:
    pt = Path(path).with_suffix(".pytorch.json")  # what latency.py names it: splitext(F)[0]
    a = _pytorch_args(pt) if pt.exists() else {}
    if a.get("speculative_config"):
        raise CalibrationError(
            f"{path}: a latency run with speculation: its step count depends on acceptance; "
            "use `vllm bench serve --save-result` at fixed K for drafter points"
        )
    recorded = {
        key: (
            f"{pt.name} {field}",
            None
            if a.get(field) is None
            else int(_num(a, field, str(pt), lo, integer=True, name=f"args.{field}")),
        )
        for key, (field, lo) in _LATENCY_ARGS.items()
    }
    args = _fill(where, sel, "vllm bench latency", recorded)
    names = {"batch": "batch size", "input": "input length", "output": "output length"}
    missing = [names[key] for key in names if args[key] is None]
    missing[-2:] = [" or ".join(missing[-2:])] if missing else []
    if missing:
        beside = (
            f"{pt.name} beside it lacks them"
            if pt.exists()
            else f"or keep the {pt.name} that SAVE_TO_PYTORCH_BENCHMARK_FORMAT=1 writes beside it"
        )
        raise CalibrationError(
            f"{where}: vllm bench latency output names no {', '.join(missing)}; write it as "
            f"{path}#batch=B&input=I&output=O ({beside})"
        )
    lat = obj["latencies"]
    if not isinstance(lat, list) or not lat:
        raise CalibrationError(f"{where}: field 'latencies' must be a non-empty list of seconds")
    for i in range(len(lat)):
        _num(lat, i, where, above=0, name=f"latencies[{i}]")
    step = float(np.median(lat)) / args["output"] * 1e3
    return EnginePoint(where, args["batch"], 0, args["input"] + args["output"] / 2, step)


# vLLM writes these together, only for a run that drafted tokens (vllm/benchmarks/serve.py)
_VLLM_SPEC = (
    "spec_decode_num_drafts",
    "spec_decode_draft_tokens",
    "spec_decode_accepted_tokens",
    "spec_decode_acceptance_length",
    "spec_decode_acceptance_rate",
)


def _vllm_k(obj: dict, where: str) -> tuple[int, float]:
    """(K, acceptance length) of a vllm bench serve result; (0, 1) without the spec_decode_ fields.
    One of them missing leaves K unknown, and a TPOT is per token, not per step: refused."""
    if not any(key in obj for key in _VLLM_SPEC):
        return 0, 1.0
    why = "vLLM writes the spec_decode_* fields together; K = draft tokens / drafts"
    drafts = _num(obj, "spec_decode_num_drafts", where, 1, integer=True, why=why)
    tokens = _num(obj, "spec_decode_draft_tokens", where, drafts, integer=True, why=why)
    k = round(tokens / drafts)
    if tokens != k * drafts:
        raise CalibrationError(f"{where}: drafts per step varied; calibrate on runs at one fixed K")
    accept = _num(
        obj,
        "spec_decode_acceptance_length",
        where,
        1,
        k + 1,
        why=f"an acceptance length lies in [1, K + 1], K = {k}",
    )
    return k, accept


def _sglang_k(obj: dict, where: str) -> tuple[str, int | None]:
    """(field, K) from bench_serving's server_info (the server's /server_info: its arguments);
    K None where server_info is null (the request failed), 0 without speculation."""
    info, name = obj.get("server_info"), "server_info"
    if info is None:
        return name, None
    if isinstance(info, dict) and "decode" in info:
        # a PD-disaggregated router's {"prefill": [...], "decode": [...]}: the decode servers
        # speculate; serving.py reads server_info["decode"][0] as well
        dec = info["decode"]
        if not isinstance(dec, list) or not dec or not isinstance(dec[0], dict):
            raise CalibrationError(
                f"{where}: field 'server_info.decode' must be a non-empty list of server infos"
            )
        info, name = dec[0], "server_info.decode[0]"
    if not isinstance(info, dict):
        raise CalibrationError(
            f"{where}: field 'server_info' must be an object or null, got {type(info).__name__}"
        )
    if not info.get("speculative_algorithm"):
        return f"{name}.speculative_algorithm", 0
    steps = f"{name}.speculative_num_steps"
    return steps, int(_num(info, "speculative_num_steps", where, 1, integer=True, name=steps))


def _serve(obj: dict, where: str, path: str, sel: dict[str, int], engine: str) -> EnginePoint:
    conc = _num(
        obj, "max_concurrency", where, 1, integer=True, why="run the bench with --max-concurrency"
    )
    tpot = _num(obj, "median_tpot_ms", where, above=0)
    done = _num(obj, "completed", where, 1, integer=True)
    context = (
        _num(obj, "total_input_tokens", where, 0, integer=True) / done
        + _num(obj, "total_output_tokens", where, 0, integer=True) / done / 2
    )
    if engine == "vllm":
        _fill(where, sel, "vllm bench serve", {})
        k, accept = _vllm_k(obj, where)
    else:
        field, recorded = _sglang_k(obj, where)
        k = _fill(where, sel, "sglang bench_serving", {"k": (field, recorded)})["k"] or 0
        if k:
            why = f"an acceptance length lies in [1, K + 1], K = {k}"
            accept = _num(obj, "accept_length", where, 1, k + 1, why=why)
        else:
            if obj.get("accept_length") not in (None, 1):  # SGLang reports it only when speculating
                _num(obj, "accept_length", where)
                raise CalibrationError(
                    f"{where}: field 'accept_length' is {obj['accept_length']} but {field} gives "
                    f"no K (if the server speculated at K steps, write it as {path}#k=K)"
                )
            accept = 1.0
    return EnginePoint(where, int(conc), k, context, tpot * accept)


def _sglang_one_batch(obj: dict, where: str, sel: dict[str, int]) -> EnginePoint:
    _fill(where, sel, "sglang bench_one_batch", {})
    b = _num(obj, "batch_size", where, 1, integer=True)
    step = _num(obj, "median_decode_latency", where, above=0) * 1e3
    context = (
        _num(obj, "input_len", where, 0, integer=True)
        + _num(obj, "output_len", where, 1, integer=True) / 2
    )
    return EnginePoint(where, int(b), 0, context, step)


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
    fill = _fill(where, sel, "vLLM dynamic-SD profile", {"context": ("context", None)})
    context = fill["context"]
    if context is None:
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
            ms = _num(row, kkey, f"{where}: batch_stats[{bkey!r}]", above=0)
            out.append(EnginePoint(f"{where}#batch={b}&k={k}", b, k, float(context), ms))
    return out


def _points(obj: Any, where: str, path: str, sel: dict[str, int]) -> list[EnginePoint]:
    if not isinstance(obj, dict):
        raise CalibrationError(f"{where}: expected a JSON object")
    if "batch_stats" in obj:
        return _vllm_dynamic_sd(obj, where, sel)
    if "median_decode_latency" in obj:
        return [_sglang_one_batch(obj, where, sel)]
    if "avg_latency" in obj and "latencies" in obj:
        return [_vllm_latency(obj, where, path, sel)]
    if "median_tpot_ms" in obj:
        engine = "sglang" if "accept_length" in obj or "server_info" in obj else "vllm"
        return [_serve(obj, where, path, sel, engine)]
    raise CalibrationError(
        f"{where}: not a vllm bench latency/serve, vLLM dynamic-SD profile or sglang "
        "bench_one_batch/bench_serving result (no avg_latency, median_tpot_ms, "
        "batch_stats or median_decode_latency)"
    )


def read_engine_results(spec: str) -> list[EnginePoint]:
    """One result file (JSON or JSONL, format detected by its fields) -> decode-step points;
    ``F#key=V&...`` fills in what F does not record (module docstring). A bad field, an unforeseen
    layout or a file with no result in it is a CalibrationError naming the file (and the field)."""
    path, sel = _selector(spec)
    text = _read_text(path)
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
        try:
            out.extend(_points(obj, where, path, sel))
        except CalibrationError:
            raise
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, OverflowError) as exc:
            # the net under the field checks: a layout they did not foresee is still one line
            raise CalibrationError(
                f"{where}: unexpected layout ({type(exc).__name__}: {exc})"
            ) from None
    if not out:
        raise CalibrationError(f"{path}: no result in it (an empty file)")
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
    params = m.scaled(weight=w, token=t, drafter=d, overhead=t)
    params = replace(params, overhead=replace(
        params.overhead, source=f"calibrated to {n_points} engine results (scales weight {w:.3f}, token {t:.3f}, "
        f"drafter {d:.3f})"))
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
