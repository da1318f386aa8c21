"""``spectune profile``: facts, models, the measurement study, the fit, and the two output files.

Outputs, both written atomically: the profile YAML (:func:`spectune.runtime.table.write_table`) and
the full measurement table as CSV beside it (``<out>.csv``); the Optuna journal sits beside them
(``<out>.journal``) unless a storage URL is given.

Overhead points time the device-side packing of one step (the capturable ``pack`` kernel on CUDA,
its torch reference on CPU); the profile's ``costs.model.overhead.source`` says which.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import torch

from spectune.autotune.hardware import gpu_slug, hardware_facts, parse_device, software_facts
from spectune.autotune.measurement_study import (
    GRACE_S,
    HEARTBEAT_S,
    PointSpec,
    StudyHandle,
    StudyPlan,
    StudyResult,
    collect,
    load_for_collect,
    open_study,
    stored_identity,
    study_name_for,
    work,
)
from spectune.errors import SpectuneError
from spectune.io import atomic_write_text
from spectune.runtime.table import (
    DTYPES,
    MAX_BATCH,
    SCHEMA,
    CapturePoint,
    Costs,
    Hardware,
    Point,
    Table,
    Workload,
    table_from_dict,
    table_to_yaml,
    write_table,
)


@dataclass(frozen=True)
class Defaults:
    dtype: str
    batch_sizes: str
    max_k: int
    context_len: int
    trials: int  # adaptive trials beyond the seed grid


# CPU: ~75 points of the tiny preset; GPU: ~130 points (each a graph capture + >= 20 replays)
CPU_DEFAULTS = Defaults(dtype="float32", batch_sizes="1-16", max_k=7, context_len=256, trials=8)
GPU_DEFAULTS = Defaults(dtype="bfloat16", batch_sizes="1-256", max_k=15, context_len=2048, trials=16)


class ProfileError(SpectuneError):
    """Bad profile settings (the message names the option)."""


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``1-256`` | ``1,2,4,8`` | ``1-8,16,32`` -> sorted distinct sizes (each >= 1)."""
    sizes: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ProfileError(f"--batch-sizes: cannot read {part!r} in {text!r} (e.g. 1-256, 1,2,4,8, 1-8,16,32)")
        lo = int(m[1])
        hi = int(m[2]) if m[2] is not None else lo
        if lo < 1 or hi < lo:
            raise ProfileError(f"--batch-sizes: {part!r} must be sizes >= 1 with lo <= hi")
        if hi > MAX_BATCH:
            raise ProfileError(f"--batch-sizes: {hi} exceeds {MAX_BATCH}")
        sizes.update(range(lo, hi + 1))
    return tuple(sorted(sizes))


DEFAULT_TARGET = "tiny"
DEFAULT_DRAFTER = "eagle-1l"


@dataclass(frozen=True)
class ProfileConfig:
    target: str | None = None  # default DEFAULT_TARGET (or the joined study's)
    drafter: str | None = None  # default DEFAULT_DRAFTER (or the joined study's)
    device: str | None = None  # cuda, cuda:N or cpu; default cuda when present
    dtype: str | None = None  # default bfloat16 on CUDA, float32 on CPU
    batch_sizes: str | tuple[int, ...] | None = None
    max_k: int | None = None
    context_len: int | None = None
    out: str | None = None
    storage: str | None = None  # Optuna URL or journal path; default <out>.journal
    study_name: str | None = None
    trials: int | None = None  # adaptive trials beyond the seed grid
    held_out: int = 12
    seed: int | None = None  # default 0 (or the joined study's)
    progress: bool = True
    workers: int = 1  # local worker processes sharing the study (0: one per visible GPU, 1 on CPU)
    collect: bool = False  # measure nothing: fit and write the finished study
    timing_lock: str = "auto"  # per-GPU lock around timed stretches: auto (on CUDA), on, off
    fused: bool = False  # target and drafter layers with the fused kernels (kernels/fused.py)


