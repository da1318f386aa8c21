"""Profile, tune, validate, export and bench one H200 target in one device call (issue 17, items 3-4).

One call per target, or per stage where a target does not fit one call::

    PYTHONPATH=. python benchmarks/targets_tables.py --target qwen3-8b --dtype fp8 --stage all --out-dir $OUT
    PYTHONPATH=. python benchmarks/targets_tables.py --target llama-3.1-8b --stage all --out-dir $OUT
    PYTHONPATH=. python benchmarks/targets_tables.py --target qwen3-32b --stage profile,tune --out-dir $OUT
    PYTHONPATH=. python benchmarks/targets_tables.py --target qwen3-32b --stage bench --concurrency 1,32 \\
        --resume-from PREV --out-dir $OUT          # PREV: the first call's files, copied into the checkout
    PYTHONPATH=. python benchmarks/targets_tables.py --target qwen3-32b --stage bench --concurrency 128 \\
        --resume-from PREV --out-dir $OUT

Stages (each real command runs as a subprocess, so a stage's GPU memory is freed before the next):

  profile  ``spectune profile`` with the settings of the shipped qwen3-8b bf16 profile
           (docs/BENCHMARKS.md section 1: batch 1-256, max K 15, context 2048, eagle-1l). With
           ``--resume-from DIR`` the Optuna journal of an earlier call (inside DIR's
           ``<stem>.study.tar.gz`` or as ``<stem>.yaml.journal``) is restored beside the output first,
           so the study continues where it stopped (the profiler's own journal resume).
  tune     ``spectune tune`` on that profile with the public EAGLE-3 curve (as the shipped policies
           were tuned, docs/BENCHMARKS.md sections 4-5), twice: at the profile's context
           (``<stem>.policy.yaml``) and at the bench's context 320 (``<stem>.ctx320.policy.yaml``);
           then ``spectune validate`` and ``spectune export`` (vllm, sglang, trtllm) of each, which
           must all succeed.
  bench    ``benchmarks/heldout_ab.py`` (``spectune.engine.bench.run_sources``, full-load metric) on
           the context-320 policy, served on the held-out HumanEval n-gram traces (not what the
           policy was tuned on): plain, the simulator's best fixed K and its neighbours, auto;
           ``--repeats`` interleaved repeats at ``--concurrency``.
  all      the three in order.

``--deadline-s`` (default 540, from the script's start) ends the call cleanly before the device's
10-minute limit: a stage still running is stopped with SIGINT (the profiler puts the point it was
measuring back in the study; the bench has written the rows it finished), later stages are skipped,
and what finished is copied to ``--out-dir``.

Files under ``--out-dir`` (at most 6; names as the shipped tables, the dtype in the name where it is
not bf16, so ``qwen3-8b --dtype fp8`` does not collide with the bf16 tables)::

    <gpu>_<target>_eagle-1l[.fp8].yaml                 profile
    <gpu>_<target>_eagle-1l[.fp8].policy.yaml          policy at the profile's context
    <gpu>_<target>_eagle-1l[.fp8].ctx320.policy.yaml   policy at the bench's context (what is benched)
    <gpu>_<target>_eagle-1l[.fp8].study.tar.gz         measurement CSV, Optuna journal, exports, logs
    bench_heldout_humaneval_<target>[-fp8]_c<C1-C2>.json   bench rows (``spectune report`` reads them)
    targets_tables_<target>[-fp8]_<stages>.json        settings, timings, held-out error per stage

Printed table: the profile model's target step (plain decode) at batch 1 / 32 / 128, the weight-read
floor (``models.config.weight_read_bytes`` over the read bandwidth measured in the same call, as
``benchmarks/targets_probe.py`` does), the held-out cost-model error, and auto / the best other arm
at full load per concurrency.

H200 time per stage, estimated from the repo's numbers (not measured for these targets yet):
  - the qwen3-8b bf16 profile took ~137 s (131 points; the points' replays sum to ~2.0 s per
    repetition: ~26 runs each, so ~55 s of steps, the rest build, capture and per-point costs).
    ``benchmarks/results/targets_probe_h200.json`` steps at batch 1 / 32 / 128: qwen3-8b fp8
    0.86 / 0.90 / 0.96x bf16, llama-3.1-8b 0.92 / 0.90 / 0.90x, qwen3-32b 3.3 / 2.8 / 2.4x (and
    ~4x at compute-bound token counts): profile ~130 s (qwen3-8b fp8), ~125 s (llama-3.1-8b),
    ~280 s (qwen3-32b; its points past ~batch 150 at context 2048 do not fit and are recorded
    infeasible).
  - tune: two ``spectune tune`` runs (7-14 s each on a loaded 2-core CPU, section 4) + six exports
    and two validations in process: ~30-40 s.
  - bench: heldout_ab's H200 calls (qwen3-8b bf16) took ~100 s of setup and ~220 s per source at
    c = 1, 16, 64, 256 (timed runs 36 / 35 / 34 / 58 s); at c = 1, 32, 128 ~270 s for the 8B
    targets; qwen3-32b's steps are 2.4-3.3x longer: ~580 s.
  So qwen3-8b fp8 (~450 s) and llama-3.1-8b (~420 s) fit one call each (``--stage all``);
  qwen3-32b needs three: ``profile,tune`` (~320 s), then ``bench`` at ``--concurrency 1,32``
  (~350 s) and at ``--concurrency 128`` (~300 s), each with ``--resume-from`` the first call's files.

CPU dry run (tiny settings; what tests/test_benchmark_scripts.py runs)::

    PYTHONPATH=. python benchmarks/targets_tables.py --device cpu --target tiny --stage all \\
        --batch-sizes 1,2 --max-k 2 --context-len 32 --trials 0 --bench-context 24 \\
        --concurrency 1,2 --repeats 1 --prompts 2 --prompt-len 8 --max-new-tokens 6 --out-dir /tmp/t
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import heldout_ab  # noqa: E402  (the bench's sources and its interval format)
from probe_common import int_list  # noqa: E402  (the benchmarks' comma-list parser)

STAGES = ("profile", "tune", "bench")
DTYPES = ("bfloat16", "fp8", "float16", "float32")
ACCEPTANCE = "public:EAGLE-3/Llama-3.1-8B-Instruct/MT-Bench"  # the shipped policies' tuning curve
EXPORTS = {"vllm": ("eagle", "json"), "sglang": ("EAGLE", "json"), "trtllm": ("eagle", "yaml")}
DRAFTER_MODEL = "eagle-1l-drafter"  # path written into the exports (the engines need one)
STEP_BATCHES = (1, 32, 128)
GRACE_S = 20.0  # a stopped stage's time to write what it has
RESERVE_S = GRACE_S + 5.0  # a stage is stopped this long before the deadline: its grace + copying out
MIN_STAGE_S = 20.0  # a stage is not started with less than this left
RESUMED = re.compile(r"resumed study \S+ in .*: kept (\d+) points, measured (\d+) now")


class Refused(Exception):
    """A bad option: one line, exit code 2, nothing written."""


# ---------------------------------------------------------------------------------------------
# options


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="preset (qwen3-8b, qwen3-32b, llama-3.1-8b, tiny, ...)")
    p.add_argument("--dtype", default="bfloat16", help=f"one of {', '.join(DTYPES)} (default bfloat16)")
    p.add_argument("--drafter", default="eagle-1l")
    p.add_argument("--stage", default="all", help="profile, tune, bench, a comma list of them, or all")
    p.add_argument("--out-dir", default=os.environ.get("OUT"), help="where the files go (default $OUT)")
    p.add_argument("--resume-from", default=None,
                   help="folder with an earlier call's files: the profile's journal, the profile, the policies")
    p.add_argument("--deadline-s", type=float, default=540.0, help="end the call cleanly by then (default 540)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)")
    p.add_argument("--fused", action="store_true",
                   help="profile and bench the fused decoder layers (spectune profile/bench --fused); "
                        "the files are named ...eagle-1l.fused")
    g = p.add_argument_group("profile (defaults: the shipped qwen3-8b bf16 profile)")
    g.add_argument("--batch-sizes", default="1-256")
    g.add_argument("--max-k", type=int, default=15)
    g.add_argument("--context-len", type=int, default=2048)
    g.add_argument("--trials", type=int, default=None, help="adaptive trials (default: the profiler's)")
    g = p.add_argument_group("tune")
    g.add_argument("--acceptance", default=ACCEPTANCE, help=f"tuning acceptance (default {ACCEPTANCE})")
    g.add_argument("--bench-context", type=int, default=320,
                   help="context of the benched policy (default 320: prompt 288 + 64 new tokens)")
    g.add_argument("--tune-trials", type=int, default=None, help="tier-set trials (default: spectune tune's)")
    g = p.add_argument_group("bench (defaults: benchmarks/heldout_ab.py's)")
    g.add_argument("--source", default="humaneval",
                   help=f"served acceptance, one of {', '.join(s for s in heldout_ab.SOURCES if s != 'tuned')}")
    g.add_argument("--concurrency", default="1,32,128")
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--prompts", type=int, default=None, help="requests per concurrency (default heldout_ab's)")
    g.add_argument("--prompt-len", type=int, default=288)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--time-limit", type=float, default=60.0, help="seconds per timed run")
    p.add_argument("--facts", default=None, help=argparse.SUPPRESS)  # internal: device facts as JSON
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> list[str]:
    """Every option checked before anything runs or is written; returns the stages in order."""
    from spectune.autotune.profiler import parse_batch_sizes
    from spectune.models.config import ModelError, parse_drafter, resolve_target
    from spectune.runtime.table import MAX_K

    try:
        resolve_target(args.target)
        parse_drafter(args.drafter)
    except ModelError as exc:
        raise Refused(f"--target/--drafter: {exc}") from None
    if args.dtype not in DTYPES:
        raise Refused(f"--dtype: must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    names = [s.strip() for s in args.stage.split(",") if s.strip()]
    stages = list(STAGES) if names == ["all"] else names
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise Refused(f"--stage: unknown stage {', '.join(bad) or repr(args.stage)} "
                      f"(stages: {', '.join(STAGES)}, a comma list of them, or all)")
    stages = [s for s in STAGES if s in stages]
    if not args.out_dir:
        raise Refused("--out-dir: not given and $OUT is not set")
    if args.resume_from is not None and not Path(args.resume_from).is_dir():
        raise Refused(f"--resume-from: {args.resume_from}: not a folder")
    try:
        sizes = parse_batch_sizes(args.batch_sizes)
    except Exception as exc:
        raise Refused(f"--batch-sizes: {exc}") from None
    if not sizes:
        raise Refused(f"--batch-sizes: no sizes in {args.batch_sizes!r}")
    for name, value, lo, hi in (("--max-k", args.max_k, 1, MAX_K), ("--context-len", args.context_len, 1, None),
                                ("--bench-context", args.bench_context, 1, None), ("--repeats", args.repeats, 1, None),
                                ("--prompt-len", args.prompt_len, 1, None),
                                ("--max-new-tokens", args.max_new_tokens, 1, None),
                                ("--trials", args.trials, 0, None), ("--tune-trials", args.tune_trials, 1, None),
                                ("--prompts", args.prompts, 1, None)):
        if value is not None and (value < lo or (hi is not None and value > hi)):
            raise Refused(f"{name}: must be in {lo}..{hi if hi is not None else 'any'}, got {value}")
    if args.deadline_s <= 0 or args.time_limit <= 0:
        raise Refused("--deadline-s/--time-limit: must be > 0")
    concurrency(args.concurrency)
    if args.source not in heldout_ab.SOURCES or args.source == "tuned":
        raise Refused(f"--source: unknown or tuned-on source {args.source!r} "
                      f"(held-out sources: {', '.join(s for s in heldout_ab.SOURCES if s != 'tuned')})")
    if heldout_ab.SOURCES[args.source] == args.acceptance:
        raise Refused(f"--source: {args.source} is the tuning acceptance; the bench serves a held-out one")
    return stages


def concurrency(text: str) -> list[int]:
    return int_list(text, "--concurrency", example="1,32,128", error=Refused)


def stem_for(slug: str, target: str, drafter: str, dtype: str, fused: bool = False) -> str:
    """``nvidia-h200_qwen3-8b_eagle-1l`` as shipped; other dtypes than bf16 named: ``...eagle-1l.fp8``;
    the fused decoder's tables ``...eagle-1l.fused`` (``.fp8.fused``)."""
    name = Path(target).name or target
    return f"{slug}_{name}_{drafter}" + ("" if dtype == "bfloat16" else f".{dtype}") + (".fused" if fused else "")


