"""Launch configurations of the verification-attention kernel (``spectune.kernels.attention``).

A configuration depends on three static sizes of a step, its **bucket**:
    head_dim
    rows      = G * max_q, query rows per kv head (G = H / Hkv query heads share one KV read)
    programs  = batch * n_kv_heads, (request, kv head) programs before any KV split
Tuned tables are JSON files under ``configs/`` named by the device (``NVIDIA_H200.json``), written
by ``benchmarks/bench_verify_attention.py --sweep``, loaded once, and searched for the nearest
bucket (same head_dim, then nearest rows, then nearest programs, both in log2). A GPU without a
table, or a head_dim the table lacks, gets ``heuristic_config``. ``SPECTUNE_ATTENTION_CONFIGS=<file>`` replaces the
packaged table (to try a freshly swept one before shipping it).

Why the heuristics look the way they do (Triton on sm_80/sm_90, flash-attention shaped kernel):
the two chained ``tl.dot`` of a tile put all warps along M when M >= BLOCK_N, and along N
otherwise, which turns every row max / row sum into a cross-warp reduction. On sm_90 a tile of
M % 64 == 0 rows with 4 warps runs on wgmma with each warp owning 16 rows; 8 warps need M >= 128.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from spectune.errors import SpectuneError

TABLE_FORMAT = "spectune-attention-configs/1"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
TABLE_ENV = "SPECTUNE_ATTENTION_CONFIGS"
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
MAX_BLOCK_M = 256  # rows of one query tile; more rows are cut into several tiles
MIN_SPLIT_TOKENS = 128  # a split reads at least this many KV positions
MAX_SPLITS = 16
AUTO = 0  # block_m / num_splits value meaning "derive from the step's sizes"
# a 64 x 32 tile of 4 warps holds 3 CTAs an SM at the 148-160 registers sm_90 gives it, 4 at 128
# (its 48 KiB of shared memory allow 4), where it compiles without spills (attention_resources.py);
# the 64 x 64 tile's 80 KiB allow only 2, which is why a cap there (168, 2026-12-02) gained nothing
CAPPED_REGS = 128


class ConfigTableError(SpectuneError):
    """A kernel config or config table is invalid; the message names the file and field."""


def _pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class AttnConfig:
    block_n: int = 64  # KV positions per tile
    num_warps: int = 4
    num_stages: int = 2
    block_m: int = AUTO  # query rows per program; AUTO: all G * max_q rows, padded to a power of 2
    num_splits: int = AUTO  # KV splits per (request, kv head); AUTO: choose_num_splits
    lazy: int = 0  # 1: whole tiles move the running max only past 2^8 (``attention.LAZY_LOG2``)
    max_regs: int = AUTO  # registers a thread may use (ptx .maxnreg); AUTO: the compiler's choice

    def __post_init__(self) -> None:
        rules = (
            ("block_n", _pow2(self.block_n) and 16 <= self.block_n <= 256, "a power of 2 in 16..256"),
            ("num_warps", self.num_warps in (1, 2, 4, 8, 16), "one of 1, 2, 4, 8, 16"),
            ("num_stages", 1 <= self.num_stages <= 8, "in 1..8"),
            ("block_m", self.block_m == AUTO or (_pow2(self.block_m) and MIN_BLOCK_M <= self.block_m
                                                 <= MAX_BLOCK_M), f"0 or a power of 2 in {MIN_BLOCK_M}..{MAX_BLOCK_M}"),
            ("num_splits", 0 <= self.num_splits <= 64, "in 0..64"),
            ("lazy", self.lazy in (0, 1), "0 or 1"),
            ("max_regs", self.max_regs == AUTO or 32 <= self.max_regs <= 255, "0 or in 32..255"),
        )
        for name, ok, want in rules:
            if not ok or not isinstance(getattr(self, name), int):
                raise ConfigTableError(f"config.{name}: must be {want}, got {getattr(self, name)!r}")

    def short(self) -> str:
        m = f"m{self.block_m}" if self.block_m else "m*"
        s = f"s{self.num_splits}" if self.num_splits else "s*"
        return (f"{m}/n{self.block_n}/{self.num_warps}w/{self.num_stages}st/{s}" + ("/lazy" if self.lazy else "")
                + (f"/r{self.max_regs}" if self.max_regs else ""))


INTERPRETER_CONFIG = AttnConfig(block_n=16, num_warps=1, num_stages=1)


def natural_block_m(rows: int) -> int:
    """One tile holding every query row of a kv head: the next power of 2, at least 16."""
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, next_pow2(rows)))


def choose_num_splits(programs: int, n_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Static split count: enough (request, kv head, split) programs to cover the SMs twice when
    ``programs`` x kv heads alone would leave them idle, each split keeping >= MIN_SPLIT_TOKENS.
    (``programs`` counts requests, or requests x query tiles.)"""
    total = programs * n_kv_heads
    if total >= num_sms:
        return 1
    wanted = -(-2 * num_sms // total)
    by_len = max(1, max_kv_len // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_len, MAX_SPLITS))


def heuristic_config(rows: int, head_dim: int, capability: tuple[int, int] = (9, 0)) -> AttnConfig:
    """Defaults for a GPU without a tuned table (see the module notes for the reasoning)."""
    m = natural_block_m(rows)
    if head_dim > 128:  # big accumulator: smaller KV tiles, more warps once M allows it
        return AttnConfig(32, 4 if m <= 64 else 8, 2, block_m=min(m, 128))
    if m <= 16:
        return AttnConfig(64, 4, 2)
    if m == 32:
        if capability >= (9, 0):  # pad to 64 rows: wgmma, one warpgroup with warps along M
            return AttnConfig(64, 4, 2, block_m=64)
        return AttnConfig(32, 2, 3)  # two warps along M, 16 rows each
    if m == 64:
        if capability >= (9, 0):  # 32-key tiles at CAPPED_REGS: 4 CTAs an SM, the H200 sweep's winner
            return AttnConfig(32, 4, 2, block_m=64, max_regs=CAPPED_REGS)  # (1.07-1.10x q = 1 at q = 16)
        return AttnConfig(64, 4, 2)
    return AttnConfig(64, 8, 2, block_m=128)  # 128 / 256 rows: 128-row tiles, 8 warps along M


@functools.cache
def device_facts(device: torch.device) -> tuple[str, tuple[int, int], int]:
    """(name, compute capability, SM count) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return props.name, (props.major, props.minor), props.multi_processor_count


def num_sms(device: torch.device) -> int:
    return device_facts(device)[2] if device.type == "cuda" else 1


def default_config(device: torch.device, rows: int, head_dim: int, programs: int = 1) -> AttnConfig:
    """Launch config for ``rows = G * max_q`` query rows per kv head and ``programs = batch x
    kv heads``: the device's tuned table (nearest bucket) if it has one, else the heuristic;
    the interpreter config off CUDA."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return _cuda_config(*device_facts(device), rows, head_dim, programs)


@functools.lru_cache(maxsize=1024)
def _cuda_config(name: str, capability: tuple[int, int], sms: int, rows: int, head_dim: int,
                 programs: int) -> AttnConfig:
    table = table_for_device(name)
    found = table.lookup(head_dim, rows, programs, sms) if table is not None else None
    return found or heuristic_config(rows, head_dim, capability)


# ---------------------------------------------------------------------------------------------
# Tuned tables


@dataclass(frozen=True)
class TableEntry:
    head_dim: int
    rows: int  # G * max_q the winner was measured at
    programs: int  # batch * n_kv_heads it was measured at
    config: AttnConfig


@dataclass(frozen=True)
class ConfigTable:
    device_name: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"
    sm_count: int
    entries: tuple[TableEntry, ...]
    source: str = ""  # how the table was made (free text)

    def lookup(self, head_dim: int, rows: int, programs: int, num_sms: int) -> AttnConfig | None:
        """Config of the nearest bucket, its split count rescaled to ``programs``."""
        entry = nearest_entry(self.entries, head_dim, rows, programs)
        if entry is None:
            return None
        cfg = entry.config
        splits = rescale_splits(cfg.num_splits, entry.programs, programs, num_sms)
        return cfg if splits == cfg.num_splits else _replace(cfg, num_splits=splits)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TABLE_FORMAT, "device_name": self.device_name, "sm_count": self.sm_count,
            "source": self.source,
            "configs": [{"head_dim": e.head_dim, "rows": e.rows, "programs": e.programs,
                         **{k: v for k, v in asdict(e.config).items() if k not in OPTIONAL or v}}
                        for e in self.entries],
        }


    def to_json(self) -> str:
        """JSON text, one config per line (a re-tuned table diffs line by line)."""
        d = self.to_dict()
        head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items() if k != "configs")
        body = ",\n".join("  " + json.dumps(c) for c in d["configs"])
        return "{\n" + head + ',\n "configs": [\n' + body + "\n ]\n}\n"