@dataclass(frozen=True)
class Resolved:
    config: ProfileConfig
    device: torch.device
    dtype: str
    batch_sizes: tuple[int, ...]
    max_k: int
    context_len: int
    trials: int
    out: Path
    storage: str

    @property
    def target(self) -> str:
        return self.config.target or DEFAULT_TARGET

    @property
    def drafter(self) -> str:
        return self.config.drafter or DEFAULT_DRAFTER

    @property
    def seed(self) -> int:
        return self.config.seed or 0


def resolve(config: ProfileConfig) -> Resolved:
    """Fill defaults for the device and check every setting (before anything is built or written)."""
    config = replace(config, target=config.target or DEFAULT_TARGET, drafter=config.drafter or DEFAULT_DRAFTER,
                     seed=0 if config.seed is None else config.seed)
    if config.timing_lock not in ("auto", "on", "off"):
        raise ProfileError(f"--timing-lock: must be auto, on or off, got {config.timing_lock!r}")
    if config.workers < 0:
        raise ProfileError(f"--workers: must be >= 1 (or auto), got {config.workers}")
    if config.collect and not (config.storage and config.study_name):
        raise ProfileError("--collect: needs --storage and --study-name (the study to fit)")
    device = parse_device(config.device, ProfileError)
    d = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    bs = config.batch_sizes if config.batch_sizes is not None else d.batch_sizes
    sizes = parse_batch_sizes(bs) if isinstance(bs, str) else tuple(sorted(set(bs)))
    if not sizes or sizes[0] < 1:
        raise ProfileError("--batch-sizes: must be sizes >= 1")
    max_k = int(config.max_k if config.max_k is not None else d.max_k)
    context = int(config.context_len if config.context_len is not None else d.context_len)
    trials = int(config.trials if config.trials is not None else d.trials)
    if not 1 <= max_k <= 64:
        raise ProfileError(f"--max-k: must be in 1..64, got {max_k}")
    if context < 1:
        raise ProfileError(f"--context-len: must be >= 1, got {context}")
    if trials < 0:
        raise ProfileError(f"--trials: must be >= 0, got {trials}")
    dtype = config.dtype or d.dtype
    if dtype not in DTYPES:
        raise ProfileError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(config.out) if config.out else None
    if out is None:
        target = config.target or DEFAULT_TARGET
        name = Path(target).name or target
        out = (Path("profiles") / f"{{gpu}}_{name}_{config.drafter}.yaml" if device.type == "cuda"
               else Path(f"spectune-{name}-{config.drafter}.yaml"))
    storage = config.storage or str(out) + ".journal"
    return Resolved(config, device, dtype, sizes, max_k, context, trials, out, storage)


# ---------------------------------------------------------------------------------------------
# steps


