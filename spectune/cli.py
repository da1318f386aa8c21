"""The ``spectune`` command. The only module that parses arguments and prints for people (its
argument types and the text of ``show`` live in ``spectune.cli_support``).

Each sub-command has an ``_add_<name>(sub)`` parser builder and a ``cmd_<name>(args) -> int``.
Library errors (SpectuneError and its subclasses, e.g. TableError) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence

from spectune import __version__
from spectune.cli_support import (
    BENCH_MAX_TOKENS,
    INTERRUPTED,
    POSITIVE,
    SEED,
    TRIALS_MAX,
    BadArgument,
    Parser,
    nonempty,
    number,
    one_line,
    show_lines,
)
from spectune.errors import SpectuneError
from spectune.runtime.table import DTYPES, MAX_BATCH, MAX_CONTEXT, MAX_K, Table


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------
# shared options


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--target", default=None, type=nonempty,
                   help="preset (tiny, qwen3-0.6b, qwen3-4b, qwen3-8b, qwen3-32b, llama-3.1-8b) or a local "
                        "Hugging Face checkpoint folder (config.json gives the shapes); default tiny, "
                        "or the joined study's")
    g.add_argument("--drafter", default=None, type=nonempty,
                   help="eagle-<N>l or mtp-<N>l (autoregressive, N decoder layers) or dflash-<N>l "
                        "(parallel block drafter); default eagle-1l, or the joined study's")
    g.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    g.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default bfloat16 on CUDA, float32 on CPU; fp8: the target's projections in "
                        "e4m3 (per-channel weight and per-token activation scales), activations, "
                        "attention, KV cache and drafter in bfloat16")
    g.add_argument("--batch-sizes", default=None,
                   help="range or list, e.g. 1-256 or 1,2,4,8 (default 1-256 on CUDA, 1-16 on CPU)")
    g.add_argument("--max-k", type=number(int, 1, MAX_K), default=None,
                   help="largest draft length (default 15 on CUDA, 7 on CPU)")
    g.add_argument("--context-len", type=number(int, 1, MAX_CONTEXT), default=None,
                   help="KV context per request (default 2048 on CUDA, 256 on CPU)")
    _add_fused_option(g)


def _add_fused_option(g: argparse._ActionsContainer) -> None:
    g.add_argument("--fused", action="store_true",
                   help="target and drafter layers with the fused Triton kernels (residual + RMSNorm, "
                        "q/k-norm + RoPE, SiLU x mul); default off, as the shipped profiles were measured")


def _add_study_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("measurement study")
    g.add_argument("--storage", default=None,
                   help="Optuna storage URL (default: a journal file beside --out); "
                        "postgresql://... to share one study across GPUs and hosts")
    g.add_argument("--study-name", default=None,
                   help="default: derived from GPU and workload; with --storage, joins that study (options left "
                        "out are the study's)")
    g.add_argument("--trials", type=number(int, 0, TRIALS_MAX), default=None,
                   help="measurement trials beyond the seed grid")
    g.add_argument("--seed", type=SEED, default=None, help="default 0")
    g.add_argument("--workers", default="1", metavar="N|auto",
                   help="local worker processes sharing the study (auto: one per visible GPU; on CPU, N "
                        "processes); default 1")
    g.add_argument("--timing-lock", default="auto", choices=["auto", "on", "off"],
                   help="workers on one GPU take turns at measuring (a lock keyed by the GPU's UUID around "
                        "each point's build, capture, warm-up, timed replays and NVML sampling; claims and "
                        "storage writes overlap): auto = on CUDA")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _workers(text: str) -> int:
    if text == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--workers: expected a number or auto, got {text!r}") from None
    if n < 1:
        raise UsageError(f"--workers: must be >= 1 (or auto), got {n}")
    return n


def _profile_config(args: argparse.Namespace, out: str | None):
    from spectune.autotune.profiler import ProfileConfig

    return ProfileConfig(
        target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
        batch_sizes=args.batch_sizes, max_k=args.max_k, context_len=args.context_len, out=out,
        storage=args.storage, study_name=args.study_name, trials=args.trials, seed=args.seed,
        progress=not args.no_progress, workers=_workers(args.workers), collect=getattr(args, "collect", False),
        timing_lock=getattr(args, "timing_lock", "auto"), fused=getattr(args, "fused", False),
    )


def _run_profile(args: argparse.Namespace, out: str | None):
    """Profile and print a short summary; returns (table, path written)."""
    from spectune.autotune.profiler import default_out, run_profile

    config = _profile_config(args, out)
    path = default_out(config) if not config.collect else None
    try:
        table, frame = run_profile(config)
    except OSError as exc:
        raise UsageError(f"{exc.filename or path}: {exc.strerror or exc}") from None
    from pathlib import Path

    study = frame.attrs["study"]
    path = Path(study["out"])
    if config.collect:
        print(f"collected study {study['name']} from {study['storage']}: {len(frame)} points")
    elif study["kept"]:
        print(f"resumed study {study['name']} in {study['storage']}: kept {study['kept']} points, "
              f"measured {study['measured_now']} now")
    if study["given_up"]:
        print(f"warning: {len(study['given_up'])} points were given up (their worker died twice): "
              f"{', '.join(study['given_up'][:5])}", file=sys.stderr)
    err = table.costs.error
    _warn_profile(table, "every table tuned on this profile inherits it")
    bad = int((~frame["feasible"].astype(bool)).sum()) if len(frame) else 0
    print(f"{table.hardware.gpu}: {table.workload.target} + {table.workload.drafter}, "
          f"{table.workload.dtype}, context {table.workload.context_len}, batch 1..{table.workload.max_batch}, "
          f"K <= {table.workload.max_k}")
    print(f"points: {len(frame)} measured ({bad} infeasible), timer {table.costs.timer}")
    print(f"cost model error on {err.held_out} held-out points: median {err.median_rel:.1%}, max {err.max_rel:.1%}")
    print(f"wrote {path} and {path.with_suffix('.csv')}")
    return table, path


def _warn_profile(table, consequence: str) -> None:
    """Loud warnings about the cost model a table carries (held-out error, inconsistent points)."""
    from spectune.autotune.fit import error_warning
    from spectune.runtime.costs import consistent_rows

    line = error_warning(table.costs.error)
    if line:
        print(f"WARNING: {line}; {consequence}", file=sys.stderr)
    _, notes = consistent_rows(table.costs.model.target, table.costs.points, table.workload.context_len)
    for note in notes:
        print(f"warning: residual correction: {note}", file=sys.stderr)


def _progress(label: str):
    """A callback ``(done, total)`` printing ``label done/total`` on stderr about every 10 %."""
    last = [-1]

    def show(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if tenth != last[0] or done == total:
            last[0] = tenth
            print(f"{label} {done}/{total}", file=sys.stderr, flush=True)

    return show


# ---------------------------------------------------------------------------------------------
# sub-commands (filled in by their modules' owners)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the cost surface on this GPU -> profile YAML",
                       description="Measure drafter, target-verification and runtime costs with "
                                   "CUDA-graph replays and NVML power, fit the cost model, write a profile.")
    _add_workload_options(p)
    _add_study_options(p)
    p.add_argument("--collect", action="store_true",
                   help="measure nothing: fit the finished study named by --storage/--study-name (all its "
                        "workers' points) and write its profile to --out")
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

    from spectune.autotune.acceptance import resolve_acceptance
    from spectune.autotune.profiler import resolve
    from spectune.runtime.table import write_table

    profile_out = str(Path(args.out).with_suffix(".profile.yaml")) if args.out else None
    # a bad acceptance source fails now, not after the whole profile
    acceptance = resolve_acceptance(args.acceptance, resolve(_profile_config(args, profile_out)).max_k)
    profile, path = _run_profile(args, profile_out)
    try:
        from spectune.autotune.tune_pipeline import tune_table
    except ImportError:
        print("tuning is not available yet: the profile above is the result")
        return 0
    out = Path(args.out) if args.out else path.with_suffix(".policy.yaml")
    policy = tune_table(profile, acceptance, seed=args.seed or 0)
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
                        "metrics:FILE (vLLM), trtllm-stats:FILE, sglang-metrics:S0,S1,..., FILE.jsonl "
                        "(default: a published EAGLE-3 curve)")
    p.add_argument("--scrape-every", type=float, default=None,
                   help="with a vLLM metrics URL: scrape it every S seconds and read per-interval deltas "
                        "(exact where each interval ran one K; docs/EXPORTS.md)")
    p.add_argument("--scrape-for", type=float, default=None, help="with --scrape-every: poll for S seconds")
    p.add_argument("--out", required=True, help="policy table YAML path")
    p.add_argument("--objective", default="goodput", choices=["goodput", "energy", "latency"])
    p.add_argument("--latency-bound-ms", type=POSITIVE, default=None,
                   help="step (p99 ITL) bound for --objective latency")
    p.add_argument("--capture-budget-mib", type=POSITIVE, default=None, help="graph capture memory budget")
    p.add_argument("--capture-seconds", type=POSITIVE, default=None, help="graph capture time budget")
    p.add_argument("--trials", type=number(int, 1, TRIALS_MAX), default=40, help="Optuna trials of the tier-set study")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--pareto", action="store_true", help="multi-objective study; prints the Pareto front")
    p.add_argument("--max-batch", type=number(int, 1, MAX_BATCH), default=None,
                   help=f"largest batch size covered (default: the profile's; at most {MAX_BATCH})")
    p.add_argument("--smooth", type=number(float, 0.0, 0.999), default=0.005,
                   help="K schedule smoothing: fewest K changes such that no batch size loses more than this "
                        "fraction of its predicted goodput (0 = off; default 0.005)")
    p.add_argument("--context-len", type=number(int, 1, MAX_CONTEXT), default=None,
                   help="mean context per request (prompt + half the output) of the traffic to serve "
                        "(default: the profile's context length)")
    p.add_argument("--search-online", action="store_true",
                   help="pick the online controller (estimate window, margin, min evidence) from a small grid by "
                        "simulated goodput under acceptance drift x0.6 / x1.2 and stationary traffic")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_tune)


def _k0_line(table: Table, k0_cutoff: int) -> str:
    """Where plain decoding starts: in the rows, or past them where the runtime (and the engine
    exports: the same schedule) keep drafting while the cost model says it pays (``Planner.uniform_k``,
    0 from the largest tier on)."""
    from spectune.autotune.engine_schedule import schedule_from_table

    last = table.workload.max_batch
    if k0_cutoff <= last:
        return f"K=0 from batch {k0_cutoff}"
    assert table.policy is not None  # (a tuned table)
    past = schedule_from_table(table, top=max(last + 1, table.policy.tiers[-1]))
    b = next(lo for lo, _, k in past if lo > last and k == 0)
    return f"K>0 at every row (1..{last}); past the rows K=0 from batch {b} (cost model)"


def _polled_acceptance(args: argparse.Namespace):
    """--acceptance as given, or with --scrape-every/--scrape-for the model of a polled vLLM URL."""
    if args.scrape_every is None and args.scrape_for is None:
        return args.acceptance
    from spectune.autotune.acceptance_sources import metrics_model, poll_scrapes, split_spec
    from spectune.runtime.table import read_table

    if args.scrape_every is None or args.scrape_for is None:
        raise UsageError("--scrape-every and --scrape-for go together")
    for name, value in (("--scrape-every", args.scrape_every), ("--scrape-for", args.scrape_for)):
        if not value > 0:
            raise UsageError(f"{name}: must be > 0 seconds, got {value:g}")
    paths, model, ks = split_spec(args.acceptance or "")
    if len(paths) != 1 or not paths[0].lower().startswith(("http://", "https://")):
        raise UsageError("--scrape-every needs --acceptance http(s)://HOST:PORT/metrics (one URL)")
    max_k = read_table(args.profile).workload.max_k
    print(f"scraping {paths[0]} every {args.scrape_every:g} s for {args.scrape_for:g} s", file=sys.stderr)
    texts = poll_scrapes(paths[0], every_s=args.scrape_every, for_s=args.scrape_for)
    return metrics_model(texts, max_k=max_k, model=model, ks=ks)


def cmd_tune(args: argparse.Namespace) -> int:
    from spectune.autotune.tune_pipeline import tune
    from spectune.errors import TableError
    from spectune.runtime.table import read_table, write_table

    profile = read_table(args.profile)
    _warn_profile(profile, f"the table written to {args.out} inherits it")
    try:
        res = tune(profile, _polled_acceptance(args), objective=args.objective,
                   capture_budget_mib=args.capture_budget_mib, capture_seconds=args.capture_seconds,
                   latency_bound_ms=args.latency_bound_ms, trials=args.trials, seed=args.seed,
                   pareto=args.pareto, max_batch=args.max_batch, smooth=args.smooth, online=args.search_online,
                   context_len=args.context_len,
                   progress=None if args.no_progress else _progress("tune: operating grid, batch"))
    except TableError as exc:  # a field of the profile: name the file
        raise TableError(exc.field, exc.reason, exc.file or args.profile) from None
    write_table(res.table, args.out)
    s = res.search
    if res.batch_cap is not None:
        print(f"out of memory in the profile: rows end at batch {res.batch_cap} (the largest batch measured to fit)",
              file=sys.stderr)
    if res.dropped_tiers:
        print(f"out of memory in the profile: tiers {list(res.dropped_tiers)} left out (a step of that size did not "
              f"fit)", file=sys.stderr)
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
          f"{_k0_line(res.table, s.k0_cutoff)}  trials: {s.trials}")
    print(f"smoothing {args.smooth:g}: {s.raw_rows} -> {len(s.policy.rows)} rows, "
          f"worst per-batch predicted loss {s.smooth_loss:.2%}")
    if res.online is not None:
        o = res.online
        drift = "  ".join(f"x{sc:g}@{b}: {r:.3f}" for (sc, b), r in sorted(o.ratios.items()))
        print(f"online: window {o.window:g}, margin {o.margin:g}, min_evidence {o.min_evidence:g} "
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

    for line in show_lines(read_table(args.file)):
        print(line)
    return 0


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
    p = sub.add_parser("export", help="turn a policy table into an engine's config and server flags",
                       description="Write the engine's config file (stdout or --out) and print the server "
                                   "flags that go with it on stderr (docs/EXPORTS.md).")
    p.add_argument("policy", help="policy table YAML from `spectune tune`")
    p.add_argument("--format", required=True, choices=["vllm", "sglang", "trtllm"],
                   help="vllm: --speculative-config JSON; sglang: --speculative-adaptive-config JSON; "
                        "trtllm: extra LLM API options YAML")
    p.add_argument("--out", default=None, help="file to write (default: stdout)")
    p.add_argument("--method", default=None,
                   help="speculative method, required: vllm ngram|eagle|eagle3|mtp|draft_model|...; "
                        "sglang EAGLE|EAGLE3; trtllm eagle|eagle3|ngram|draft_model|mtp")
    p.add_argument("--drafter-model", default=None,
                   help="drafter checkpoint (vllm `model`, sglang --speculative-draft-model-path, trtllm "
                        "`speculative_model`); required unless the method needs none (ngram, mtp)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="largest batch the engine runs: vllm --max-num-seqs (default 1024, vLLM's default on "
                        "H100/H200), sglang's largest captured batch and trtllm max_batch_size (default: the "
                        "policy's largest batch)")
    p.add_argument("--engine-version", default=None,
                   help="engine version whose rules to follow: vllm 0.33, sglang 0.5.23, trtllm upper|lower "
                        "(draft_len_schedule key semantics of the newer / older code; default: the first)")
    p.set_defaults(func=cmd_export)


# an engine's --method -> the drafter family whose costs and acceptance a table was tuned with
METHOD_FAMILY = {"eagle": "eagle", "eagle3": "eagle", "mtp": "mtp", "dflash": "dflash", "dspark": "dflash",
                 "ngram": "n-gram", "ngram_gpu": "n-gram", "suffix": "n-gram"}


def _export_notes(table: Table, method: str | None) -> list[str]:
    """What the engine will run that the table did not measure: a CPU or toy table, or a method of
    another drafter family (its drafter's cost and acceptance are not the table's)."""
    notes = []
    if table.hardware.gpu.strip().lower() == "cpu" or table.workload.target == "tiny":
        notes.append(f"measured on {table.hardware.gpu} with target {table.workload.target}: its K are not a "
                     f"GPU's; profile and tune on the serving GPU")
    family = METHOD_FAMILY.get((method or "").lower())
    drafter = table.workload.drafter.split("-")[0]
    if family is not None and family != drafter:
        notes.append(f"--method {method} runs a {family} drafter, but the table was tuned for "
                     f"{table.workload.drafter} (its drafter's cost and acceptance)")
    return notes


def cmd_export(args: argparse.Namespace) -> int:
    from spectune.autotune.export import export_table, flags_line
    from spectune.io import atomic_write_text
    from spectune.runtime.table import read_table

    table = read_table(args.policy)
    exp = export_table(table, args.format, file=args.policy, method=args.method, model=args.drafter_model,
                       max_batch=args.max_batch, engine_version=args.engine_version, config_path=args.out)
    if args.out is None:
        sys.stdout.write(exp.text)
    else:
        atomic_write_text(args.out, exp.text)
        print(f"wrote {args.out} ({args.format} {exp.engine_version})", file=sys.stderr)
    for note in _export_notes(table, args.method):  # once written: an error stays the one line
        print(f"note: {args.policy}: {note}", file=sys.stderr)
    print(f"server flags: {flags_line(exp)}", file=sys.stderr)
    return 0


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit the profile's cost model to your engine's own benchmark results",
                       description="Read vllm bench latency/serve and sglang bench_one_batch/bench_serving outputs, "
                                   "rescale the cost model's weight-bound, per-token and drafter parts to them, "
                                   "report the error on held-out points, write a profile for `spectune tune`.")
    p.add_argument("profile", help="profile (or policy table) YAML")
    p.add_argument("--engine-results", nargs="+", required=True,
                   help="result files (FILE or FILE#batch=B&input=I&output=O for vllm bench latency)")
    p.add_argument("--out", required=True, help="calibrated profile YAML")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from spectune.autotune.calibrate import calibrate_profile, read_engine_results
    from spectune.runtime.table import read_table, write_table

    table = read_table(args.profile)
    points = [p for spec in args.engine_results for p in read_engine_results(spec)]
    cal = calibrate_profile(table, points)
    write_table(cal.table, args.out)
    s = cal.scales
    print(f"{len(points)} engine points; scales: weight-bound {s['weight']:.3f}, per-token {s['token']:.3f}, "
          f"drafter {s['drafter']:.3f}" + ("" if any(p.k for p in points) else " (not calibrated: no K > 0 point)"))
    (b_med, b_max), (a_med, a_max) = cal.error_before, cal.error_after
    print(f"error on {cal.held_out} held-out points: median {a_med:.1%}, max {a_max:.1%} "
          f"(uncalibrated: median {b_med:.1%}, max {b_max:.1%})")
    print(f"wrote {args.out}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving A/B: plain vs fixed K vs the policy",
                       description="Serve random prompts with a continuous-batching engine on the "
                                   "production shapes (random weights) for each concurrency and arm; "
                                   "acceptance is replayed from an acceptance model (docs/BENCH_METHOD.md). "
                                   "Writes a results JSON for `spectune report`.")
    p.add_argument("--policy", required=True, help="policy table YAML from `spectune tune`")
    _add_fused_option(p)
    p.add_argument("--concurrency", default=None,
                   help="live requests, e.g. 1,8,32 (default 1,8,32,64,128,256 on CUDA, 1,4 on CPU)")
    p.add_argument("--arms", default=None,
                   help="plain, fixed:K (K drafts always, all verified), auto (the policy table); default "
                        "at each concurrency: plain, the simulator's best fixed K and its neighbours, auto")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved timed runs per (concurrency, arm), arm order rotated per repeat (default 3)")
    p.add_argument("--drift", default=None,
                   help="A,B: requests admitted after half of each run's requests are served with B")
    p.add_argument("--prompts", type=number(int, 1, TRIALS_MAX), default=None,
                   help="requests per concurrency (default on CUDA: 8 x concurrency within 48..1024; "
                        "on CPU: 2 x concurrency)")
    p.add_argument("--max-new-tokens", type=number(int, 1, BENCH_MAX_TOKENS), default=None, help="output tokens per request (default 128 on CUDA, 16 on CPU)")
    p.add_argument("--prompt-len", type=number(int, 1, BENCH_MAX_TOKENS), default=None, help="prompt tokens per request (default 256 on CUDA, 16 on CPU)")
    p.add_argument("--acceptance", default=None,
                   help="acceptance source replayed (forms of `spectune tune --acceptance`; default: "
                        "the one the policy was tuned on)")
    p.add_argument("--target", default=None, help="preset or checkpoint folder (default: the policy's target "
                                                  "on CUDA, tiny on CPU)")
    p.add_argument("--drafter", default=None, help="drafter whose cost is paid (default: the policy's)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default: the policy's on CUDA, float32 on CPU; fp8 as in profile; float32 on CUDA runs with TF32 "
                        "off: the exactness gate (docs/BENCH_METHOD.md)")
    p.add_argument("--time-limit", type=POSITIVE, default=None,
                   help="seconds per timed (concurrency, arm) run; unfinished requests count as failed "
                        "(default 30 on CUDA, none on CPU)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--decisive-logits", choices=["auto", "on", "off"], default="auto",
                   help="bias random-weight logits so greedy decisions survive 16-bit rounding "
                        "(auto: on for bfloat16/float16; see docs/BENCH_METHOD.md)")
    _add_ride_options(p, BENCH_MAX_TOKENS, BENCH_MAX_TOKENS * 1024,
                      "admitted prompts ride in the decode/verify steps' target forward (chunked prefill "
                      "inside the step) instead of separate prefill forwards; auto gives a riding step its "
                      "own shape (Planner.plan_ride: a smaller K where the prompt tokens make deep drafts dear)")
    p.add_argument("--ride-pieces", type=number(int, 1, BENCH_MAX_TOKENS), default=None,
                   help="with --mixed-prefill: prompt pieces one step carries at most (default 16; the "
                        "pieces' attention launch has a program per piece slot)")
    p.add_argument("--await-ends", action="store_true",
                   help="the engine's host reads the last step's tokens before planning the next where a live "
                        "row may have ended and a request waits for its slot (no idle row, no late admission; "
                        "the device waits for the host there)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="results JSON path")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import os

    import torch

    if args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined
    from spectune.engine.bench import DEFAULT_PREFILL_BUDGET, BenchConfig, run_bench
    from spectune.engine.bench_accounting import captured_runs
    from spectune.runtime.prefill_plan import RIDE_PIECES

    if (args.prompt_len or 0) + (args.max_new_tokens or 0) > BENCH_MAX_TOKENS:
        raise UsageError(f"--prompt-len + --max-new-tokens: must be <= {BENCH_MAX_TOKENS} (each request's KV "
                         "cache is allocated up front)")
    _only_with_mixed(args, "--prefill-budget", "--ride-limit", "--ride-pieces", "--admit-ahead")
    if args.acceptance is not None:  # a bad source fails now, before any model is built
        from spectune.autotune.acceptance import resolve_acceptance
        from spectune.runtime.table import read_table

        resolve_acceptance(args.acceptance, max(read_table(args.policy).workload.max_k, 1))
    config = BenchConfig(
        policy=args.policy, out=args.out, concurrency=args.concurrency, arms=args.arms, prompts=args.prompts,
        max_new_tokens=args.max_new_tokens, prompt_len=args.prompt_len, acceptance=args.acceptance,
        target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype, seed=args.seed,
        time_limit_s=args.time_limit, progress=not args.no_progress,
        decisive={"auto": None, "on": True, "off": False}[args.decisive_logits],
        drift=args.drift, repeats=args.repeats, fused=args.fused, mixed_prefill=args.mixed_prefill,
        prefill_budget=args.prefill_budget or DEFAULT_PREFILL_BUDGET, ride_limit=args.ride_limit,
        ride_pieces=args.ride_pieces or RIDE_PIECES, admit_ahead=args.admit_ahead is not False,
        await_ends=args.await_ends,
    )

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    def show(r: dict) -> None:  # each row as it is measured
        if r is first_row.setdefault("row", r):
            print(f"{'conc':>5} {'arm':>9} {'rep':>3} {'e2e':>9} {'pred':>9} {'decode':>9} {'pred':>9} {'@accept':>9} "
                  f"{'ITL p50':>8} {'p99':>8} {'accept':>7} {'clean':>6} {'J/tok':>7} {'done':>5} {'fail':>5} "
                  f"{'hard':>5} {'tie':>5}")
        print(f"{r['concurrency']:>5} {r['arm']:>9} {r.get('repeat', 0):>3} {r['output_tok_s']:>9.1f} "
              f"{num(r.get('predicted_output_tok_s'), '9.1f'):>9} {num(r['decode_tok_s'], '9.1f'):>9} "
              f"{num(r['predicted_tok_s'], '9.1f'):>9} {num(r['predicted_tok_s_at_measured_accept'], '9.1f'):>9} "
              f"{num(r['itl_p50_ms'], '8.2f'):>8} {num(r['itl_p99_ms'], '8.2f'):>8} "
              f"{num(r['mean_accept_len'], '7.2f'):>7} {num(r['mean_accept_len_clean'], '6.2f'):>6} "
              f"{num(r['joules_per_token'], '7.3f'):>7} {r['completed']:>5} {r['failed']:>5} "
              f"{r['hard_mismatches']:>5} {r['near_tie_mismatches']:>5}"
              f"{'  TIMED OUT' if r.get('timed_out') else ''}", flush=True)

    first_row: dict = {}
    try:
        results = run_bench(config, on_row=show)
    except OSError as exc:
        raise UsageError(f"{exc.filename or args.out}: {exc.strerror or exc}") from None
    head = results["header"]
    if head["target"] == "tiny" and head["gpu"] == "cpu" and args.target is None:  # (after the run: an error
        from spectune.runtime.table import read_table  # stays the one line)

        table = read_table(args.policy)
        if table.workload.target != "tiny":
            print(f"note: on CPU the bench serves the `tiny` target in float32, not {table.workload.target}: it checks "
                  f"that the engine runs; the pred columns are the table's {table.hardware.gpu} figures",
                  file=sys.stderr)
    print(f"{head['gpu']}: {head['target']} + {head['drafter']}, {head['dtype']}, prompt {head['prompt_len']}, "
          f"{head['max_new_tokens']} new tokens, acceptance {head['acceptance']} "
          f"(tuned on {head.get('tuned_acceptance')})")
    for line in _summary_lines(results.get("summary")):
        print(line)
    full = results.get("summary_full_load") or {}
    for r in full.get("ratios", []):
        print(f"c={r['concurrency']} at full load (steps at concurrency {r['concurrency']}): {_auto_ratios(r)}")
    hard = sum(r["hard_mismatches"] for r in results["rows"])
    ties = sum(r["near_tie_mismatches"] for r in results["rows"])
    if hard:
        print(f"warning: {hard} requests differ from plain greedy decoding with a clear plain margin (a defect), "
              f"{ties} more at near ties ({head['near_tie_tolerance']}; see docs/BENCH_METHOD.md)", file=sys.stderr)
    elif ties:
        print(f"note: {ties} requests diverge from plain greedy decoding at near ties ({head['near_tie_tolerance']}, "
              f"{head['dtype']}): numerical, not a defect; run --dtype float32 for the exactness gate "
              f"(see docs/BENCH_METHOD.md)", file=sys.stderr)
    captured = captured_runs(results["rows"])
    if captured:
        print(f"warning: {len(captured)} timed runs captured CUDA graphs inside the run ({', '.join(captured[:6])}"
              f"{', ...' if len(captured) > 6 else ''}): each capture stalls a step, so their throughput reads low "
              f"(graph_captures_in_run in {args.out})", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="what-if: a policy table vs plain and fixed K on an acceptance, simulated",
                       description="Play closed serving runs through the table's cost model for each "
                                   "concurrency and arm (plain, fixed:K, auto: a fresh planner per run); "
                                   "allocation ranks by each request's own acceptance history.")
    p.add_argument("policy", help="policy table YAML from `spectune tune`")
    p.add_argument("--acceptance", default=None,
                   help="acceptance served (forms of `spectune tune --acceptance`; default: the one "
                        "the policy was tuned on)")
    p.add_argument("--concurrency", default="1,16,64,256", help="live requests, e.g. 1,8,32 (default 1,16,64,256)")
    p.add_argument("--arms", default=None,
                   help="plain, fixed:K, auto (default: plain, fixed:1..min(max_k,7), the best fixed K "
                        "and its neighbours, auto)")
    p.add_argument("--drift", default=None,
                   help="A,B: requests of the second half of each run draw their acceptance from B")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default 8 x concurrency within 64..1024)")
    p.add_argument("--repeats", type=int, default=3, help="seeds per (concurrency, arm), pooled (default 3)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="new tokens per request (default 127; `spectune bench`'s --max-new-tokens minus 1)")
    p.add_argument("--prompt-len", type=number(int, 1, 1 << 17), default=None,
                   help="prompt tokens per request: adds end-to-end tok/s, each admission's separate "
                        "prefill forwards at the table's step time (as `spectune bench` prefills)")
    _add_ride_options(p, 1 << 17, 1 << 30,
                      "with --prompt-len: prompts ride in the decode steps (`spectune bench --mixed-prefill`), "
                      "each riding step's target at its tier + prompt tokens, auto's at Planner.plan_ride's shape")
    p.add_argument("--shared-planner", action="store_true",
                   help="auto: one planner, trained by a first untimed run, serves every seed (what "
                        "`spectune bench` does with --repeats) instead of a fresh planner per run")
    p.add_argument("--served-cost", default=None, metavar="PROFILE",
                   help="play the GPU's step times from this profile's cost model (same target and "
                        "drafter, e.g. a re-profile), while the policy plans with its own: what the "
                        "controller does where its table's cost model is off")
    p.add_argument("--host-lag", action="store_true",
                   help="an engine whose host plans each step while the device runs the one before (spectune "
                        "bench's): a request that ends on a step emitting two or more of its tokens is learnt a "
                        "step late and rides one more step as an idle row")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_simulate)


def _add_ride_options(p: argparse.ArgumentParser, budget_max: int, limit_max: int, mixed_help: str) -> None:
    """--mixed-prefill and its --prefill-budget / --ride-limit (`bench` and `simulate`)."""
    p.add_argument("--mixed-prefill", action="store_true", help=mixed_help)
    p.add_argument("--prefill-budget", type=number(int, 1, budget_max), default=None,
                   help="prompt tokens one step carries with --mixed-prefill (default 256)")
    p.add_argument("--ride-limit", type=number(int, 1, limit_max), default=None,
                   help="with --mixed-prefill: an admission of more prompt tokens than this, with no prompt "
                        "still riding, takes separate prefill forwards (default: the prefill budget)")
    p.add_argument("--admit-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="with --mixed-prefill (on by default there): a request that may end by the next step "
                        "lends its slot to a successor whose prompt rides in that step; the successor waits "
                        "ready and joins as the slot frees (no step runs a row short while a prompt rides)")


def _only_with_mixed(args: argparse.Namespace, *options: str) -> None:
    """Each of ``options`` given without --mixed-prefill is a usage error naming it."""
    for option in options:
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None and not args.mixed_prefill:
            named = "--no-" + option[2:] if value is False else option  # (a BooleanOptionalAction's off)
            raise UsageError(f"{named}: only used with --mixed-prefill")


def cmd_simulate(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from spectune.autotune.acceptance import AcceptanceModel, resolve_acceptance
    from spectune.autotune.whatif import (
        WhatIf,
        parse_arms,
        served_cost_of,
        simulate_table,
        split_drift,
    )
    from spectune.runtime.planner import load
    from spectune.runtime.prefill_plan import RIDE_BUDGET, Riding

    for option, value in (("--requests", args.requests), ("--repeats", args.repeats),
                          ("--decode-tokens", args.decode_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be >= 1, got {value}")
    if args.mixed_prefill and args.prompt_len is None:
        raise UsageError("--mixed-prefill: needs --prompt-len (the prompts that ride)")
    _only_with_mixed(args, "--prefill-budget", "--ride-limit", "--admit-ahead")
    concurrency = _positive_ints(args.concurrency, "--concurrency")
    planner = load(args.policy, on_gpu_mismatch="ignore")
    arms = parse_arms(args.arms, planner.table.workload.max_k) if args.arms is not None else None
    max_k = max(1, planner.k_hi)
    tuned = AcceptanceModel.from_dict(planner.table.acceptance) if planner.table.acceptance else None
    drift = None
    if args.drift is not None:
        first, second = split_drift(args.drift)
        served, drift = resolve_acceptance(first, max_k), resolve_acceptance(second, max_k)
    else:
        served = resolve_acceptance(args.acceptance if args.acceptance is not None else tuned, max_k)
    what = WhatIf(planner.fresh, served, drift, repeats=args.repeats,
                  shared=args.shared_planner, host_lag=args.host_lag,
                  served_cost=served_cost_of(args.served_cost, planner.table) if args.served_cost else None)
    if args.decode_tokens is not None:
        what = dataclasses.replace(what, decode_tokens=args.decode_tokens)
    if args.requests is not None:
        what = dataclasses.replace(what, requests=lambda c: args.requests)
    if args.prompt_len is not None:
        what = dataclasses.replace(what, prompt_len=args.prompt_len)
    if args.mixed_prefill:
        what = dataclasses.replace(what, ride=Riding(args.prompt_len, args.prefill_budget or RIDE_BUDGET,
                                                     args.ride_limit, ahead=args.admit_ahead is not False))
    out = simulate_table(what, concurrency, arms)
    out["served_cost"] = args.served_cost
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"served: {out['acceptance']}\ntuned on: {out['tuned_acceptance']}")
    if args.served_cost is not None:
        print(f"step times served from: {args.served_cost}")
    e2e = args.prompt_len is not None
    print(f"{'conc':>5} {'arm':>9} {'tok/s':>10} {'vs best':>8} {'full':>10} {'vs best':>8} "
          + (f"{'e2e':>10} " if e2e else "") + f"{'ITL p50':>8} {'p99':>8} {'accept':>7}  k_hist   "
          "(full: the steps at full concurrency" + (("; e2e: prompts riding in the steps, bursts by prefill forwards)"
                                                   if args.mixed_prefill else "; e2e: with the prefill forwards)")
                                                  if e2e else ")"))
    for r in out["rows"]:
        ratio, full_ratio = (f"{r[key]:.3f}" if r[key] is not None else "-"
                             for key in ("ratio_vs_best_other", "full_ratio_vs_best_other"))
        hist = " ".join(f"{k}:{n}" for k, n in r["k_hist"].items()) if r["arm"] == "auto" else ""
        print(f"{r['concurrency']:>5} {r['arm']:>9} {r['goodput_tok_s'] or 0:>10.1f} {ratio:>8} "
              f"{r['full_tok_s'] or 0:>10.1f} {full_ratio:>8} "
              + (f"{r['output_tok_s'] or 0:>10.1f} " if e2e else "")
              + f"{r['itl_p50_ms'] or 0:>8.2f} {r['itl_p99_ms'] or 0:>8.2f} {r['mean_accept_len']:>7.2f}  {hist}")
    return 0


def _positive_ints(text: str, option: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise UsageError(f"{option}: cannot read {text!r} (e.g. 1,8,32)") from None
    if not values or values[0] < 1:
        raise UsageError(f"{option}: must be integers >= 1, got {text!r}")
    return values


def _ci(v: float | None, lo_hi: Sequence[float] | None, fmt: str) -> str:
    return f"{v:{fmt}} [{lo_hi[0]:{fmt}}, {lo_hi[1]:{fmt}}]" if v is not None and lo_hi else "-"


def _summary_lines(summary: dict | None) -> list[str]:
    """Means over repeats with 95 % intervals, timed-out runs, and auto / best other arm."""
    if not summary:
        return []
    lines = [f"{'conc':>5} {'arm':>9} {'runs':>4} {'decode tok/s mean [95% interval]':>36} {'timed out':>9}"]
    for a in summary["arms"]:
        lines.append(f"{a['concurrency']:>5} {a['arm']:>9} {a['repeats']:>4} "
                     f"{_ci(a['decode_tok_s'], a['ci95'], '.1f'):>36} {a['timed_out']:>9}")
    for r in summary["ratios"]:
        lines.append(f"c={r['concurrency']}: {_auto_ratios(r)}")
    return lines


def _auto_ratios(r: dict) -> str:
    """auto / the best other arm, then auto / plain; once where plain is the best other arm (the
    same ratio twice reads as two findings)."""
    text = f"auto / {r['best_other']} = {_ci(r['vs_best_other'], r['vs_best_other_ci95'], '.3f')}"
    if r["best_other"] != "plain":
        text += f", auto / plain = {_ci(r['vs_plain'], r['vs_plain_ci95'], '.3f')}"
    return text


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Markdown/HTML report with plots from bench results and profiles",
                       description="Write DIR/report.md, DIR/report.html (self-contained) and DIR/*.png: "
                                   "the A/B table, exactness, simulator vs measured goodput, cost surfaces, "
                                   "chosen K, power, J/token and latency plots.")
    p.add_argument("inputs", nargs="+",
                   help="bench results .json (`spectune bench`), simulation .json "
                        "(benchmarks/sim_policy_vs_fixed.py), profile or policy table .yaml")
    p.add_argument("--out", required=True, help="output folder (created; the files this report writes are replaced, others in it are left as they are)")
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


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="where the measurement studies in a storage stand",
                       description="Per study: points done, claimed, waiting, given up, remaining, per worker, "
                                   "and an ETA. The same storage opens in optuna-dashboard.")
    p.add_argument("--storage", required=True, help="journal file or postgresql://... URL")
    p.add_argument("--study-name", default=None, help="one study (default: every spectune study there)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--repair", action="store_true",
                   help="journal file only: keep the records before a torn line (the original is kept beside it)")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from spectune.autotune.study_status import study_status

    if args.repair:
        from spectune.autotune.study_storage import repair_journal

        if "://" in args.storage:
            raise UsageError("--repair: only a journal file can be repaired")
        kept, dropped, backup = repair_journal(args.storage)
        print(f"repaired {args.storage}: kept {kept} records, dropped {dropped} lines from the first bad one on "
              f"(original kept as {backup})")
        return 0
    studies = study_status(args.storage, args.study_name)
    if args.json:
        print(json.dumps([{"name": s.name, "gpu": s.gpu, "workload": s.workload, "total": s.total, "done": s.done,
                           "claimed": s.claimed, "waiting": s.waiting, "remaining": s.remaining,
                           "given_up": s.given_up, "infeasible": s.infeasible, "not_needed": s.not_needed,
                           "complete": s.complete, "point_s": s.point_s, "eta_s": s.eta_s,
                           "workers": [{"id": w.id, "done": w.done, "measuring": w.measuring,
                                        "last": w.last.isoformat() if w.last else None} for w in s.workers]}
                          for s in studies], indent=1))
        return 0
    if not studies:
        print(f"{args.storage}: no spectune measurement study")
    for s in studies:
        eta = ("complete" if s.complete else f"ETA {s.eta_s / 60:.1f} min" if s.eta_s is not None
               else "ETA unknown (no worker measuring)")
        print(f"{s.name}: {s.gpu}; {s.workload}")
        # done + remaining + given up + not needed = total: every planned point is named
        print(f"  points: {s.done} done" + (f" ({s.infeasible} infeasible)" if s.infeasible else "")
              + f", {s.claimed} claimed, {s.waiting} waiting, {s.remaining} remaining of {s.total}"
              + (f", {len(s.given_up)} given up" if s.given_up else "")
              + (f", {s.not_needed} not needed (the adaptive phase ended early)" if s.not_needed else "") + f"; {eta}"
              + (f" ({s.point_s:.2f} s per point)" if s.point_s is not None else ""))
        for w in s.workers:
            now = f", measuring {w.measuring}" if w.measuring else ""
            last = f", last finished {w.last:%Y-%m-%d %H:%M:%S}" if w.last else ""
            print(f"  worker {w.id}: {w.done} done{now}{last}")
    return 0


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_autotune, _add_profile, _add_tune, _add_show, _add_validate, _add_export, _add_calibrate, _add_simulate,
    _add_bench, _add_report, _add_status,
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="spectune",
        description="Measure, tune and run adaptive speculative decoding for one GPU.",
    )
    parser.add_argument("--version", action="version", version=f"spectune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


@functools.cache
def _parser() -> argparse.ArgumentParser:
    # built once per process (argparse's construction dominates a refused command line)
    return build_parser()


def _out_of_memory(exc: BaseException) -> bool:
    """The host or the device ran out of memory: torch's OutOfMemoryError (CUDA), its CPU
    allocator's RuntimeError, Python's MemoryError. Any other RuntimeError is a bug: re-raised."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except BadArgument as exc:
        print(one_line(str(exc)), file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (SpectuneError, UsageError) as exc:
        print(one_line(f"spectune {args.command}: error: {exc}"), file=sys.stderr)
        return 2
    except OSError as exc:  # the file system said no (read-only, full, a folder): name the file
        where = f"{exc.filename}: " if exc.filename else ""
        print(one_line(f"spectune {args.command}: error: {where}{exc.strerror or exc}"), file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not _out_of_memory(exc):
            raise
        after = INTERRUPTED.get(args.command, "nothing was written")
        print(one_line(f"spectune {args.command}: error: out of memory ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:160] if str(exc) else 'no details'}); free the device's memory "
                       f"(another server on it?) or ask for less of it ({after})"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        after = INTERRUPTED.get(args.command, "nothing was written")
        print(f"spectune {args.command}: interrupted ({after})", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