def _replace(cfg: AttnConfig, **changes: int) -> AttnConfig:
    return AttnConfig(**{**asdict(cfg), **changes})


def _log_gap(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))


def nearest_entry(entries: tuple[TableEntry, ...], head_dim: int, rows: int,
                  programs: int) -> TableEntry | None:
    """Among entries of this head_dim (None if there are none): the smallest rows bucket that
    holds ``rows`` (a smaller bucket's query tile would split the rows over several tiles, each
    re-reading the request's KV), else the largest; then nearest programs in log2, ties to the
    smaller bucket."""
    pool = [e for e in entries if e.head_dim == head_dim]
    if not pool:
        return None
    covering = [e for e in pool if e.rows >= rows]
    bucket = min(e.rows for e in covering) if covering else max(e.rows for e in pool)
    pool = [e for e in pool if e.rows == bucket]
    return min(pool, key=lambda e: (_log_gap(e.programs, programs), e.programs))


def rescale_splits(splits: int, bucket_programs: int, programs: int, num_sms: int) -> int:
    """A winner's split count moved to another program count: a split winner keeps its total
    number of programs; an unsplit one stays unsplit while the GPU is full, else AUTO."""
    if splits == AUTO:
        return AUTO
    if splits == 1:
        return 1 if programs >= num_sms else AUTO
    return max(1, min(MAX_SPLITS, -(-splits * bucket_programs // max(programs, 1))))


_ENTRY_KEYS = {"head_dim", "rows", "programs"} | {f.name for f in fields(AttnConfig)}
OPTIONAL = ("lazy", "max_regs")  # config fields a table names only when set (older tables lack them)
# the kernel's former loop variants (removed: they lost to the plain loop on the H200; branch
# attn16 keeps them); a table naming one is refused with this reason
_REMOVED_KEYS = {"variant": "the kernel's loop variants were removed"}
_TABLE_KEYS = {"format", "device_name", "sm_count", "source", "configs"}


def table_head(data: Any, where: str, table_format: str) -> tuple[str, int, list[Any]]:
    """The top level of a parsed config table (its keys, ``format``, ``device_name``, ``sm_count``,
    a non-empty ``configs`` list) checked -> (device_name, sm_count, configs); errors name
    ``where`` (the file) and the field."""
    def fail(field: str, reason: str) -> ConfigTableError:
        return ConfigTableError(f"{where}: {field}: {reason}")

    if not isinstance(data, dict):
        raise fail("(top level)", f"must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - _TABLE_KEYS)
    if unknown:
        raise fail(unknown[0], f"unknown key (allowed: {', '.join(sorted(_TABLE_KEYS))})")
    if data.get("format") != table_format:
        raise fail("format", f"must be {table_format!r}, got {data.get('format')!r}")
    name, sms = data.get("device_name"), data.get("sm_count")
    if not isinstance(name, str) or not name:
        raise fail("device_name", f"must be a non-empty string, got {name!r}")
    if not isinstance(sms, int) or sms < 1:
        raise fail("sm_count", f"must be an integer >= 1, got {sms!r}")
    raw = data.get("configs")
    if not isinstance(raw, list) or not raw:
        raise fail("configs", "must be a non-empty list")
    return name, sms, raw


def table_from_dict(data: Any, where: str) -> ConfigTable:
    """Validate a parsed table; every error names ``where`` (the file) and the field."""
    def fail(field: str, reason: str) -> ConfigTableError:
        return ConfigTableError(f"{where}: {field}: {reason}")

    name, sms, raw = table_head(data, where, TABLE_FORMAT)
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise fail(f"configs[{i}]", "must be an object")
        bad = sorted(set(item) - _ENTRY_KEYS)
        if bad:
            why = f" ({_REMOVED_KEYS[bad[0]]})" if bad[0] in _REMOVED_KEYS else ""
            raise fail(f"configs[{i}].{bad[0]}", f"unknown key{why}")
        for key in ("head_dim", "rows", "programs", "block_n", "num_warps", "num_stages"):
            if not isinstance(item.get(key), int) or item[key] < 1:
                raise fail(f"configs[{i}].{key}", f"must be an integer >= 1, got {item.get(key)!r}")
        try:
            cfg = AttnConfig(**{k: item[k] for k in item if k in {f.name for f in fields(AttnConfig)}})
        except ConfigTableError as exc:
            raise fail(f"configs[{i}]", str(exc)) from None
        entries.append(TableEntry(item["head_dim"], item["rows"], item["programs"], cfg))
    source = data.get("source", "")
    return ConfigTable(device_name=name, sm_count=sms, entries=tuple(entries), source=str(source))


def read_json(path: str) -> Any:
    """A table file's parsed JSON; a missing or unreadable file is a ConfigTableError naming it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigTableError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigTableError(f"{path}: cannot read JSON: {exc}") from None


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> ConfigTable:
    """Read and validate one table file (cached per path)."""
    return table_from_dict(read_json(path), path)


def table_file_name(device_name: str) -> str:
    """``NVIDIA H200`` -> ``NVIDIA_H200.json``."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in device_name.strip()) + ".json"


@functools.lru_cache(maxsize=16)
def table_for_device(device_name: str) -> ConfigTable | None:
    """The override file from $SPECTUNE_ATTENTION_CONFIGS, else the packaged table of this device,
    else None."""
    override = os.environ.get(TABLE_ENV)
    if override:
        return load_table(override)
    path = CONFIG_DIR / table_file_name(device_name)
    return load_table(str(path)) if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# Sweep: candidates and winners (the GPU timing loop lives in the benchmark)


def candidate_configs(rows: int, head_dim: int, programs: int, max_kv_len: int,
                      num_sms: int) -> list[AttnConfig]:
    """Every config the sweep times for one bucket.

    block_m: the natural tile, plus 64 for a 32-row tile (wgmma) and half the tile from 64 rows
    up (two query tiles per kv head, more programs); block_n 32/64/128; warps 4/8 (and 2 for
    32-row tiles, which keeps warps along M); stages 2/3/4; splits 1 and the automatic count,
    2 when the GPU holds fewer than 4 waves of programs, twice the automatic count when it splits.
    Dropped: 8 warps on tiles under 64 rows with 32-key blocks (fewer than 8 columns per warp).
    Tiles of 64 rows and more with 32- or 64-key blocks are also timed with the lazy rescale
    (``lazy``): with 32-key tiles the MMAs of a 64-row tile cost no more than at 16 rows and
    the per-tile softmax is the excess (``benchmarks/attention_q16.py``, H200 2026-12-05); and
    64 x 32 tiles of 4 warps with ``max_regs = CAPPED_REGS``, exact and lazy.
    """
    m = natural_block_m(rows)
    block_ms = [m] + ([64] if m == 32 else []) + ([m // 2] if m >= 64 else [])
    by_len = max(1, max_kv_len // MIN_SPLIT_TOKENS)
    out: list[AttnConfig] = []
    for bm in block_ms:
        tiles = -(-rows // bm)
        auto = choose_num_splits(programs * tiles, 1, max_kv_len, num_sms)
        splits = {1, auto}
        if programs * tiles < 4 * num_sms:
            splits.add(min(2, by_len))
        if auto > 1:
            splits.add(min(2 * auto, by_len, MAX_SPLITS))
        warps = (2, 4, 8) if bm == 32 else (4, 8)
        for s in sorted(splits):
            for bn in (32, 64, 128):
                for w in warps:
                    if w == 8 and bm < 64 and bn == 32:
                        continue
                    for st in (2, 3, 4):
                        out.append(AttnConfig(bn, w, st, block_m=bm, num_splits=s))
                        if bm >= 64 and bn <= 64:
                            out.append(AttnConfig(bn, w, st, block_m=bm, num_splits=s, lazy=1))
                        if bm == 64 and bn == 32 and w == 4:  # 4 CTAs an SM: see CAPPED_REGS
                            out += [AttnConfig(bn, w, st, block_m=bm, num_splits=s, lazy=lazy, max_regs=CAPPED_REGS)
                                    for lazy in (0, 1)]
    return out


def time_candidates(configs: list[AttnConfig], bench: Callable[[AttnConfig], float],
                    on_error: Callable[[AttnConfig, Exception], None] | None = None) -> dict[AttnConfig, float]:
    """``bench(config) -> ms`` for each config; one that raises (out of shared memory or
    registers, a compile error, a wrong result) scores inf instead of ending the sweep."""
    times: dict[AttnConfig, float] = {}
    for cfg in configs:
        try:
            times[cfg] = float(bench(cfg))
        except Exception as exc:  # noqa: BLE001 (any failure of one candidate only disqualifies it)
            times[cfg] = math.inf
            if on_error is not None:
                on_error(cfg, exc)
    return times


@dataclass(frozen=True)
class SweepTiming:
    head_dim: int
    rows: int
    programs: int
    kv_len: int  # context of this sample; a bucket's winner must do well over all its contexts
    config: AttnConfig
    ms: float  # math.inf: failed (out of resources, wrong result)


def pick_winners(timings: list[SweepTiming]) -> list[TableEntry]:
    """Per bucket (head_dim, rows, programs): the config with the lowest geometric mean of
    time / best time over the bucket's contexts; a config missing or failed at any context loses."""
    buckets: dict[tuple[int, int, int], dict[int, dict[AttnConfig, float]]] = {}
    for t in timings:
        per_ctx = buckets.setdefault((t.head_dim, t.rows, t.programs), {})
        per_ctx.setdefault(t.kv_len, {})[t.config] = t.ms
    winners = []
    for key in sorted(buckets):
        per_ctx = buckets[key]
        best = {ctx: min(times.values()) for ctx, times in per_ctx.items()}
        configs = set.intersection(*(set(times) for times in per_ctx.values()))

        def score(cfg: AttnConfig, per_ctx: dict = per_ctx, best: dict = best) -> float:
            ratios = [per_ctx[ctx][cfg] / best[ctx] for ctx in per_ctx]
            if any(not math.isfinite(r) for r in ratios):
                return math.inf
            return math.exp(sum(math.log(r) for r in ratios) / len(ratios))

        ranked = sorted(configs, key=lambda c: (score(c), c.short()))
        if ranked and math.isfinite(score(ranked[0])):
            winners.append(TableEntry(key[0], key[1], key[2], ranked[0]))
    return winners
