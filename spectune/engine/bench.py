"""``spectune bench``: serving A/B of plain decoding, fixed K and the policy on production shapes.

One target (random weights, real shapes) and one engine serve every (concurrency, arm): target
graphs are captured once per tier, drafter graphs once per (rows, K). Per concurrency the plain arm
runs first; its greedy outputs are each request's reference continuation, which the replay
drafter (``spectune.engine.replay_drafter``) corrupts per a sampled acceptance row, while the real
drafter runs for its cost. Method and defaults: docs/BENCH_METHOD.md.

Per (concurrency, arm): a warm-up run (the first ``concurrency`` requests, a few tokens each, not
timed), then the timed run under the NVML sampler. The results JSON (``header`` + ``rows``) is
what ``spectune report`` reads (``report_inputs.BenchRow``), written atomically.

Exactness: a request whose output differs from plain greedy decoding is a *near tie* when the
plain arm's top-1 minus top-2 logit at the first differing index is within the dtype's tolerance
(``NEAR_TIE``: a numerical flip between forwards of different shapes), else a *hard* mismatch (a
defect). ``--dtype float32`` on CUDA runs with TF32 off: the exactness gate, where hard mismatches
must be 0. Throughput: ``decode_tok_s`` counts decode/verify steps only (what the simulator
predicts); ``full_tok_s`` only the steps that ran at full concurrency (serving under load: a
closed run's ramp and drain left out; ``summary_full_load``); ``output_tok_s`` is end to end
(prefill included; ``summary_end_to_end``), predicted as ``predicted_output_tok_s``.

On CPU the same path runs eagerly with the kernels' torch references (the tiny preset by default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spectune import __version__
from spectune.autotune.acceptance import (
    AcceptanceModel,
    resolve_acceptance,
)
from spectune.autotune.hardware import hardware_facts, parse_device, software_facts
from spectune.autotune.whatif import (
    ArmError,
    FixedPolicy,
    bench_default_arms,
    best_fixed_k,
    drift_source,
    parse_arm,
    parse_arms,
    split_drift,
    tuned_prior,
)
from spectune.engine.bench_accounting import (
    NEAR_TIE,
    SIM_REQUESTS,
    NearTie,
    Prediction,
    classify_mismatches,
    predict_decode,
    row_for,
    summarise,
    weighted_quantile,
)
from spectune.engine.engine import KV_SLACK, Engine, Policy, Request, RunResult
from spectune.engine.replay_drafter import ReplayDrafter
from spectune.engine.trace_replay import TraceReplay, is_trace_source, load_trace_replay
from spectune.errors import SpectuneError
from spectune.io import atomic_write_text
from spectune.kernels.attention import verify_attention_ref
from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.kv_cache import allocate_kv_cache, slot_mapping_for, write_kv_ref
from spectune.runtime.planner import Planner, load
from spectune.runtime.prefill_plan import RIDE_BUDGET, RIDE_PIECES, Riding, prefill_ms
from spectune.runtime.table import DTYPES

DEFAULT_REPEATS = 3  # interleaved timed runs per (concurrency, arm)
DEFAULT_PREFILL_BUDGET = RIDE_BUDGET  # prompt tokens a step carries with --mixed-prefill


@dataclass(frozen=True)
class Defaults:
    concurrency: tuple[int, ...]
    max_new_tokens: int
    prompt_len: int
    time_limit_s: float | None  # per timed run
    waves: int  # requests per concurrency: waves x concurrency, clamped to [min_prompts, max_prompts]
    min_prompts: int
    max_prompts: int | None

    def prompts(self, concurrency: int) -> int:
        n = max(self.waves * concurrency, self.min_prompts)
        return min(n, self.max_prompts) if self.max_prompts is not None else n


# budget arithmetic for qwen3-8b on an H200: docs/BENCH_METHOD.md "Defaults and time"
# (8 waves: a run's drain and the spread of a few requests' step counts move tok/s by < 1 %; with
# 2 waves of 8 requests, arms 1-2 % apart could not be told apart: docs/BENCH_METHOD.md)
GPU_DEFAULTS = Defaults((1, 8, 32, 64, 128, 256), max_new_tokens=128, prompt_len=256, time_limit_s=90.0,
                        waves=8, min_prompts=48, max_prompts=1024)
CPU_DEFAULTS = Defaults((1, 4), max_new_tokens=16, prompt_len=16, time_limit_s=None, waves=2, min_prompts=1,
                        max_prompts=None)


WARMUP_TOKENS = 8  # output tokens per warm-up request
BLOCK_SIZE = 16
METHOD = ("replay drafter: random-weight target runs the real compute; drafts are each request's "
          "plain greedy continuation, kept per position with a sampled conditional acceptance "
          "(else a different token); the real drafter runs for its cost (docs/BENCH_METHOD.md)")
METHOD_TOKENS = ("replay drafter, token by token: random-weight target runs the real compute; drafts are each "
                 "request's plain greedy continuation, right/wrong, offered and confidence per draft position "
                 "from a real drafter's trace; the real drafter runs for its cost (docs/BENCH_METHOD.md)")


class BenchError(SpectuneError):
    """Bad bench settings; the message names the option."""


@dataclass(frozen=True)
class BenchConfig:
    policy: str
    out: str
    concurrency: str | Sequence[int] | None = None
    arms: str | Sequence[str] | None = None  # None: plain, the simulator's best fixed K +- 1, auto
    prompts: int | dict[int, int] | None = None  # requests per concurrency (one for all, or per c);
    # None: the defaults' ``prompts(c)``
    max_new_tokens: int | None = None
    prompt_len: int | None = None
    acceptance: str | None = None  # default: what the policy was tuned on
    target: str | None = None  # default: the policy's target on CUDA, tiny on CPU
    drafter: str | None = None  # default: the policy's drafter
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    time_limit_s: float | None = None  # per timed run; default 90 s on CUDA
    progress: bool = True
    decisive: bool | None = None  # DecisiveLogits on the target; None: on for 16-bit dtypes
    drift: str | None = None  # "A,B": requests of the second half of each run are served with B
    repeats: int = DEFAULT_REPEATS
    predict_at_measured_accept: bool = True  # the rescaled prediction (a bisection of simulations)
    fused: bool = False  # target and drafter layers with the fused kernels (kernels/fused.py)
    mixed_prefill: bool = False  # admitted prompts ride in the steps' forwards (engine/mixed.py)
    prefill_budget: int = DEFAULT_PREFILL_BUDGET  # prompt tokens per step with mixed_prefill
    ride_limit: int | None = None  # mixed_prefill: a larger admission takes separate forwards (None: the budget)
    ride_pieces: int = RIDE_PIECES  # mixed_prefill: prompt pieces one step carries at most
    ride_aware: bool = True  # mixed_prefill: auto's riding steps at plan_ride's shape (False: plan(batch))
    admit_ahead: bool = True  # mixed_prefill: a row that may end by the next step lends its slot now (Engine)
    await_ends: bool = False  # the host waits for the last step's tokens where a row may have ended (Engine)


# ---------------------------------------------------------------------------------------------
# arms


def arm_policy(arm: str, tiers: Sequence[int], planner: Policy | None = None) -> Policy:
    k = parse_arm(arm)
    if k is not None:
        return FixedPolicy(k, tuple(sorted(tiers)))
    if planner is None:
        raise BenchError("arm auto: needs a policy table (planner)")
    return planner


# ---------------------------------------------------------------------------------------------
# settings


def _ints(text: str | Sequence[int], option: str) -> tuple[int, ...]:
    try:
        values = [int(v) for v in (text.split(",") if isinstance(text, str) else text)]
    except ValueError:
        raise BenchError(f"{option}: cannot read {text!r} (e.g. 1,8,32)") from None
    if not values or min(values) < 1:
        raise BenchError(f"{option}: must be integers >= 1, got {text!r}")
    return tuple(sorted(set(values)))


def bench_tiers(policy_tiers: Sequence[int], concurrency: Sequence[int], ks: Sequence[int]) -> list[int]:
    """Captured tiers: the policy's, each fixed arm's full-batch step exactly (c * (K + 1)) and
    powers of two up to the largest for the batches of a run's tail."""
    exact = {c * (k + 1) for c in concurrency for k in ks}
    top = max(exact | set(policy_tiers))
    return sorted(exact | set(policy_tiers) | {1 << i for i in range(top.bit_length()) if 1 << i <= top})


