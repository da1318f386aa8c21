"""Greedy speculative decoding over a Hugging Face causal LM, one request at a time, recording a
trace line per verification step.

Terms (see docs/TRACES.md):
- offered: draft tokens the drafter proposed this step (0..K; an n-gram drafter may find none).
- accepted: the longest prefix of the drafts equal to the target's argmax at each position.
- bonus: the target's own token after the accepted prefix (the correction when a draft was
  rejected). A step emits ``accepted + 1`` tokens, so greedy output equals plain greedy decoding.

The target keeps its KV cache over ``context[:-1]``: each step feeds ``[last token] + drafts``,
reads ``1 + offered`` argmax tokens, and crops the cache back to the accepted prefix.

Only torch is imported; the model is duck-typed: a Hugging Face causal LM whose forward takes a
KV cache (``cache=`` in transformers 5, ``past_key_values=`` before) and returns it, and whose
cache has ``get_seq_length()`` and ``crop(-n)`` (drop the last n positions).
"""

from __future__ import annotations

import functools
import gzip
import inspect
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from spectune.errors import SpectuneError
from spectune.io import atomic_write_bytes

TRACE_FIELDS = ("request", "step", "offered", "accepted", "conf", "dataset", "drafter", "model")
CONF_DECIMALS = 4


class TraceError(SpectuneError):
    """A trace file or trace line is malformed; the message names file, line and field."""


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]  # [offered]
    conf: tuple[float, ...] | None = None  # [offered] drafter's probability of each token, or None


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` draft tokens continuing ``context`` (prompt + emitted tokens)."""
        ...

    def rollback(self, valid: int) -> None:
        """Only ``context[:valid]`` (old context + accepted drafts) is still valid state."""
        ...


@dataclass(frozen=True)
class Step:
    offered: int
    accepted: int  # 0..offered
    conf: tuple[float, ...] | None  # [offered] or None


@dataclass(frozen=True)
class SpecResult:
    tokens: tuple[int, ...]  # [new tokens] generated after the prompt, eos included if hit
    steps: tuple[Step, ...]  # one per target verification


def _eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(t) for t in eos_token_id)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


@functools.cache
def _cache_kwarg(model_type: Any) -> str:
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_cached(model: Any, ids: Sequence[int], cache: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """One forward of token ``ids`` after the positions in ``cache`` (None: empty).
    Returns (logits [T, V] or fewer rows with ``logits_to_keep``, the grown cache)."""
    x = torch.tensor([list(ids)], device=_device(model))  # [1, T]
    out = model(input_ids=x, use_cache=True, **{_cache_kwarg(model.__class__): cache}, **kwargs)
    new = getattr(out, "cache", None)
    return out.logits[0], (new if new is not None else out.past_key_values)


def crop_cache(cache: Any, keep: int) -> None:
    """Drop cached positions from ``keep`` on."""
    drop = int(cache.get_seq_length()) - keep
    if drop > 0:
        cache.crop(-drop)


def prefill(model: Any, prompt: Sequence[int]) -> Any:
    """KV cache over ``prompt[:-1]`` (None for a one-token prompt)."""
    if len(prompt) < 2:
        return None
    return forward_cached(model, prompt[:-1], None, logits_to_keep=1)[1]


def verify(model: Any, cache: Any, last: int, drafts: Sequence[int]) -> tuple[list[int], Any]:
    """Target argmax after ``last`` and after each draft: ``[1 + offered]`` tokens, new cache."""
    logits, cache = forward_cached(model, [last, *drafts], cache)  # logits: [1 + offered, V]
    return logits.argmax(dim=-1).tolist(), cache


def accept_prefix(drafts: Sequence[int], target: Sequence[int]) -> int:
    """Greedy acceptance: count of leading drafts equal to the target's argmax there."""
    n = 0
    for d, t in zip(drafts, target, strict=False):
        if d != t:
            break
        n += 1
    return n


@torch.inference_mode()
def speculative_generate(
    model: Any,
    prompt: Sequence[int],
    drafter: Drafter,
    *,
    k: int,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
) -> SpecResult:
    """Greedy speculative decoding of one request; stops at ``max_new_tokens`` or an eos token."""
    if k < 0:
        raise SpectuneError(f"k: must be >= 0, got {k}")
    if not prompt:
        raise SpectuneError("prompt: must hold at least one token")
    eos = _eos_set(eos_token_id)
    context = [int(t) for t in prompt]
    new: list[int] = []
    steps: list[Step] = []
    cache = prefill(model, context)
    drafter.rollback(0)
    while len(new) < max_new_tokens:
        draft = drafter.propose(context, k) if k else Draft(())
        drafts = list(draft.tokens[:k])
        target, cache = verify(model, cache, context[-1], drafts)
        accepted = accept_prefix(drafts, target)
        conf = draft.conf[: len(drafts)] if draft.conf is not None else None
        steps.append(Step(offered=len(drafts), accepted=accepted, conf=conf))
        # cache now holds context + drafts; keep context + accepted drafts (the bonus is not in it)
        crop_cache(cache, len(context) + accepted)
        drafter.rollback(len(context) + accepted)
        emitted = drafts[:accepted] + [target[accepted]]
        context.extend(emitted)
        new.extend(emitted)
        hit = next((i for i, t in enumerate(new) if t in eos), None)
        if hit is not None:
            new = new[: hit + 1]
            break
    return SpecResult(tokens=tuple(new[:max_new_tokens]), steps=tuple(steps))


@torch.inference_mode()
def greedy_reference(
    model: Any,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Plain greedy decoding with the model's own ``generate``: the output speculation must equal."""
    ids = torch.tensor([list(prompt)], device=_device(model))  # [1, P]
    eos = sorted(_eos_set(eos_token_id))
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    return tuple(out[0, ids.shape[1]:].tolist())


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------
# trace lines


def trace_records(
    result: SpecResult, *, request: str, dataset: str, drafter: str, model: str
) -> list[dict[str, Any]]:
    """One JSON-able dict per verification step, keys in TRACE_FIELDS order (conf omitted if None)."""
    records = []
    for i, s in enumerate(result.steps):
        rec: dict[str, Any] = {"request": request, "step": i, "offered": s.offered, "accepted": s.accepted}
        if s.conf is not None:
            rec["conf"] = [round(float(c), CONF_DECIMALS) for c in s.conf]
        rec.update(dataset=dataset, drafter=drafter, model=model)
        records.append(rec)
    return records


def check_record(rec: Any, where: str) -> dict[str, Any]:
    """Validate one trace line; raise TraceError naming ``where`` and the field."""
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: must be a JSON object")
    unknown = sorted(set(rec) - set(TRACE_FIELDS))
    if unknown:
        raise TraceError(f"{where}: {unknown[0]}: unknown field (allowed: {', '.join(TRACE_FIELDS)})")
    for key in TRACE_FIELDS:
        if key != "conf" and key not in rec:
            raise TraceError(f"{where}: {key}: missing")
    for key in ("request", "dataset", "drafter", "model"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise TraceError(f"{where}: {key}: must be a non-empty string, got {rec[key]!r}")
    for key in ("step", "offered", "accepted"):
        v = rec[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceError(f"{where}: {key}: must be an integer >= 0, got {v!r}")
    if rec["accepted"] > rec["offered"]:
        raise TraceError(f"{where}: accepted: {rec['accepted']} exceeds offered {rec['offered']}")
    conf = rec.get("conf")
    if conf is not None:
        ok = isinstance(conf, list) and all(
            isinstance(c, int | float) and not isinstance(c, bool) and 0.0 <= c <= 1.0 for c in conf
        )
        if not ok or len(conf) != rec["offered"]:
            raise TraceError(f"{where}: conf: must be {rec['offered']} numbers in [0, 1], got {conf!r}")
    return rec


def write_traces(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> None:
    """Gzipped JSONL (``.jsonl.gz``) or plain JSONL, written through a temp file and a rename."""
    path = Path(path)
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
    data = gzip.compress(text, compresslevel=9, mtime=0) if path.name.endswith(".gz") else text
    atomic_write_bytes(path, data)


def read_traces(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read and validate a ``.jsonl`` or ``.jsonl.gz`` trace file."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt") as fh:
            lines = fh.read().splitlines()
    except (OSError, EOFError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        records.append(check_record(rec, f"{path}:{n}"))
    return records


def summarize(records: Sequence[dict[str, Any]], k: int) -> dict[str, Any]:
    """Acceptance statistics of one (dataset, drafter) trace set recorded at draft length ``k``.

    per_position[i-1] = P(draft i accepted | at least i drafts offered); mean_acceptance_length
    counts the bonus token (1 + accepted), over all steps and over steps offered the full ``k``.
    """
    full = [r for r in records if r["offered"] == k]
    per_pos = []
    for i in range(1, k + 1):
        offered = [r for r in records if r["offered"] >= i]
        per_pos.append(round(sum(r["accepted"] >= i for r in offered) / len(offered), 4) if offered else None)
    steps = len(records)
    return {
        "k": k,
        "requests": len({r["request"] for r in records}),
        "steps": steps,
        "mean_acceptance_length": round(1 + sum(r["accepted"] for r in records) / steps, 4) if steps else None,
        "mean_acceptance_length_full_k": (
            round(1 + sum(r["accepted"] for r in full) / len(full), 4) if full else None
        ),
        "mean_offered": round(sum(r["offered"] for r in records) / steps, 4) if steps else None,
        "steps_with_no_draft": sum(r["offered"] == 0 for r in records),
        "per_position": per_pos,
    }
