"""Host time of the engine per step, apart from the target forward and the step's device work (CPU).

The real engine (``spectune.engine.engine``), a policy table (planner and online correction; the
H200 qwen3-8b cost model and acceptance prior, rows shaped like the shipped H200 table's: K 5 at
batch 1, 4 up to 50, 3 above; kept here so the figures do not move with a re-tuned profile) and
the replay drafter serve requests at several concurrencies with the arms plain,
fixed:3 and auto. On CUDA the verify/decode step and the proposal are graph replays and the
prefill forward is device work; on this CPU run they execute eagerly, so their time is measured
and taken out:

  device   ``GraphPool.run`` (pack, target forward, accept, counters: one graph replay on CUDA),
           the proposer's ``propose`` (one drafter graph replay on CUDA) and the target forwards
           of prefill (outermost region counted once)
  host     everything else of ``Engine.run``: collect, retire, admission bookkeeping, observe,
           plan, building step inputs, copies out, the run log

    host_ms_per_step = (RunResult.seconds - device time) / decode steps     (the serving loop)
    +log: the same over the whole ``Engine.run`` call (the run log's assembly after the loop too)

Target: ``stub`` (default) is a lookup table ``logits = W[(token * 31 + position) % V]`` [T, V]:
exact, no KV cache, near-zero cost, so the host work dominates; ``tiny`` is the tiny preset with
the torch paged-attention backend. Correctness first: every arm's greedy outputs must equal the
plain arm's.

    python benchmarks/bench_engine_host.py --label before     # then, after a change:
    python benchmarks/bench_engine_host.py --label after

Each label's rows are kept in benchmarks/results/engine_host_cpu.json (one file, merged by
label). ``--profile C:ARM`` prints the cProfile top functions of that run.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from spectune.engine.bench import TorchPagedAttention, arm_policy, bench_tiers, parse_arm
from spectune.engine.engine import KV_SLACK, Engine, Request, RunResult
from spectune.engine.replay_drafter import DraftInput, ReplayDrafter
from spectune.io import atomic_write_text
from spectune.kernels.attention_metadata import AttnMeta
from spectune.runtime.planner import Planner, load

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks/results/engine_host_cpu.json"
PRIOR = "[0.775, 0.754, 0.734, 0.715, 0.696, 0.677, 0.659, 0.626]"
POLICY_YAML = f"""\
schema: spectune/1
hardware: {{gpu: NVIDIA H200}}
software: {{spectune: 0.1.0, torch: 2.11.0}}
workload: {{target: qwen3-8b, drafter: eagle-1l, drafter_kind: autoregressive, drafter_layers: 1,
           dtype: bfloat16, context_len: 2048, max_k: 8, max_batch: 64, device: cuda}}
costs:
  model:
    target: {{weight_ms: 6.60, token_ms: 0.0169, knee_tokens: 256.0, compute_ms: 0.0114, kv_ms_per_mtok: 29.1}}
    drafter: {{fixed_ms: 0.004, step_ms: 0.594, token_ms: 0.0043}}
    overhead: {{base_ms: 0.0119, token_ms: 7.0e-08}}
  error: {{held_out: 12, median_rel: 0.022, max_rel: 0.059}}
  timer: cuda-graph
acceptance:
  source: curve
  max_k: 8
  components:
  - {{weight: 1.0, accept: {PRIOR}}}
policy:
  tiers: [6, 12, 16, 20, 28, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160,
          168, 176, 184, 192, 200, 208, 216, 224, 232, 240, 248, 256]
  online: {{min_k: 0, max_k: 8, prior: {PRIOR}}}
  rows:
  - {{batch: [1, 2], k: 5, verify_budget: 10}}
  - {{batch: [3, 50], k: 4, verify_budget: 200}}
  - {{batch: [51, 64], k: 3, verify_budget: 192}}
