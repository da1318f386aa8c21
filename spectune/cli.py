"""The ``spectune`` command. The only module that parses arguments and prints for people.

Each sub-command has an ``_add_<name>(sub)`` parser builder and a ``cmd_<name>(args) -> int``.
Library errors (SpectuneError and its subclasses, e.g. TableError) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from spectune import __version__
from spectune.errors import SpectuneError


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# shared options


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--target", default="tiny",
                   help="preset (tiny, qwen3-0.6b, qwen3-4b, qwen3-8b, llama-3.1-8b) or a local "
                        "Hugging Face checkpoint folder (config.json gives the shapes)")
    g.add_argument("--drafter", default="eagle-1l",
                   help="eagle-<N>l (autoregressive EAGLE/MTP-style, N decoder layers) or "
                        "dflash-<N>l (parallel block drafter); default eagle-1l")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--batch-sizes", default=None,
                   help="range or list, e.g. 1-256 or 1,2,4,8 (default 1-256 on CUDA, 1-16 on CPU)")
    g.add_argument("--max-k", type=int, default=None, help="largest draft length (default 15 on CUDA, 7 on CPU)")
    g.add_argument("--context-len", type=int, default=None, help="KV context per request (default 2048 on CUDA, 256 on CPU)")


def _add_study_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("measurement study")
    g.add_argument("--storage", default=None,
                   help="Optuna storage URL (default: a journal file beside --out); "
                        "postgresql://... to share one study across GPUs and hosts")
    g.add_argument("--study-name", default=None, help="default: derived from GPU and workload")
    g.add_argument("--trials", type=int, default=None, help="measurement trials beyond the seed grid")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _profile_config(args: argparse.Namespace, out: str | None):
    from spectune.autotune.profiler import ProfileConfig

    return ProfileConfig(
        target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
        batch_sizes=args.batch_sizes, max_k=args.max_k, context_len=args.context_len, out=out,
        storage=args.storage, study_name=args.study_name, trials=args.trials, seed=args.seed,
        progress=not args.no_progress,
    )


def _run_profile(args: argparse.Namespace, out: str | None):
    """Profile and print a short summary; returns (table, path written)."""
    from spectune.autotune.profiler import default_out, run_profile

    config = _profile_config(args, out)
    path = default_out(config)
    try:
        table, frame = run_profile(config)
    except OSError as exc:
        raise UsageError(f"{exc.filename or path}: {exc.strerror or exc}") from None
    err = table.costs.error
    bad = int((~frame["feasible"].astype(bool)).sum()) if len(frame) else 0
    print(f"{table.hardware.gpu}: {table.workload.target} + {table.workload.drafter}, "
          f"{table.workload.dtype}, context {table.workload.context_len}, batch 1..{table.workload.max_batch}, "
          f"K <= {table.workload.max_k}")
    print(f"points: {len(frame)} measured ({bad} infeasible), timer {table.costs.timer}")
    print(f"cost model error on {err.held_out} held-out points: median {err.median_rel:.1%}, max {err.max_rel:.1%}")
    print(f"wrote {path} and {path.with_suffix('.csv')}")
    return table, path


# ---------------------------------------------------------------------------------------------
# sub-commands (filled in by their modules' owners)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the cost surface on this GPU -> profile YAML",
                       description="Measure drafter, target-verification and runtime costs with "
                                   "CUDA-graph replays and NVML power, fit the cost model, write a profile.")
    _add_workload_options(p)
    _add_study_options(p)
    p.add_argument("--out", default=None,
                   help="profile YAML path; the measurement CSV and the Optuna journal go beside it "
                        "(default: profiles/<gpu>_<target>_<drafter>.yaml on CUDA, "
                        "./spectune-<target>-<drafter>.yaml on CPU)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    _run_profile(args, args.out)
    return 0


def _add_autotune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autotune", help="profile then tune in one command -> policy table YAML")
    _add_workload_options(p)
    _add_study_options(p)
    p.add_argument("--acceptance", default=None, help="acceptance source (see `spectune tune --help`)")
    p.add_argument("--out", default=None,
                   help="policy table YAML path; the profile goes beside it as <out>.profile.yaml "
                        "(default: the profile's path with .policy.yaml)")
    p.set_defaults(func=cmd_autotune)


def cmd_autotune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from spectune.runtime.table import write_table

    profile_out = str(Path(args.out).with_suffix(".profile.yaml")) if args.out else None
    profile, path = _run_profile(args, profile_out)
    try:
        from spectune.autotune.tune_pipeline import tune_table
    except ImportError:
        print("tuning is not available yet: the profile above is the result")
        return 0
    out = Path(args.out) if args.out else path.with_suffix(".policy.yaml")
    policy = tune_table(profile, args.acceptance, seed=args.seed)
    write_table(policy, out)
    assert policy.policy is not None
    for row in policy.policy.rows:
        gain = f"  {row.gain:.3f}x vs plain" if row.gain is not None else ""
        print(f"  batch {row.batch[0]:>4}-{row.batch[1]:<4} K={row.k:<2} budget={row.verify_budget:<5} "
              f"tier={row.tier if row.tier is not None else '-'}{gain}")
    print(f"wrote {out}")
    return 0


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="search the policy for a profile and acceptance -> policy table YAML")
    p.add_argument("profile", help="profile YAML from `spectune profile`")
    p.add_argument("--acceptance", default=None,
                   help="curve:S1,S2,..., mixture:W*curve(...)+..., public:<drafter>/<target>/<dataset>, "
                        "metrics:FILE, FILE.jsonl (default: a published EAGLE-3 curve)")
    p.add_argument("--out", required=True, help="policy table YAML path")
    p.add_argument("--objective", default="goodput", choices=["goodput", "energy", "latency"])
    p.add_argument("--latency-bound-ms", type=float, default=None, help="step (p99 ITL) bound for --objective latency")
    p.add_argument("--capture-budget-mib", type=float, default=None, help="graph capture memory budget")
    p.add_argument("--capture-seconds", type=float, default=None, help="graph capture time budget")
    p.add_argument("--trials", type=int, default=40, help="Optuna trials of the tier-set study")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pareto", action="store_true", help="multi-objective study; prints the Pareto front")
    p.add_argument("--max-batch", type=int, default=None, help="largest batch size covered (default: the profile's)")
    p.add_argument("--smooth", type=float, default=0.005,
                   help="K schedule smoothing: fewest K changes such that no batch size loses more than this "
                        "fraction of its predicted goodput (0 = off; default 0.005)")
    p.add_argument("--context-len", type=int, default=None,
                   help="mean context per request (prompt + half the output) of the traffic to serve "
                        "(default: the profile's context length)")
    p.add_argument("--search-online", action="store_true",
                   help="pick the online correction (EMA weight, hysteresis, min evidence) from a small grid by "
                        "simulated goodput under acceptance drift x0.6 / x1.2 and stationary traffic")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from spectune.autotune.tune_pipeline import tune
    from spectune.runtime.table import read_table, write_table

    if args.trials < 1:
        raise UsageError("--trials must be >= 1")
    if not 0.0 <= args.smooth < 1.0:
        raise UsageError("--smooth must be in [0, 1)")
    if args.context_len is not None and args.context_len < 1:
        raise UsageError("--context-len must be >= 1")
    res = tune(read_table(args.profile), args.acceptance, objective=args.objective,
               capture_budget_mib=args.capture_budget_mib, capture_seconds=args.capture_seconds,
               latency_bound_ms=args.latency_bound_ms, trials=args.trials, seed=args.seed,
               pareto=args.pareto, max_batch=args.max_batch, smooth=args.smooth, online=args.search_online,
               context_len=args.context_len)
    write_table(res.table, args.out)
    s = res.search
    print(f"acceptance: {res.acceptance.source}")
    if res.acceptance.calibration is not None:
        cal = " ".join(f"<{e:g}:{p:.2f}" for e, p in res.acceptance.calibration)
        print(f"drafter confidences: calibration P(accept | conf bin) {cal}")
    print(f"{'batch':>11} {'K':>3} {'budget':>7} {'tier':>6} {'vs plain':>9} {'vs best fixed':>14}")
    for row in s.policy.rows:
        lo, hi = row.batch
        grp = [c for c in s.choices if lo <= c.batch <= hi]
        vs_fixed = sum(c.gain_vs_fixed for c in grp) / len(grp)
        print(f"{lo:>5}-{hi:<5} {row.k:>3} {row.verify_budget:>7} {row.tier or '-':>6} "
              f"{row.gain or 0:>8.3f}x {vs_fixed:>13.3f}x")
    print(f"tiers: {s.policy.tiers}  capture: {s.capture_mib:.0f} MiB, {s.capture_seconds:.1f} s  "
          f"K=0 from batch {s.k0_cutoff}  trials: {s.trials}")
    print(f"smoothing {args.smooth:g}: {s.raw_rows} -> {len(s.policy.rows)} rows, "
          f"worst per-batch predicted loss {s.smooth_loss:.2%}")
    if res.online is not None:
        o = res.online
        drift = "  ".join(f"x{sc:g}@{b}: {r:.3f}" for (sc, b), r in sorted(o.ratios.items()))
        print(f"online: ema {o.ema:g}, hysteresis {o.hysteresis:g}, min_evidence {o.min_evidence:g} "
              f"({o.evaluated} settings simulated); goodput / table alone: {drift}")
    if s.front:
        print("pareto front (gain vs plain, J/token vs plain, step ms vs plain):")
        for f in s.front:
            print(f"  trial {f.trial:>4}: {f.gain:.3f}x  {f.energy_ratio:.3f}  {f.latency_ratio:.3f}")
    print(f"wrote {args.out}")
    return 0


def _add_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a profile or policy table for people")
    p.add_argument("file")
    p.set_defaults(func=cmd_show)


def cmd_show(args: argparse.Namespace) -> int:
    from spectune.runtime.table import read_table

    for line in _show_lines(read_table(args.file)):
        print(line)
    return 0


def _show_lines(t) -> list[str]:
    from spectune.runtime.costs import CostModel
    from spectune.runtime.schema import to_dict

    hw, wl, costs = t.hardware, t.workload, t.costs
    lines = [f"{'policy table' if t.is_policy else 'profile'} ({t.schema}, created {t.created or '?'})"]
    facts = {k: v for k, v in to_dict(hw).items() if v is not None}
    lines.append("hardware: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    lines.append(f"software: spectune {t.software.spectune}, torch {t.software.torch}, triton {t.software.triton}")
    lines.append(f"workload: {wl.target} + {wl.drafter} ({wl.drafter_kind}, {wl.drafter_layers} layers), {wl.dtype}, "
                 f"context {wl.context_len}, K <= {wl.max_k}, batch 1..{wl.max_batch}, {wl.device}")
    m = costs.model
    lines.append(f"cost model ({costs.timer} timer):")
    for part in (m.target, m.drafter, m.overhead, m.power):
        if part is not None:
            body = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in to_dict(part).items())
            lines.append(f"  {type(part).__name__}: {body}")
    e = costs.error
    lines.append(f"  error on {e.held_out} held-out points: median {e.median_rel:.1%}, max {e.max_rel:.1%}")
    model = CostModel(m, wl.drafter_kind, wl.context_len)
    measured = {(p.batch, p.q): p.ms for p in costs.points if p.kind == "target" and not p.held_out}
    batches = sorted({b for b, _ in measured}) or [1, wl.max_batch]
    qs = sorted({q for _, q in measured if q is not None}) or [1, wl.max_k + 1]
    lines.append("target step ms, predicted / measured (rows: batch, columns: tokens per request q)")
    lines.append(f"{'batch':>6} " + " ".join(f"{'q=' + str(q):>15}" for q in qs))
    for b in batches:
        cells = []
        for q in qs:
            pred = model.target_ms(b * q, b)
            meas = measured.get((b, q))
            cells.append(f"{pred:7.3f}/{meas:<7.3f}" if meas is not None else f"{pred:7.3f}/{'-':<7}")
        lines.append(f"{b:>6} " + " ".join(f"{c:>15}" for c in cells))
    if costs.capture:
        lines.append("graph capture per tier: " + ", ".join(f"{c.tokens}: {c.seconds:.2f}s {c.mib:.0f}MiB"
                                                           for c in costs.capture))
    bad = [p for p in costs.points if p.ms is None]
    if bad:
        lines.append(f"infeasible points: {len(bad)} (largest batch {max(p.batch for p in bad)})")
    if t.policy is not None:
        pol = t.policy
        lines.append(f"policy ({pol.objective}): tiers {pol.tiers}, online ema={pol.online.ema}, "
                     f"hysteresis={pol.online.hysteresis}")
        for r in pol.rows:
            gain = f"{r.gain:.3f}x" if r.gain is not None else "-"
            tier = r.tier if r.tier is not None else "-"
            lines.append(f"  batch {r.batch[0]:>4}-{r.batch[1]:<4}  K={r.k:<2}  budget={r.verify_budget:<5}  "
                         f"tier={tier:<6}  gain={gain}")
    return lines


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a profile or policy table (exit 0 valid, 2 not)")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    import json

    from spectune.runtime.table import read_table

    t = read_table(args.file)
    if not args.json:
        print(f"{args.file}: valid {'policy table' if t.is_policy else 'profile'}")
        return 0
    e = t.costs.error
    print(json.dumps({
        "valid": True, "gpu": t.hardware.gpu, "target": t.workload.target, "drafter": t.workload.drafter,
        "kind": "policy" if t.is_policy else "profile",
        "cost_model": {"median_rel_error": e.median_rel, "max_rel_error": e.max_rel, "held_out": e.held_out},
        "rows": len(t.policy.rows) if t.policy is not None else 0,
    }))
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="turn a policy table into an engine's config")
    p.add_argument("policy", help="policy table YAML from `spectune tune`")
    p.add_argument("--format", required=True, choices=["vllm", "sglang", "trtllm"],
                   help="vllm: speculative_config JSON; sglang: --speculative-adaptive-config JSON; "
                        "trtllm: speculative_config YAML (extra LLM API options)")
    p.add_argument("--out", default=None, help="file to write (default: stdout)")
    p.add_argument("--drafter-model", default=None,
                   help="drafter checkpoint to name in the config (vllm `model`, trtllm `speculative_model`)")
    p.add_argument("--method", default=None,
                   help="speculative method to name in the config (vllm `method`, e.g. eagle3; "
                        "trtllm `decoding_type`, e.g. Eagle)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from spectune.autotune.export import export_table
    from spectune.io import atomic_write_text
    from spectune.runtime.table import read_table

    table = read_table(args.policy)
    text = export_table(table, args.format, file=args.policy, method=args.method, model=args.drafter_model)
    if args.out is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out} ({args.format})", file=sys.stderr)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving A/B: plain vs fixed K vs the policy",
                       description="Serve random prompts with a continuous-batching engine on the "
                                   "production shapes (random weights) for each concurrency and arm; "
                                   "acceptance is replayed from an acceptance model (docs/BENCH_METHOD.md). "
                                   "Writes a results JSON for `spectune report`.")
    p.add_argument("--policy", required=True, help="policy table YAML from `spectune tune`")
    p.add_argument("--concurrency", default=None,
                   help="live requests, e.g. 1,8,32 (default 1,8,32,64,128,256 on CUDA, 1,4 on CPU)")
    p.add_argument("--arms", default="plain,fixed:3,fixed:7,auto",
                   help="plain, fixed:K (K drafts always, all verified), auto (the policy table)")
    p.add_argument("--prompts", type=int, default=None,
                   help="requests per concurrency (default on CUDA: 8 x concurrency within 48..1024; "
                        "on CPU: 2 x concurrency)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="output tokens per request (default 128 on CUDA, 16 on CPU)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 256 on CUDA, 16 on CPU)")
    p.add_argument("--acceptance", default=None,
                   help="acceptance source replayed (forms of `spectune tune --acceptance`; default: "
                        "the one the policy was tuned on)")
    p.add_argument("--target", default=None, help="preset or checkpoint folder (default: the policy's target "
                                                  "on CUDA, tiny on CPU)")
    p.add_argument("--drafter", default=None, help="drafter whose cost is paid (default: the policy's)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: the policy's on CUDA, float32 on CPU; float32 on CUDA runs with TF32 "
                        "off: the exactness gate (docs/BENCH_METHOD.md)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds per timed (concurrency, arm) run; unfinished requests count as failed "
                        "(default 30 on CUDA, none on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decisive-logits", choices=["auto", "on", "off"], default="auto",
                   help="bias random-weight logits so greedy decisions survive 16-bit rounding "
                        "(auto: on for bfloat16/float16; see docs/BENCH_METHOD.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="results JSON path")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import os

    import torch

    if args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined
    from spectune.engine.bench import BenchConfig, run_bench

    if args.time_limit is not None and args.time_limit <= 0:
        raise UsageError("--time-limit must be > 0")
    config = BenchConfig(
        policy=args.policy, out=args.out, concurrency=args.concurrency, arms=args.arms, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len, acceptance=args.acceptance,
        target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype, seed=args.seed,
        time_limit_s=args.time_limit, progress=not args.no_progress,
        decisive={"auto": None, "on": True, "off": False}[args.decisive_logits],
    )

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    def show(r: dict) -> None:  # each row as it is measured
        if r is first_row.setdefault("row", r):
            print(f"{'conc':>5} {'arm':>9} {'tok/s':>9} {'decode':>9} {'pred':>9} {'@accept':>9} {'ITL p50':>8} "
                  f"{'p99':>8} {'accept':>7} {'clean':>6} {'J/tok':>7} {'done':>5} {'fail':>5} {'hard':>5} "
                  f"{'tie':>5}")
        print(f"{r['concurrency']:>5} {r['arm']:>9} {r['output_tok_s']:>9.1f} {num(r['decode_tok_s'], '9.1f'):>9} "
              f"{num(r['predicted_tok_s'], '9.1f'):>9} {num(r['predicted_tok_s_at_measured_accept'], '9.1f'):>9} "
              f"{num(r['itl_p50_ms'], '8.2f'):>8} {num(r['itl_p99_ms'], '8.2f'):>8} "
              f"{num(r['mean_accept_len'], '7.2f'):>7} {num(r['mean_accept_len_clean'], '6.2f'):>6} "
              f"{num(r['joules_per_token'], '7.3f'):>7} {r['completed']:>5} {r['failed']:>5} "
              f"{r['hard_mismatches']:>5} {r['near_tie_mismatches']:>5}", flush=True)

    first_row: dict = {}
    try:
        results = run_bench(config, on_row=show)
    except OSError as exc:
        raise UsageError(f"{exc.filename or args.out}: {exc.strerror or exc}") from None
    head = results["header"]
    print(f"{head['gpu']}: {head['target']} + {head['drafter']}, {head['dtype']}, prompt {head['prompt_len']}, "
          f"{head['max_new_tokens']} new tokens, acceptance {head['acceptance']}")
    hard = sum(r["hard_mismatches"] for r in results["rows"])
    ties = sum(r["near_tie_mismatches"] for r in results["rows"])
    if hard:
        print(f"warning: {hard} requests differ from plain greedy decoding with a clear plain margin (a defect), "
              f"{ties} more at near ties ({head['near_tie_tolerance']}; see docs/BENCH_METHOD.md)", file=sys.stderr)
    elif ties:
        print(f"note: {ties} requests diverge from plain greedy decoding at near ties ({head['near_tie_tolerance']}, "
              f"{head['dtype']}): numerical, not a defect; run --dtype float32 for the exactness gate "
              f"(see docs/BENCH_METHOD.md)", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Markdown/HTML report with plots from bench results and profiles",
                       description="Write DIR/report.md, DIR/report.html (self-contained) and DIR/*.png: "
                                   "the A/B table, exactness, simulator vs measured goodput, cost surfaces, "
                                   "chosen K, power, J/token and latency plots.")
    p.add_argument("inputs", nargs="+",
                   help="bench results .json (`spectune bench`), simulation .json "
                        "(benchmarks/sim_policy_vs_fixed.py), profile or policy table .yaml")
    p.add_argument("--out", required=True, help="output folder (created; existing report files are replaced)")
    p.add_argument("--title", default="spectune report")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from spectune.autotune.report import build_report, load_inputs, write_report

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a folder")
    report = build_report(load_inputs(args.inputs), title=args.title)
    files = write_report(report, args.out)
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {files[-1]}, {files[-2]} and {len(report.images)} plots in {args.out}")
    return 0


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_autotune, _add_profile, _add_tune, _add_show, _add_validate, _add_export, _add_bench, _add_report,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spectune",
        description="Measure, tune and run adaptive speculative decoding for one GPU.",
    )
    parser.add_argument("--version", action="version", version=f"spectune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (SpectuneError, UsageError) as exc:
        print(f"spectune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"spectune {args.command}: interrupted (a study resumes where it stopped)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