# ---------------------------------------------------------------------------------------------
# models and engine


class TorchPagedAttention:
    """Paged KV backend on the kernels' torch references (cache write, verification attention):
    the CPU stand-in for ``spectune.models.paged.PagedTritonAttention``."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.cache = allocate_kv_cache(n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype, device)
        self.block_size = block_size

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttnMeta) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D]
        assert meta.block_tables is not None
        slots = meta.slot_mapping
        if slots is None:
            slots = slot_mapping_for(meta.block_tables, meta.context_lens, meta.cu_seqlens_q, q.shape[0],
                                     self.block_size)
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        write_kv_ref(k, v, k_cache, v_cache, slots)
        return verify_attention_ref(q, k_cache, v_cache, meta).to(q.dtype)


@dataclass
class Setup:
    engine: Engine
    replay: ReplayDrafter
    planner: Planner
    requests: list[Request]
    prior: list[float] | None  # the population rates the allocation starts from (the tuned prior)
    max_k: int  # drafts the replay and the engine hold
    target: str
    drafter: str
    dtype: str
    warmed: set[tuple[int, str]] = dataclasses.field(default_factory=set)  # (concurrency, arm) warmed up


@dataclass(frozen=True)
class Served:
    """One served acceptance: its model (then ``drift``'s for the second half of each run), the
    header text, the arms per concurrency and the results file."""

    acceptance: AcceptanceModel
    drift: AcceptanceModel | None
    source: str
    arms: dict[int, tuple[str, ...]]
    out: str
    tokens: TraceReplay | None = None  # a trace file served token by token (no drift)


def resolve_served(config: BenchConfig, planner: Planner, acceptance: str | None, drift: str | None, out: str,
                   concurrency: Sequence[int], counts: dict[int, int], prompt_len: int, max_new: int) -> Served:
    """The served models and, without ``--arms``, plain + the simulator's best fixed K and its
    neighbours + auto at each concurrency (``whatif.bench_default_arms``)."""
    max_k = max(1, planner.k_hi)
    if drift is not None:
        first, second = split_drift(drift)
        model, late = resolve_acceptance(first, max_k), resolve_acceptance(second, max_k)
        source = drift_source(model, late)
    else:
        model, late = resolve_acceptance(acceptance or _table_acceptance(planner.table), max_k), None
        source = model.source
    model = model.widened(max_k)
    late = late.widened(max_k) if late is not None else None
    arms: dict[int, tuple[str, ...]] = {}
    for c in concurrency:
        if config.arms is not None:
            arms[c] = parse_arms(config.arms)
            continue
        reps = max(1, -(-SIM_REQUESTS // counts[c]))
        best = best_fixed_k(planner.cost, model, max_k, concurrency=c, requests=counts[c], decode_tokens=max_new - 1,
                            context_len=prompt_len + max_new // 2, seeds=range(config.seed, config.seed + reps),
                            drift=late, prior=tuned_prior(planner.table))
        arms[c] = bench_default_arms(max_k, best)
    tokens = (load_trace_replay(acceptance, max_k)
              if drift is None and acceptance is not None and is_trace_source(acceptance) else None)
    return Served(model, late, tokens.describe() if tokens else source, arms, out, tokens)


def build(config: BenchConfig, planner: Planner, device: torch.device, concurrency: Sequence[int],
          fixed: Sequence[int], auto: bool, n_requests: int, prompt_len: int, max_new: int) -> Setup:
    from spectune.models.build import build_models, fit_cache, fit_paged_cache
    from spectune.models.config import parse_drafter, parse_dtype, resolve_target
    from spectune.models.decisive import DecisiveLogits
    from spectune.models.paged import PagedTritonAttention

    table, cuda = planner.table, device.type == "cuda"
    args = resolve_target(config.target or (table.workload.target if cuda else "tiny"))
    spec = parse_drafter(config.drafter or table.workload.drafter)
    dtype = config.dtype or (table.workload.dtype if cuda else "float32")
    max_k = max([*fixed, planner.k_hi if auto else 0, 0])
    max_batch = max(concurrency)
    max_len = prompt_len + max_new + max_k + KV_SLACK
    per_request = -(-max_len // BLOCK_SIZE)
    # admitting ahead (mixed prefill): successors ride and wait ready beside the last steps of the
    # rows they replace, in up to ``ahead`` rows past max_batch, with KV blocks of their own
    ahead = max(4, max_batch // 4) if config.admit_ahead and config.mixed_prefill else 0
    num_blocks = 1 + (max_batch + ahead) * per_request
    act_dtype, fp8 = parse_dtype(dtype)
    models = build_models(args, spec, device=device, dtype=act_dtype, max_batch=max_batch,
                          max_q=max_k + 1, context_len=max_len, seed=config.seed, fp8=fp8,
                          fused=config.fused)
    backend = PagedTritonAttention if cuda else TorchPagedAttention
    models.target.backend = backend(args.n_layers, num_blocks, BLOCK_SIZE, args.n_kv_heads, args.head_dim,
                                    act_dtype, device)
    parallel = spec.kind == "parallel"
    if cuda:  # the drafter pays what the profile measured: the same paged Triton attention
        fit_paged_cache(models.drafter, spec.n_layers, batch=max_batch, ctx_max=max_len,
                        max_q=max(max_k, 1), causal=not parallel)
    else:
        fit_cache(models.drafter, spec.n_layers, batch=max_batch, ctx_max=max_len + max_k,
                  max_q=max(max_k, 1) if parallel else 1, causal=not parallel)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    hidden = torch.randn(max_batch, args.dim, generator=gen, device=device).to(act_dtype)
    prior = tuned_prior(table)
    replay = ReplayDrafter(max_requests=n_requests, max_len=max_new, max_k=max(max_k, 1),
                           vocab_size=args.vocab_size, device=device, cost_drafter=models.drafter,
                           hidden=hidden, prior=prior, max_rows=max_batch)
    target = DecisiveLogits(models.target) if decisive_for(config, dtype) else models.target
    engine = Engine(target, tiers=bench_tiers(planner.tiers, concurrency, [*fixed, 0]),
                    max_batch=max_batch, max_k=max_k, max_len=max_len, num_blocks=num_blocks,
                    device=device, block_size=BLOCK_SIZE, proposer=replay, kernels=None if cuda else False,
                    mixed_prefill=config.mixed_prefill, prefill_budget=config.prefill_budget,
                    ride_limit=config.ride_limit, ride_pieces=config.ride_pieces, admit_ahead=ahead,
                    await_ends=config.await_ends)
    engine.warm_prefill([prompt_len], max_batch if cuda else min(4, max_batch))
    rng = np.random.default_rng(config.seed)
    prompts = rng.integers(1, args.vocab_size, size=(n_requests, prompt_len))
    requests = [Request(tuple(int(t) for t in p), max_new) for p in prompts]
    return Setup(engine, replay, planner, requests, prior, max(max_k, 1), args.name, spec.name, dtype)


def draws(served: Served, n: int, max_k: int, max_new: int, seed: int, repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditional rates per request [n, max_k] (requests n // 2.. from the drift model) and
    coins per output index [n, max_new] of one repeat: arms of a repeat share them."""
    rng = np.random.default_rng([seed, repeat])
    rows = served.acceptance.widened(max_k).sample(rng, n)[:, :max_k]
    if served.drift is not None:
        rows[n // 2:] = served.drift.widened(max_k).sample(rng, n)[n // 2:, :max_k]
    return (torch.tensor(rows, dtype=torch.float32),
            torch.tensor(rng.random((n, max_new)), dtype=torch.float32))


def load_replay(setup: Setup, served: Served, references: Sequence[Sequence[int]], max_new: int, seed: int,
                repeat: int) -> None:
    """One repeat's replay: the trace token by token (the drafter's confidences to the allocation
    when it has them, else the requests' history), or sampled rates and coins."""
    n = len(references)
    if served.tokens is None:
        setup.replay.load(references, *draws(served, n, setup.max_k, max_new, seed, repeat))
        return
    setup.replay.load_tokens(references, served.tokens.tables(n, max_new, seed, repeat))
    setup.replay.set_allocation("confidence" if served.tokens.has_conf else "history")


def decisive_for(config: BenchConfig, dtype: str) -> bool:
    """Random-weight 16-bit (and FP8: bf16 logits) targets get decisive logits unless the user says otherwise."""
    return config.decisive if config.decisive is not None else dtype in ("bfloat16", "float16", "fp8")


def _table_acceptance(table: Any) -> AcceptanceModel | None:
    return AcceptanceModel.from_dict(table.acceptance) if table.acceptance else None


# ---------------------------------------------------------------------------------------------
# one (concurrency, arm)


def predict(setup: Setup, served: Served, arm: str, concurrency: int, n_requests: int, context_len: int,
            seed: int, res: RunResult, at_measured_accept: bool) -> Prediction:
    """The simulator's decode goodput for this arm (``bench_accounting.predict_decode``)."""
    k = parse_arm(arm)

    def make_policy() -> Any:
        if k is not None:
            return FixedPolicy(k, setup.engine.tiers)
        return setup.planner.fresh()  # (its ride_aware too)

    engine = setup.engine
    prompt_len = len(setup.requests[0].prompt)
    prefill = prefill_ms(setup.planner.cost, prompt_len, engine.prefill_chunk, engine.prefill_tokens)
    ride = None if engine.mixed is None else Riding(prompt_len, engine.mixed.budget, engine.ride_limit,
                                                    engine.prefill_chunk, engine.mixed.max_pieces,
                                                    ahead=engine.admit_ahead > 0)
    return predict_decode(setup.planner.cost, served.acceptance, make_policy, res, speculative=k != 0,
                          concurrency=concurrency, requests=n_requests, context_len=context_len, seed=seed,
                          decode_tokens=setup.requests[0].max_new_tokens - 1, drift=served.drift,
                          prior=setup.prior, at_measured_accept=at_measured_accept, prefill=prefill, ride=ride,
                          host_lag=not engine.await_ends)


def measure(setup: Setup, arm: str, concurrency: int, requests: list[Request], power: Any,
            time_limit_s: float | None, reference: Sequence[Sequence[int]] | None = None) -> tuple[RunResult, Any]:
    engine, planner = setup.engine, setup.planner
    policy: Policy = arm_policy(arm, engine.tiers, planner)
    k = parse_arm(arm)
    if (concurrency, arm) not in setup.warmed:  # graphs and kernels of this arm's shapes, once
        table_ks = {planner.plan(b).k for b in range(1, concurrency + 1)}
        # auto: also every smaller K and plain decoding, which a riding step may run (``Planner.plan_ride``)
        ks = [k] if k is not None else sorted(table_ks | set(range(max(table_ks) + 1)))
        # auto: the drafter shapes of every K the controller may move to, probe or try (captured
        # when first planned, each stalled a timed step: 11 % of the auto runs of the A/Bs up to
        # 2026-12-07 captured 1-5 graphs inside the run; a plain or fixed run, none)
        engine.prepare(ks, concurrency, planner.draft_shapes(concurrency) if k is None else None)
        warm = [Request(r.prompt, min(r.max_new_tokens, WARMUP_TOKENS)) for r in requests[:concurrency]]
        state = planner.snapshot_online()
        engine.run(warm, policy, concurrency=concurrency)
        planner.restore_online(state)  # the short warm-up teaches the controller nothing
        setup.warmed.add((concurrency, arm))
    with quiet_gc():
        if power is None:
            return engine.run(requests, policy, concurrency=concurrency, time_limit_s=time_limit_s,
                              reference=reference), None
        with power.measure() as region:
            res = engine.run(requests, policy, concurrency=concurrency, time_limit_s=time_limit_s,
                             reference=reference)
    return res, region.reading


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """No cyclic garbage collection inside a timed run: the objects alive before it are frozen out
    of the collector's view and collection is off until the run ends (a full collection over the
    bench's traces and rows is a pause of a few hundred ms, the size of a slow 2-second run)."""
    was = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.unfreeze()


@contextlib.contextmanager
def exact_float32(device: torch.device, dtype: str) -> Iterator[bool | None]:
    """float32 on CUDA: TF32 off for matmuls and convolutions while the bench builds (graphs are
    captured with the math mode of their capture) and runs; restored after. Yields whether TF32
    is allowed (None off CUDA)."""
    if device.type != "cuda":
        yield None
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------------------------------------


def run_bench(config: BenchConfig, *, on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every (concurrency, arm, repeat), write the results JSON atomically (again after every
    row) and return it."""
    return run_sources(config, [(config.acceptance, config.drift, config.out)], on_row=on_row)[0]


def run_sources(config: BenchConfig, sources: Sequence[tuple[str | None, str | None, str]
                                                      | tuple[str | None, str | None, str, Sequence[int]]], *,
                on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Several served acceptances ``(acceptance, drift, out[, concurrency])`` in one process: one
    engine, its captured graphs and the plain reference outputs (they depend on the prompts only)
    serve all. A source's own concurrency list (a subset of the config's) runs only those."""
    device = parse_device(config.device, BenchError)
    d = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    concurrency = _ints(config.concurrency if config.concurrency is not None else d.concurrency,
                        "--concurrency")
    max_new = config.max_new_tokens if config.max_new_tokens is not None else d.max_new_tokens
    prompt_len = config.prompt_len if config.prompt_len is not None else d.prompt_len
    limit = config.time_limit_s if config.time_limit_s is not None else d.time_limit_s
    per_c = config.prompts if isinstance(config.prompts, dict) else {}
    counts = {c: per_c.get(c, d.prompts(c)) if isinstance(config.prompts, dict) or config.prompts is None
              else config.prompts for c in concurrency}
    for option, value in (("--max-new-tokens", max_new), ("--prompt-len", prompt_len), ("--repeats", config.repeats),
                          ("--prompts", min(counts.values()))):
        if value < 1:
            raise BenchError(f"{option}: must be >= 1, got {value}")
    if config.dtype is not None and config.dtype not in DTYPES:
        raise BenchError(f"--dtype: must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    planner = load(config.policy, on_gpu_mismatch="warn")
    if config.arms is not None:
        parse_arms(config.arms, planner.table.workload.max_k)
    planner.ride_aware = config.ride_aware
    dtype = config.dtype or (planner.table.workload.dtype if device.type == "cuda" else "float32")
    tolerance = NEAR_TIE.get(dtype, NEAR_TIE["bfloat16"])
    own = [[int(c) for c in src[3]] if len(src) > 3 else list(concurrency) for src in sources]
    for cs in own:
        if extra := sorted(set(cs) - set(concurrency)):
            raise BenchError(f"--concurrency: a source asks for {extra}, not in {list(concurrency)}")
    served = [resolve_served(config, planner, src[0], src[1], src[2], cs, counts, prompt_len, max_new)
              for src, cs in zip(sources, own, strict=True)]
    arms = {a for s, cs in zip(served, own, strict=True) for c in cs for a in s.arms[c]}
    fixed = sorted({k for a in arms if (k := parse_arm(a)) is not None})
    results = []
    with exact_float32(device, dtype) as tf32:
        setup = build(dataclasses.replace(config, dtype=dtype), planner, device, concurrency, fixed, "auto" in arms,
                      max(counts.values()), prompt_len, max_new)
        power = _power(device)
        references: dict[int, RunResult] = {}
        for one, cs in zip(served, own, strict=True):
            header = _header(config, setup, one, device, prompt_len, max_new, tf32, tolerance, {c: counts[c] for c in cs})
            write = _writer(one.out, header, on_row)
            rows = _serve_all(setup, config, one, cs, counts, limit, tolerance, power, references, write)
            results.append(write(rows, True))
        if power is not None:
            power.close()
    return results


def _writer(out: str, header: dict[str, Any], on_row: Callable[[dict[str, Any]], None] | None):
    def write(rows: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        # rewritten after every row: a run cut short still leaves the rows it finished
        results = {"header": {**header, "complete": complete}, "rows": rows, "summary": summarise(rows),
                   "summary_full_load": summarise(rows, "full_tok_s"),
                   "summary_end_to_end": summarise(rows, "output_tok_s")}
        atomic_write_text(Path(out), json.dumps(results, indent=1) + "\n")
        if on_row is not None and rows and not complete:
            on_row(rows[-1])
        return results

    return write


def _power(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    from spectune.autotune.nvml import NvmlSampler

    return NvmlSampler(device.index if device.index is not None else torch.cuda.current_device())


def _header(config: BenchConfig, setup: Setup, served: Served, device: torch.device, prompt_len: int, max_new: int,
            tf32: bool | None, tolerance: NearTie, requests: dict[int, int]) -> dict[str, Any]:
    hw, sw = hardware_facts(device), software_facts()
    tuned = setup.planner.table.acceptance
    return {
        "gpu": hw.gpu, "driver": hw.driver, "policy": str(config.policy),
        "date": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat(),
        "target": setup.target, "drafter": setup.drafter, "spectune": __version__, "torch": sw.torch,
        "triton": sw.triton, "method": METHOD_TOKENS if served.tokens else METHOD, "acceptance": served.source,
        "tuned_acceptance": tuned.get("source") if tuned else None, "drift": served.drift is not None,
        "repeats": config.repeats, "arms": {str(c): list(a) for c, a in served.arms.items()},
        "requests": {str(c): n for c, n in requests.items()},  # per concurrency, each run (older runs: no key)
        "prompt_len": prompt_len, "max_new_tokens": max_new, "dtype": setup.dtype,
        "device": str(device), "seed": config.seed, "tiers": ",".join(map(str, setup.engine.tiers)),
        "tf32": tf32, "near_tie_tolerance": str(tolerance),
        "decisive_logits": decisive_for(config, setup.dtype), "fused": config.fused,
        "mixed_prefill": config.mixed_prefill,
        "prefill_budget": config.prefill_budget if config.mixed_prefill else None,
        "ride_limit": setup.engine.ride_limit if config.mixed_prefill else None,
        "ride_pieces": config.ride_pieces if config.mixed_prefill else None,
        # how auto shaped a step that carried prompt tokens (``Planner.plan_ride``, or ``plan``:
        # the batch's plan; runs from before plan_ride have no key: theirs ran ``plan(batch)``)
        "ride_shapes": ("plan_ride" if config.ride_aware else "plan") if config.mixed_prefill else None,
        # rows a prompt may be admitted into ahead of the row it replaces (0: none; older runs: no key)
        "admit_ahead": setup.engine.admit_ahead if config.mixed_prefill else None,
        # the host waits for the last step's tokens where a row may have ended (older runs: no key)
        "await_ends": config.await_ends,
    }


def train_online(setup: Setup, concurrency: int, requests: list[Request]) -> None:
    """auto is measured at steady state, as a server runs: the controller starts from the table,
    then one untimed run of this traffic (the repeat-0 draws; with drift, both halves, so a timed
    run starts adapted to the second half and must detect the switch) trains its estimate, and
    the timed runs continue from there. A cold start's cost is the simulator's to show."""
    setup.planner.reset_online()
    setup.engine.run(requests, arm_policy("auto", setup.engine.tiers, setup.planner), concurrency=concurrency)


def controller_counts(planner: Any) -> dict[str, int]:
    """The controller's running counts: estimate resets (``changes``), probe steps, trial blocks."""
    return {"changes": planner.changes, "probes": planner.probes, "trials": planner.trials}


def controller_view(planner: Any, batch: int, before: dict[str, int] | None = None) -> dict[str, Any]:
    """The planner's state at ``batch`` after a run: its choice, the live acceptance estimate,
    each timed shape's steps and measured / model time ratio (``Planner.timed_shapes``), and how
    many resets, probe steps and trial blocks the run had (``controller_counts`` since ``before``)."""
    choice = planner.choice(batch) if 0 < batch <= planner.max_batch else None
    now, before = controller_counts(planner), before or {}
    return {**{f"run_{k}": v - before.get(k, 0) for k, v in now.items()},
            "choice": None if choice is None else [choice.k, choice.verify_budget, choice.tier],
            "rates": [round(a, 4) for a in planner.rates],
            "time_ratios": {f"{p.k}/{p.verify_budget}/{p.tier}": [n, round(x, 4)]
                            for p, (n, x) in sorted(planner.timed_shapes(batch).items(),
                                                    key=lambda item: (item[0].k, item[0].verify_budget))}}


def rotated(arms: Sequence[str], repeat: int) -> list[str]:
    """Repeat r runs the arms rotated by r (plain first in repeat 0), so no arm is always last."""
    order = ["plain", *[a for a in arms if a != "plain"]] if "plain" in arms else list(arms)
    r = repeat % len(order)
    return order[r:] + order[:r]


def _serve_all(setup: Setup, config: BenchConfig, served: Served, concurrency: Sequence[int],
               counts: dict[int, int], limit: float | None, tolerance: NearTie, power: Any,
               references: dict[int, RunResult], write: Callable[[list[dict[str, Any]], bool], Any]) -> list[dict[str, Any]]:
    prompt_len, max_new = len(setup.requests[0].prompt), setup.requests[0].max_new_tokens
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    total = sum(len(served.arms[c]) for c in concurrency) * config.repeats
    with tqdm(total=total, disable=not config.progress, desc="bench", unit="run", leave=False) as bar:
        for c in concurrency:
            requests = setup.requests[: counts[c]]
            if c not in references:  # plain greedy outputs: the replay's continuations (not a row)
                references[c], _ = measure(setup, "plain", c, requests, None, None)
            plain = references[c]
            for r in range(config.repeats):
                load_replay(setup, served, plain.outputs, max_new, config.seed, r)
                if r == 0 and "auto" in served.arms[c]:
                    train_online(setup, c, requests)
                for arm in rotated(served.arms[c], r):
                    bar.set_postfix_str(f"c={c} {arm} #{r}")
                    counts_before = controller_counts(setup.planner)
                    res, reading = measure(setup, arm, c, requests, power, limit, plain.outputs)
                    pred = predict(setup, served, arm, c, len(requests), prompt_len + max_new // 2, config.seed, res,
                                   config.predict_at_measured_accept and r == 0)
                    row = {**row_for(arm, c, res, reading, plain, pred, tolerance), "repeat": r}
                    if arm == "auto":  # what the controller knows after the run, at the full batch
                        row["controller"] = controller_view(setup.planner, c, counts_before)
                    rows.append(row)
                    write(rows, False)
                    bar.update(1)
    return rows


__all__ = ["NEAR_TIE", "ArmError", "BenchConfig", "BenchError", "FixedPolicy", "NearTie", "TorchPagedAttention",
           "arm_policy", "bench_tiers", "classify_mismatches", "parse_arm", "parse_arms", "row_for", "run_bench", "weighted_quantile",
           "run_sources"]