"""
BLOCK = 16
STUB_VOCAB = 512


class DeviceClock:
    """Seconds spent in regions that are device work on CUDA; nested regions count once.
    ``outer_calls[name]``: calls of a wrapped function that were not nested in another region
    (for the target: the prefill forwards)."""

    def __init__(self) -> None:
        self.seconds, self.depth, self.t0 = 0.0, 0, 0.0
        self.outer_calls: dict[str, int] = {}

    def wrap(self, fn: Callable[..., Any], name: str = "") -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth == 0:
                self.t0 = time.perf_counter()
                self.outer_calls[name] = self.outer_calls.get(name, 0) + 1
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - self.t0
        return timed


class StubTarget:
    """logits [T, V] = table[(input_ids * 31 + positions) % V]: exact and KV-free."""

    def __init__(self, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g)  # [V, V]
        self.vocab = vocab

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        return self.table[(input_ids * 31 + positions) % self.vocab]


class TimedProposer:
    def __init__(self, inner: ReplayDrafter, clock: DeviceClock):
        self.inner = inner
        self._propose = clock.wrap(inner.propose)

    def propose(self, inp: DraftInput, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._propose(inp, k)


def build_engine(target_name: str, planner: Planner, concurrency: Sequence[int], n_requests: int,
                 prompt_len: int, max_new: int, clock: DeviceClock) -> tuple[Engine, ReplayDrafter, int]:
    max_k = max(3, planner.k_hi)
    max_batch = max(concurrency)
    max_len = prompt_len + max_new + max_k + KV_SLACK
    num_blocks = 1 + max_batch * -(-max_len // BLOCK)
    target: Any
    if target_name == "stub":
        target, vocab = StubTarget(STUB_VOCAB), STUB_VOCAB
    else:
        from spectune.models.build import build_models
        from spectune.models.config import ModelArgs, parse_drafter

        args = ModelArgs.from_name("tiny")
        models = build_models(args, parse_drafter("eagle-1l"), device="cpu", dtype=torch.float32,
                              max_batch=max_batch, max_q=max_k + 1, context_len=max_len, seed=0)
        models.target.backend = TorchPagedAttention(args.n_layers, num_blocks, BLOCK, args.n_kv_heads,
                                                    args.head_dim, torch.float32, "cpu")
        target, vocab = models.target, args.vocab_size
    replay = ReplayDrafter(max_requests=n_requests, max_len=max_new, max_k=max_k, vocab_size=vocab,
                           device="cpu")
    tiers = bench_tiers(planner.tiers, concurrency, [0, 3])
    engine = Engine(clock.wrap(target, "target"), tiers=tiers, max_batch=max_batch, max_k=max_k, max_len=max_len,
                    num_blocks=num_blocks, device="cpu", block_size=BLOCK,
                    proposer=TimedProposer(replay, clock), kernels=False, prefill_chunk=64)
    engine.pool.run = clock.wrap(engine.pool.run)  # type: ignore[method-assign]
    return engine, replay, vocab


def policy_planner() -> Planner:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_text(POLICY_YAML)
        return load(path, on_gpu_mismatch="ignore")


def requests_for(n: int, prompt_len: int, max_new: int, vocab: int, seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(tuple(torch.randint(1, vocab, (prompt_len,), generator=g).tolist()), max_new)
            for _ in range(n)]


def timed_run(engine: Engine, clock: DeviceClock, requests: list[Request], policy: Any,
              concurrency: int, reference: Any,
              profile: cProfile.Profile | None) -> tuple[RunResult, float, float]:
    """One run; returns its result and the host seconds (wall minus device regions) inside the
    serving loop (``RunResult.seconds``) and in the whole call (the run log's assembly too)."""
    clock.seconds, clock.outer_calls = 0.0, {}
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    res = engine.run(requests, policy, concurrency=concurrency, reference=reference)
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - t0
    return res, res.seconds - clock.seconds, wall - clock.seconds


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    concurrency = [int(c) for c in args.concurrency.split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    planner = policy_planner()
    clock = DeviceClock()
    n_max = args.requests_per_slot * max(concurrency)
    engine, replay, vocab = build_engine(args.target, planner, concurrency, n_max, args.prompt_len,
                                         args.max_new_tokens, clock)
    all_requests = requests_for(n_max, args.prompt_len, args.max_new_tokens, vocab, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    accept = (0.6 + 0.3 * torch.rand(n_max, 1, generator=g)).expand(n_max, engine.max_k).contiguous()
    coins = torch.rand(n_max, args.max_new_tokens, generator=g)
    rows: list[dict[str, Any]] = []
    for c in concurrency:
        requests = all_requests[: args.requests_per_slot * c]
        plain = engine.run(requests, arm_policy("plain", engine.tiers), concurrency=c)
        replay.load(plain.outputs, accept, coins)
        for arm in arms:
            policy = arm_policy(arm, engine.tiers, planner)
            k = parse_arm(arm)
            per_step, totals, walls = [], [], []
            res = None
            for rep in range(args.repeats):
                planner.reset_online()
                want = args.profile == f"{c}:{arm}" and rep == args.repeats - 1
                prof = cProfile.Profile() if want else None
                res, host_s, total_s = timed_run(engine, clock, requests, policy, c, plain.outputs, prof)
                if res.outputs != plain.outputs or not all(res.done):
                    raise SystemExit(f"c={c} {arm}: outputs differ from plain greedy decoding")
                per_step.append(host_s / res.steps * 1e3)
                totals.append(total_s / res.steps * 1e3)
                walls.append(total_s + clock.seconds)
                if prof is not None:
                    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile_top)
            assert res is not None
            rows.append({
                "concurrency": c, "arm": arm, "k": k, "steps": res.steps, "requests": len(requests),
                "host_ms_per_step": round(min(per_step), 4),
                "host_ms_per_step_median": round(statistics.median(per_step), 4),
                "host_ms_per_step_with_log": round(min(totals), 4),
                "device_ms_per_step": round(clock.seconds / res.steps * 1e3, 4),
                "prefill_forwards": clock.outer_calls.get("target", 0),
                "wall_s": round(min(walls), 4), "mean_accept_len": res.mean_accept_len,
            })
            r = rows[-1]
            print(f"{c:>5} {arm:>8} {res.steps:>6} {r['host_ms_per_step']:>10.3f} "
                  f"{r['host_ms_per_step_median']:>10.3f} {r['host_ms_per_step_with_log']:>10.3f} "
                  f"{r['device_ms_per_step']:>10.3f} {r['prefill_forwards']:>8}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--target", choices=("stub", "tiny"), default="stub")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--arms", default="plain,fixed:3,auto")
    ap.add_argument("--requests-per-slot", type=int, default=2, help="requests = this x concurrency")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per (concurrency, arm); min reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="C:ARM, e.g. 64:auto: print cProfile of that run")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'conc':>5} {'arm':>8} {'steps':>6} {'host ms':>10} {'(median)':>10} {'+log ms':>10} "
          f"{'device ms':>10} {'prefills':>8}")
    rows = bench(args)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("runs", {})[args.label] = {
        "target": args.target, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
        "requests_per_slot": args.requests_per_slot, "repeats": args.repeats, "rows": rows,
    }
    results["method"] = ("host_ms_per_step = (RunResult.seconds - time in GraphPool.run, propose and "
                         "prefill forwards) / decode steps; host_ms_per_step_with_log: the same over "
                         "the whole Engine.run call (result assembly included); CPU, eager, one "
                         "thread, min over repeats")
    atomic_write_text(out, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
