"""The ``spectune`` command. The only module that parses arguments and prints for people.

Each sub-command has an ``_add_<name>(sub)`` parser builder and a ``cmd_<name>(args) -> int``.
Library errors (SpectuneError and its subclasses, e.g. TableError) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from spectune import __version__
from spectune.runtime.schema import SpectuneError


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


# ---------------------------------------------------------------------------------------------
# sub-commands (filled in by their modules' owners)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the cost surface on this GPU -> profile YAML",
                       description="Measure drafter, target-verification and runtime costs with "
                                   "CUDA-graph replays and NVML power, fit the cost model, write a profile.")
    _add_workload_options(p)
    _add_study_options(p)
    p.add_argument("--out", default=None, help="profile YAML path (default: profiles/<gpu>_<target>_<drafter>.yaml)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    raise UsageError("profile: not implemented yet")


def _add_autotune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autotune", help="profile then tune in one command -> policy table YAML")
    _add_workload_options(p)
    _add_study_options(p)
    p.add_argument("--acceptance", default=None, help="acceptance source (see `spectune tune --help`)")
    p.add_argument("--out", default=None, help="policy table YAML path")
    p.set_defaults(func=cmd_autotune)


def cmd_autotune(args: argparse.Namespace) -> int:
    raise UsageError("autotune: not implemented yet")


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="search the policy for a profile and acceptance -> policy table YAML")
    p.add_argument("profile", help="profile YAML from `spectune profile`")
    p.add_argument("--out", required=True, help="policy table YAML path")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    raise UsageError("tune: not implemented yet")


def _add_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a profile or policy table for people")
    p.add_argument("file")
    p.set_defaults(func=cmd_show)


def cmd_show(args: argparse.Namespace) -> int:
    raise UsageError("show: not implemented yet")


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a profile or policy table (exit 0 valid, 2 not)")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_validate)


def cmd_validate(args: argparse.Namespace) -> int:
    raise UsageError("validate: not implemented yet")


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="turn a policy table into an engine's config")
    p.add_argument("policy")
    p.add_argument("--format", required=True, choices=["vllm", "sglang", "trtllm"])
    p.add_argument("--out", default=None, help="file to write (default: stdout)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    raise UsageError("export: not implemented yet")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving A/B: plain vs fixed K vs the policy")
    p.add_argument("--policy", required=True)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    raise UsageError("bench: not implemented yet")


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Markdown/HTML report with plots from bench results and profiles")
    p.add_argument("inputs", nargs="+")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    raise UsageError("report: not implemented yet")


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