def overhead_step(*, batch: int, tokens: int, max_k: int, context_len: int, device: torch.device) -> Any:
    """Pack ``batch`` requests into ``tokens`` rows (1 real token + drafts each): the per-step
    device work the runtime adds around the target graph."""
    from spectune.kernels.pack import PackedBatch, pack, pack_ref
    from spectune.models.build import StepFn, even_split

    k = max(1, max_k)
    gen = torch.Generator(device=device).manual_seed(batch * 7919 + tokens)
    last = torch.empty(batch, dtype=torch.long, device=device)  # [B]
    drafts = torch.empty(batch, k, dtype=torch.long, device=device)  # [B, K]
    grant = torch.tensor([min(g, k) for g in even_split(max(tokens - batch, 0), batch)], dtype=torch.int32,
                         device=device)  # [B]
    ctx = torch.full((batch,), context_len, dtype=torch.int32, device=device)  # [B]
    block = 16
    blocks = -(-(context_len + k + 1) // block)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)  # [B, max_blocks]
    out = PackedBatch.empty(batch, tokens, device)

    def refresh() -> None:
        last.random_(1, 1 << 15, generator=gen)
        drafts.random_(1, 1 << 15, generator=gen)

    def run() -> object:
        if device.type == "cuda":
            return pack(last, drafts, grant, ctx, tables, block, tokens, out=out)
        return pack_ref(last, drafts, grant, ctx, tables, block, tokens)

    refresh()
    return StepFn(run=run, refresh=refresh, tokens=tokens, batch=batch, label=f"overhead b={batch} n={tokens}")


def model_point_factory(r: Resolved) -> Callable[[PointSpec], Any]:
    """Build the models once; return ``measure_point(spec) -> StepFn``."""
    from spectune.models.build import build_models
    from spectune.models.config import parse_drafter, parse_dtype, resolve_target

    target, drafter = resolve_target(r.target), parse_drafter(r.drafter)
    dtype, fp8 = parse_dtype(r.dtype)
    models = build_models(target, drafter, device=r.device, dtype=dtype, max_batch=r.batch_sizes[-1],
                          max_q=r.max_k + 1, context_len=r.context_len, seed=r.seed, fp8=fp8,
                          fused=r.config.fused)

    def measure_point(spec: PointSpec) -> Any:
        if spec.kind == "target":
            return models.target_step(batch=spec.batch, q=spec.q or 1)
        if spec.kind == "tier":
            return models.tier_step(tier=spec.tokens, batch=spec.batch)
        if spec.kind == "drafter":
            return models.drafter_step(batch=spec.batch, k=spec.k or 1)
        return overhead_step(batch=spec.batch, tokens=spec.tokens, max_k=r.max_k,
                             context_len=r.context_len, device=r.device)

    return measure_point


# ---------------------------------------------------------------------------------------------
# outputs


def measurements_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    cols = ["key", "phase", "kind", "batch", "tokens", "q", "k", "held_out", "feasible", "ms", "p20_ms",
            "p80_ms", "reps", "mode", "capture_s", "capture_mib", "joules", "power_w", "max_power_w",
            "sm_clock_mhz", "throttle", "throttle_names", "gpu", "gpu_uuid", "worker", "lock_wait_s", "error"]
    rows = [{c: (";".join(r[c]) if c == "throttle_names" and r.get(c) else r.get(c)) for c in cols} for r in records]
    return pd.DataFrame(rows, columns=cols)


def _points(records: list[dict[str, Any]]) -> list[Point]:
    def opt(v: Any, kind: type) -> Any:
        return None if v is None else kind(v)

    return [
        Point(kind=r["kind"], batch=int(r["batch"]), tokens=int(r["tokens"]), ms=opt(r.get("ms"), float),
              q=opt(r.get("q"), int), k=opt(r.get("k"), int), joules=opt(r.get("joules"), float),
              power_w=opt(r.get("power_w"), float), sm_clock_mhz=opt(r.get("sm_clock_mhz"), int),
              throttle=opt(r.get("throttle"), int), held_out=bool(r.get("held_out")))
        for r in records
    ]


def _capture(records: list[dict[str, Any]]) -> list[CapturePoint]:
    return [
        CapturePoint(tokens=int(r["tokens"]), seconds=float(r["capture_s"]), mib=float(r["capture_mib"]))
        for r in records
        if r["kind"] == "tier" and r.get("feasible") and r.get("capture_s") is not None
        and r.get("capture_mib") is not None
    ]


def _attention_name(device: torch.device, fused: bool = False) -> str:
    """What the target was timed with, for the table: triton_paged / torch_folded, ``+fused``
    when its layers ran the fused kernels."""
    from spectune.models.build import ATTENTION_NAMES, resolve_attention

    return ATTENTION_NAMES[resolve_attention("auto", device)] + ("+fused" if fused else "")


def build_table(r: Resolved, hardware: Hardware, result: StudyResult, csv_name: str | None,
                attention: str | None = None) -> Table:
    from spectune.models.config import parse_drafter

    drafter = parse_drafter(r.drafter)
    mode: Literal["cuda-graph", "wall-clock", "fake"] = "wall-clock"
    if result.timer_mode in ("cuda-graph", "fake"):
        mode = result.timer_mode  # type: ignore[assignment]
    return Table(
        schema=SCHEMA,
        hardware=hardware,
        software=software_facts(),
        workload=Workload(
            target=Path(r.target).name or r.target, drafter=drafter.name,
            drafter_kind=drafter.kind, drafter_layers=drafter.n_layers, dtype=r.dtype,  # type: ignore[arg-type]
            context_len=r.context_len, max_k=r.max_k, max_batch=r.batch_sizes[-1],
            device="cuda" if r.device.type == "cuda" else "cpu",
            attention=attention or _attention_name(r.device, r.config.fused),
        ),
        costs=Costs(model=result.params, error=result.error, timer=mode, capture=_capture(result.records),
                    points=_points(result.records), measurements=csv_name),
        created=datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
    )


def write_outputs(table: Table, frame: pd.DataFrame, out: Path) -> None:
    """Validate the table, then write the CSV and the YAML (each atomically)."""
    table_from_dict(__import__("yaml").safe_load(table_to_yaml(table)), out)
    buf = io.StringIO()
    frame.to_csv(buf, index=False)
    atomic_write_text(out.with_suffix(".csv"), buf.getvalue())
    write_table(table, out)


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Everything a worker of this profile needs, resolved once."""

    r: Resolved
    plan: StudyPlan
    name: str  # study name
    identity: dict[str, Any]  # the profile's part of the study identity (the plan adds the rest)
    hardware: Hardware


def adopt_study(config: ProfileConfig) -> ProfileConfig:
    """Joining a named study: every workload option left unset is the study's."""
    if not (config.storage and config.study_name):
        return config
    ident = stored_identity(config.storage, config.study_name)
    if not ident:
        return config
    fill = {"target": ident.get("target"), "drafter": ident.get("drafter"), "dtype": ident.get("dtype"),
            "batch_sizes": ident.get("batch_sizes"), "max_k": ident.get("max_k"),
            "context_len": ident.get("context_len"), "trials": ident.get("trials"), "seed": ident.get("seed")}
    return replace(config, **{k: v for k, v in fill.items() if getattr(config, k) is None and v is not None})


def setup(config: ProfileConfig) -> Setup:
    from spectune.models.config import parse_drafter, resolve_target

    r = resolve(adopt_study(config))
    target = resolve_target(r.target)  # bad names fail here, before any file is touched
    drafter = parse_drafter(r.drafter)
    hardware = hardware_facts(r.device)
    if "{gpu}" in str(r.out):
        r = replace(r, out=Path(str(r.out).replace("{gpu}", gpu_slug(hardware))))
        if config.storage is None:
            r = replace(r, storage=str(r.out) + ".journal")
    plan = StudyPlan(
        batch_sizes=r.batch_sizes, max_k=r.max_k, drafter_kind=drafter.kind, context_len=r.context_len,
        adaptive_trials=r.trials, held_out=r.config.held_out, seed=r.seed,
        overhead_source="pack-kernel" if r.device.type == "cuda" else "pack-reference",
    )
    name = r.config.study_name or study_name_for(hardware.gpu, target.name, drafter.name, r.dtype,
                                                 r.context_len, r.max_k)
    identity: dict[str, Any] = {"target": target.name, "drafter": drafter.name, "dtype": r.dtype,
                                "device": r.device.type, "gpu": hardware.gpu,
                                "attention": _attention_name(r.device, r.config.fused)}
    if r.config.fused:  # absent when off: studies measured before the option keep their identity
        identity["fused"] = True
    return Setup(r, plan, name, identity, hardware)


def measure_for_study(s: Setup, *, timer: Callable[[Any], Any] | None = None,
                      measure_point: Callable[[PointSpec], Any] | None = None, power: Any = None,
                      heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> tuple[StudyHandle, int]:
    """One worker: join the study and measure points on this process's device until it is complete."""
    from spectune.autotune.timing_lock import open_timing_lock

    r = s.r
    gpu_info: dict[str, Any] = {"name": s.hardware.gpu}
    if r.device.type == "cuda":
        from spectune.autotune.nvml import NvmlSampler, nvml_index

        index = nvml_index(r.device.index or 0)
        if power is None:
            power = NvmlSampler(index)
        gpu_info = power.identity() if hasattr(power, "identity") else gpu_info
    gpu_lock = open_timing_lock(r.config.timing_lock, gpu_info, r.device.index or 0, r.device.type == "cuda")
    h = open_study(s.plan, storage=r.storage, study_name=s.name, identity=s.identity,
                   hardware=asdict(s.hardware), heartbeat_s=heartbeat_s, grace_s=grace_s)
    if measure_point is None:
        # the weights' random fills run kernels: built under the lock, finished before it is let go
        with gpu_lock.held() if gpu_lock is not None else contextlib.nullcontext(0.0):
            measure_point = model_point_factory(r)
            if r.device.type == "cuda":
                torch.cuda.synchronize(r.device)
    if timer is None:
        from spectune.autotune.timing import WallClockTimer, default_timer

        # CPU figures only exercise the pipeline: fewer eager reps keep the default run short
        timer = default_timer(r.device) if r.device.type == "cuda" else WallClockTimer(warmup=1, reps=6, batches=2)
    threads = torch.get_num_threads()
    if r.device.type == "cpu":
        # tiny eager steps: one thread avoids oversubscription noise on shared CPUs
        torch.set_num_threads(1)
    try:
        n = work(h, measure_point, timer, power=power, gpu=s.hardware.gpu, gpu_info=gpu_info,
                 progress=r.config.progress and r.config.workers <= 1, gpu_lock=gpu_lock)
    finally:
        torch.set_num_threads(threads)
    return h, n


def run_profile(
    config: ProfileConfig,
    *,
    timer: Callable[[Any], Any] | None = None,
    measure_point: Callable[[PointSpec], Any] | None = None,
    power: Any = None,
    write: bool = True,
    heartbeat_s: int = HEARTBEAT_S,
    grace_s: int = GRACE_S,
) -> tuple[Table, pd.DataFrame]:
    """Measure (``config.workers`` processes), fit and (unless ``write=False``) write the profile;
    returns the table and the measurement frame (``frame.attrs["study"]``: name, points kept from
    an earlier run, measured now, given up). ``timer``/``measure_point``/``power`` replace the real
    harness (tests; they must pickle for several workers)."""
    if config.collect:
        return collect_profile(config, write=write)
    s = setup(config)
    if s.r.config.workers != 1:
        from spectune.autotune.profile_workers import run_local_workers

        h, n = run_local_workers(s, timer=timer, measure_point=measure_point, heartbeat_s=heartbeat_s,
                                 grace_s=grace_s)
    else:
        h, n = measure_for_study(s, timer=timer, measure_point=measure_point, power=power,
                                 heartbeat_s=heartbeat_s, grace_s=grace_s)
    return _finish(s.r, s.hardware, collect(h, n), write, s.identity["attention"])


def collect_profile(config: ProfileConfig, *, write: bool = True) -> tuple[Table, pd.DataFrame]:
    """``--collect``: fit the finished study in ``--storage``/``--study-name`` and write its profile
    (workload and hardware are the study's, not this machine's)."""
    resolve(config)  # option checks
    h, ident, hw = load_for_collect(config.storage, config.study_name)  # type: ignore[arg-type]
    hardware = Hardware(**hw) if hw else Hardware(gpu=str(ident.get("gpu")))
    target, drafter = str(ident["target"]), str(ident["drafter"])
    out = Path(config.out) if config.out else (
        Path("profiles") / f"{gpu_slug(hardware)}_{target}_{drafter}.yaml" if ident["device"] == "cuda"
        else Path(f"spectune-{target}-{drafter}.yaml"))
    p = h.plan
    r = Resolved(replace(config, target=target, drafter=drafter, seed=p.seed), torch.device(ident["device"]),
                 str(ident["dtype"]), p.batch_sizes, p.max_k, p.context_len, p.adaptive_trials, out,
                 str(config.storage))
    return _finish(r, hardware, collect(h), write, ident.get("attention"))


def _finish(r: Resolved, hardware: Hardware, result: StudyResult, write: bool,
            attention: str | None) -> tuple[Table, pd.DataFrame]:
    frame = measurements_frame(result.records)
    frame.attrs["study"] = {"name": result.study_name, "kept": result.kept, "measured_now": result.measured_now,
                            "given_up": list(result.given_up), "storage": r.storage, "out": str(r.out)}
    table = build_table(r, hardware, result, r.out.with_suffix(".csv").name, attention)
    if write:
        write_outputs(table, frame, r.out)
    return table, frame


def default_out(config: ProfileConfig) -> Path:
    """Where ``run_profile`` writes for this config (GPU name filled in)."""
    r = resolve(config)
    if "{gpu}" in str(r.out):
        return Path(str(r.out).replace("{gpu}", gpu_slug(hardware_facts(r.device))))
    return r.out