# ---------------------------------------------------------------------------------------------
# running a stage's command


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cmd(cmd: list[str], log: Path, deadline: float) -> dict[str, Any]:
    """Run ``cmd`` (stdout + stderr to ``log``) until it ends or the deadline; then SIGINT, a grace
    period, and a kill. Returns the command, exit code, wall seconds and whether it was stopped."""
    left = deadline - time.monotonic() - RESERVE_S
    res: dict[str, Any] = {"command": " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)}
    if left < MIN_STAGE_S:
        return {**res, "rc": None, "skipped": f"deadline: {max(left, 0):.0f} s left"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    stopped = False
    with open(log, "w") as fh:
        # SIGINT at its default in the stage: a parent started in the background of a shell
        # without job control ignores it, and a child inherits that, so the deadline's SIGINT
        # would reach no handler and the stage would be killed without writing what it had
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                preexec_fn=_default_sigint)
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    text = log.read_text(errors="replace")
    return {**res, "rc": rc, "wall_s": round(time.monotonic() - started, 1), "stopped_at_deadline": stopped,
            "tail": text.strip().splitlines()[-4:]}


def cli_in_process(argv: list[str]) -> dict[str, Any]:
    """``spectune ARGV`` in this process (no model is built: validate and export)."""
    from spectune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return {"command": "spectune " + " ".join(argv), "rc": rc, "stdout": out.getvalue()[-2000:],
            "stderr": err.getvalue().strip().splitlines()[-3:]}


def ok(res: dict[str, Any]) -> bool:
    return res.get("rc") == 0 and not res.get("stopped_at_deadline")


# ---------------------------------------------------------------------------------------------
# the call


class Call:
    """One call's settings, its work folder (everything is written there, then copied out) and the
    summary JSON it builds."""

    def __init__(self, args: argparse.Namespace, stages: list[str], facts: dict[str, Any], started: float) -> None:
        self.args, self.stages, self.facts = args, stages, facts
        self.started = started
        self.deadline = self.started + args.deadline_s
        self.stem = stem_for(facts["slug"], args.target, args.drafter, args.dtype, args.fused)
        label = (Path(args.target).name or args.target) + ("" if args.dtype == "bfloat16" else f"-{args.dtype}")
        self.conc = concurrency(args.concurrency)
        self.bench_tag = f"{label}_c{'-'.join(map(str, self.conc))}"
        self.out = Path(args.out_dir)
        self.work = Path(tempfile.mkdtemp(prefix="targets-tables-"))
        (self.work / "logs").mkdir()
        (self.work / "exports").mkdir()
        self.resume = Path(args.resume_from) if args.resume_from else None
        self.summary: dict[str, Any] = {
            "target": args.target, "dtype": args.dtype, "drafter": args.drafter, "stages_asked": stages,
            "deadline_s": args.deadline_s, "facts": facts, "stem": self.stem,
            "resume_from": str(self.resume) if self.resume else None,
            "settings": {k: getattr(args, k) for k in (
                "batch_sizes", "max_k", "context_len", "trials", "acceptance", "bench_context", "tune_trials",
                "source", "concurrency", "repeats", "prompts", "prompt_len", "max_new_tokens", "time_limit")},
            "served_acceptance": heldout_ab.SOURCES[args.source], "stages": {},
        }
        self.summary_name = f"targets_tables_{label}_{'-'.join(stages)}.json"

    # files --------------------------------------------------------------------------------

    @property
    def profile(self) -> Path:
        return self.work / f"{self.stem}.yaml"

    def policy(self, context: int | None) -> Path:
        return self.work / f"{self.stem}{'' if context is None else f'.ctx{context}'}.policy.yaml"

    def fetch(self, path: Path) -> Path | None:
        """``path`` in the work folder, else copied in from ``--resume-from``."""
        if path.exists():
            return path
        if self.resume is not None and (self.resume / path.name).exists():
            shutil.copyfile(self.resume / path.name, path)
            return path
        return None

    def restore_journal(self) -> str | None:
        """The earlier call's journal beside the profile, from DIR/<stem>.study.tar.gz or DIR/<stem>.yaml.journal."""
        if self.resume is None:
            return None
        journal = Path(str(self.profile) + ".journal")
        bare = self.resume / journal.name
        if bare.exists():
            shutil.copyfile(bare, journal)
            return str(bare)
        tar = self.resume / f"{self.stem}.study.tar.gz"
        if tar.exists():
            with tarfile.open(tar) as t:
                member = next((m for m in t.getmembers() if Path(m.name).name == journal.name and m.isfile()), None)
                if member is not None:
                    src = t.extractfile(member)
                    assert src is not None
                    journal.write_bytes(src.read())
                    return f"{tar}:{member.name}"
        raise Refused(f"--resume-from: {self.resume}: no {journal.name} (alone or in {tar.name})")

    def publish(self, *paths: Path) -> None:
        """Copy files out atomically (a temporary name, then a rename) and rebuild the study tarball."""
        self.out.mkdir(parents=True, exist_ok=True)
        for path in paths:
            if path.exists():
                _atomic_copy(path, self.out / path.name)
        extras = [p for p in (self.profile.with_suffix(".csv"), Path(str(self.profile) + ".journal")) if p.exists()]
        extras += sorted((self.work / "exports").iterdir()) + sorted((self.work / "logs").iterdir())
        if extras:
            tar = self.work / f"{self.stem}.study.tar.gz"
            with tarfile.open(tar, "w:gz") as t:
                for p in extras:
                    t.add(p, arcname=str(p.relative_to(self.work)))
            _atomic_copy(tar, self.out / tar.name)

    def write_summary(self) -> Path:
        self.summary["wall_s"] = round(time.monotonic() - self.started, 1)
        path = self.work / self.summary_name
        path.write_text(json.dumps(self.summary, indent=1, default=str) + "\n")
        self.publish(path)
        return self.out / self.summary_name

    def spectune(self, *argv: str) -> list[str]:
        return [sys.executable, "-m", "spectune.cli", *argv]

    # stages -------------------------------------------------------------------------------

    def stage_profile(self) -> dict[str, Any]:
        a = self.args
        restored = self.restore_journal()
        cmd = self.spectune("profile", "--target", a.target, "--drafter", a.drafter, "--dtype", a.dtype,
                            "--batch-sizes", a.batch_sizes, "--max-k", str(a.max_k), "--context-len",
                            str(a.context_len), "--out", str(self.profile), "--no-progress",
                            *(["--device", a.device] if a.device else []), *(["--fused"] if a.fused else []),
                            *(["--trials", str(a.trials)] if a.trials is not None else []))
        res = run_cmd(cmd, self.work / "logs" / "profile.log", self.deadline)
        res["journal_restored_from"] = restored
        log = self.work / "logs" / "profile.log"
        if log.exists() and (m := RESUMED.search(log.read_text(errors="replace"))):
            res["kept"], res["measured_now"] = int(m[1]), int(m[2])
        if ok(res) and self.profile.exists():
            res.update(table_facts(self.profile, STEP_BATCHES))
        self.publish(self.profile)
        return res

    def stage_tune(self) -> dict[str, Any]:
        a = self.args
        profile = self.fetch(self.profile)
        if profile is None:
            return {"rc": None, "error": f"no profile {self.profile.name} (run the profile stage or --resume-from)"}
        res: dict[str, Any] = {"acceptance": a.acceptance, "policies": {}}
        for context in (None, a.bench_context):
            out = self.policy(context)
            cmd = self.spectune("tune", str(profile), "--acceptance", a.acceptance, "--out", str(out), "--no-progress",
                                *(["--context-len", str(context)] if context is not None else []),
                                *(["--trials", str(a.tune_trials)] if a.tune_trials is not None else []))
            one = run_cmd(cmd, self.work / "logs" / f"tune{'' if context is None else context}.log", self.deadline)
            if ok(one) and out.exists():
                one["validate"] = cli_in_process(["validate", str(out), "--json"])
                one["exports"] = [self._export(out, fmt) for fmt in EXPORTS]
                one.update(table_facts(out, STEP_BATCHES))
                one["rows"] = policy_rows(out)
            res["policies"][out.name] = one
            self.publish(out)
        res["rc"] = 0 if all(_tuned_ok(p) for p in res["policies"].values()) else 1
        return res

    def _export(self, policy: Path, fmt: str) -> dict[str, Any]:
        method, ext = EXPORTS[fmt]
        out = self.work / "exports" / f"{policy.name.removesuffix('.yaml')}.{fmt}.{ext}"
        return cli_in_process(["export", str(policy), "--format", fmt, "--method", method,
                               "--drafter-model", DRAFTER_MODEL, "--out", str(out)])

    def stage_bench(self) -> dict[str, Any]:
        a = self.args
        policy = self.fetch(self.policy(a.bench_context))
        if policy is None:
            return {"rc": None, "error": f"no policy {self.policy(a.bench_context).name} (run the tune stage or "
                                         "--resume-from)"}
        bench_dir = self.work / "bench"
        bench_dir.mkdir(exist_ok=True)
        cmd = [sys.executable, str(BENCH_DIR / "heldout_ab.py"), "--sources", a.source, "--out", str(bench_dir),
               "--policy", str(policy), "--concurrency", ",".join(map(str, self.conc)), "--repeats", str(a.repeats),
               "--prompt-len", str(a.prompt_len), "--max-new-tokens", str(a.max_new_tokens),
               "--time-limit", str(a.time_limit), "--tag", self.bench_tag,
               *(["--device", a.device] if a.device else []), *(["--fused"] if a.fused else []),
               *(["--prompts", str(a.prompts)] if a.prompts is not None else [])]
        res = run_cmd(cmd, self.work / "logs" / "bench.log", self.deadline)
        rows_file = bench_dir / f"bench_heldout_{a.source}_{self.bench_tag}.json"
        res["served_acceptance"] = heldout_ab.SOURCES[a.source]
        res["policy"] = policy.name
        if rows_file.exists():
            res.update(bench_facts(json.loads(rows_file.read_text())))
            res["file"] = rows_file.name
            self.publish(rows_file)
        return res

    def run(self) -> int:
        if "bandwidth" not in self.facts:  # on CPU measured here, after the options were checked
            self.facts.update(device_facts(self.args))
        for stage in self.stages:
            print(f"== {stage} ({self.deadline - time.monotonic():.0f} s left)", flush=True)
            try:
                res = getattr(self, f"stage_{stage}")()
            except Exception as exc:  # recorded; the stages after it still run on what exists
                text = str(exc).strip().splitlines()
                res = {"rc": None, "error": f"{type(exc).__name__}: {text[0] if text else ''}"[:300]}
            self.summary["stages"][stage] = res
            self.write_summary()
            print(f"   {stage}: {status(res)}", flush=True)
        path = self.write_summary()
        print_table(self.summary)
        print(f"wrote {path} and {len(list(self.out.iterdir()))} files in all under {self.out}")
        return 0 if all(ok(r) for r in self.summary["stages"].values()) else 1


def _tuned_ok(p: dict[str, Any]) -> bool:
    return ok(p) and p.get("validate", {}).get("rc") == 0 and all(e["rc"] == 0 for e in p.get("exports", []))


def _atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def status(res: dict[str, Any]) -> str:
    if res.get("skipped"):
        return f"skipped ({res['skipped']})"
    if res.get("error"):
        return f"error: {res['error']}"
    if res.get("stopped_at_deadline"):
        return f"stopped at the deadline after {res.get('wall_s')} s (what finished is written)"
    if "policies" in res:
        return "; ".join(f"{name}: {status(p)}" + ("" if _tuned_ok(p) else " (validate/export failed)")
                         for name, p in res["policies"].items())
    return f"rc {res.get('rc')} in {res.get('wall_s')} s" + ("" if res.get("rc") == 0 else f": {res.get('tail')}")


# ---------------------------------------------------------------------------------------------
# what the files say


def table_facts(path: Path, batches: tuple[int, ...]) -> dict[str, Any]:
    """The cost model's held-out error and its plain target step at ``batches`` (at the table's
    context), beside the measured q = 1 points there."""
    from spectune.runtime.costs import CostModel
    from spectune.runtime.table import read_table

    table = read_table(path)
    cost, err, ctx = CostModel.of(table), table.costs.error, table.workload.context_len
    measured = {p.batch: p.ms for p in table.costs.points if p.kind == "target" and p.q == 1 and p.ms is not None}
    return {
        "held_out": {"points": err.held_out, "median_rel": err.median_rel, "max_rel": err.max_rel},
        "points": len(table.costs.points), "infeasible": sum(p.ms is None for p in table.costs.points),
        "context_len": ctx, "max_batch": table.workload.max_batch,
        "step_ms": {str(b): cost.target_ms(b, b, ctx) for b in batches},
        "measured_step_ms": {str(b): measured.get(b) for b in batches},
    }


def policy_rows(path: Path) -> list[dict[str, Any]]:
    from spectune.runtime.table import read_table

    policy = read_table(path).policy
    return [] if policy is None else [{"batch": list(r.batch), "k": r.k, "verify_budget": r.verify_budget}
                                      for r in policy.rows]


def bench_facts(res: dict[str, Any]) -> dict[str, Any]:
    rows = res.get("rows", [])
    errors = sorted(abs(r["prediction_error"]) for r in rows if r.get("prediction_error") is not None)
    full = res.get("summary_full_load", {}).get("ratios", [])
    return {
        "complete": res.get("header", {}).get("complete"), "rows": len(rows),
        "arms": res.get("header", {}).get("arms"),
        "mismatches": sum(r.get("mismatches") or 0 for r in rows),
        "hard_mismatches": sum(r.get("hard_mismatches") or 0 for r in rows),
        "prediction_error_median": errors[len(errors) // 2] if errors else None,
        "full_load": [{"concurrency": r["concurrency"], "best_other": r["best_other"],
                       "auto_vs_best": r["vs_best_other"], "auto_vs_best_ci95": r["vs_best_other_ci95"],
                       "auto_vs_plain": r["vs_plain"], "auto_vs_plain_ci95": r["vs_plain_ci95"]} for r in full],
    }


def print_table(summary: dict[str, Any]) -> None:
    stages = summary["stages"]
    prof = stages.get("profile", {})
    if "step_ms" not in prof:  # profile not run here: the benched policy carries the same costs
        prof = next((p for p in stages.get("tune", {}).get("policies", {}).values() if "step_ms" in p), {})
    floor = summary["facts"].get("weight_floor_ms")
    step = prof.get("step_ms", {})
    held = prof.get("held_out")
    print(f"\n{'target':>14} {'dtype':>8} {'step ms b1/b32/b128 (model)':>28} {'weight floor':>12} "
          f"{'held-out median/max':>20}")
    steps = "/".join(f"{step[str(b)]:.2f}" for b in STEP_BATCHES) if step else "-"
    held_s = f"{held['median_rel']:.1%} / {held['max_rel']:.1%}" if held else "-"
    floor_s = f"{floor:.2f} ms" if floor is not None else "-"
    print(f"{summary['target']:>14} {summary['dtype']:>8} {steps:>28} {floor_s:>12} {held_s:>20}")
    bench = stages.get("bench", {})
    if bench.get("full_load"):
        print(f"\nserved on {bench['served_acceptance']} (tuned on {summary['settings']['acceptance']}), full load, "
              f"{bench['rows']} rows, {bench['hard_mismatches']} hard mismatches, complete: {bench['complete']}")
        print(f"{'conc':>5} {'best other':>10} {'auto/best [95%]':>24} {'auto/plain [95%]':>24}")
        for r in bench["full_load"]:
            print(f"{r['concurrency']:>5} {r['best_other']:>10} "
                  f"{heldout_ab._ci(r['auto_vs_best'], r['auto_vs_best_ci95']):>24} "
                  f"{heldout_ab._ci(r['auto_vs_plain'], r['auto_vs_plain_ci95']):>24}")


# ---------------------------------------------------------------------------------------------
# device facts (a subprocess: the parent never holds a CUDA context beside a stage's model)


def facts_main(device: str, target: str, dtype: str) -> int:
    from dataclasses import asdict

    import torch
    from targets_probe import measure_bandwidth

    from spectune.autotune.hardware import gpu_slug, hardware_facts, parse_device, software_facts
    from spectune.autotune.timing import default_timer
    from spectune.errors import SpectuneError
    from spectune.models.config import parse_dtype, resolve_target, weight_read_bytes

    dev = parse_device(None if device == "default" else device, SpectuneError)
    hw = hardware_facts(dev)
    bw = measure_bandwidth(default_timer(dev), dev, 1024 if dev.type == "cuda" else 16)
    act, fp8 = parse_dtype(dtype)
    nbytes = weight_read_bytes(resolve_target(target), act, fp8=fp8)
    print(json.dumps({"slug": gpu_slug(hw), "hardware": asdict(hw), "software": asdict(software_facts()),
                      "device": str(dev), "bandwidth": bw, "weight_read_bytes": nbytes,
                      "weight_floor_ms": nbytes / (bw["read_gbps"] * 1e9) * 1e3, "torch": torch.__version__},
                     default=str))
    return 0


def on_cpu(device: str | None) -> bool:
    import torch

    return (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")


def device_facts(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--target", args.target, "--dtype", args.dtype,
           "--facts", args.device or "default"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    if proc.returncode != 0:
        raise Refused(f"--device {args.device or 'default'}: " + (proc.stderr.strip().splitlines() or ["no facts"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # the deadline counts from here
    args = parse(argv)
    if args.facts is not None:
        return facts_main(args.facts, args.target, args.dtype)
    try:
        stages = check(args)
        call = Call(args, stages, {"slug": "cpu"} if on_cpu(args.device) else device_facts(args), started)
    except Refused as exc:
        print(f"targets_tables: error: {exc}", file=sys.stderr)
        return 2
    try:
        needs = {"tune": call.profile, "bench": call.policy(args.bench_context)}
        for stage, made_by in (("tune", "profile"), ("bench", "tune")):
            if stage in stages and made_by not in stages and call.fetch(needs[stage]) is None:
                raise Refused(f"--stage {stage}: needs {needs[stage].name} from the {made_by} stage: run it too or "
                              "pass --resume-from with an earlier call's files")
        if "profile" in stages:
            call.restore_journal()  # a missing journal is refused here, before anything is written
        return call.run()
    except Refused as exc:
        print(f"targets_tables: error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(call.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
