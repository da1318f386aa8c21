"""Model shapes: the target's ``ModelArgs`` (presets or a local Hugging Face ``config.json``), the
drafter's ``DrafterSpec`` (``eagle-1l``, ``mtp-2l``, ``dflash-1l``) and byte counts derived from them.

Presets carry the public config numbers of each model; weights are never needed to measure cost.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from spectune.errors import SpectuneError


class ModelError(SpectuneError):
    """A model or drafter description is unknown or malformed."""


@dataclass(frozen=True)
class ModelArgs:
    name: str
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA: n_heads % n_kv_heads == 0)
    head_dim: int
    intermediate_size: int  # SwiGLU inner width
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "intermediate_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelError(f"model {self.name!r}: {key} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"model {self.name!r}: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ModelError(f"model {self.name!r}: head_dim={self.head_dim} must be even (RoPE)")

    @property
    def group(self) -> int:  # query heads per KV head
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        key = name.lower()
        if key not in PRESETS:
            raise ModelError(f"unknown model preset {name!r} (presets: {', '.join(PRESETS)})")
        return PRESETS[key]

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> ModelArgs:
        return from_hf_dir(path)


def _qwen3(name: str, dim: int, n_layers: int, n_heads: int, inter: int, tie: bool) -> ModelArgs:
    return ModelArgs(name, vocab_size=151936, dim=dim, n_layers=n_layers, n_heads=n_heads,
                     n_kv_heads=8, head_dim=128, intermediate_size=inter, rms_eps=1e-6,
                     rope_theta=1e6, tie_embeddings=tie, qk_norm=True)


PRESETS: dict[str, ModelArgs] = {
    # a CPU step takes about a millisecond: tests and the CPU pipeline run on it
    "tiny": ModelArgs("tiny", vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=32, intermediate_size=256, qk_norm=True),
    "qwen3-0.6b": _qwen3("qwen3-0.6b", dim=1024, n_layers=28, n_heads=16, inter=3072, tie=True),
    "qwen3-4b": _qwen3("qwen3-4b", dim=2560, n_layers=36, n_heads=32, inter=9728, tie=True),
    "qwen3-8b": _qwen3("qwen3-8b", dim=4096, n_layers=36, n_heads=32, inter=12288, tie=False),
    "qwen3-32b": _qwen3("qwen3-32b", dim=5120, n_layers=64, n_heads=64, inter=25600, tie=False),
    # Llama 3.1's rope_scaling (llama3, factor 8) changes the frequencies, not the cost: not modelled
    "llama-3.1-8b": ModelArgs("llama-3.1-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                              n_kv_heads=8, head_dim=128, intermediate_size=14336, rms_eps=1e-5,
                              rope_theta=500000.0, tie_embeddings=False, qk_norm=False),
}


def _hf_key(cfg: dict[str, Any], key: str, file: Path, kind: type, default: Any = None) -> Any:
    if key not in cfg:
        if default is not None:
            return default
        raise ModelError(f"{file}: missing key {key!r}")
    value = cfg[key]
    ok = (isinstance(value, int | float) and not isinstance(value, bool)) if kind is float else (
        isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
    if not ok:
        raise ModelError(f"{file}: key {key!r} must be {kind.__name__}, got {value!r}")
    return kind(value)


def from_hf_dir(path: str | os.PathLike[str]) -> ModelArgs:
    """Shapes of a local Llama / Qwen2 / Qwen3 / Mistral checkpoint from its ``config.json``."""
    folder = Path(path)
    file = folder / "config.json"
    try:
        cfg = json.loads(file.read_text())
    except OSError as exc:
        raise ModelError(f"{file}: cannot read ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{file}: not valid JSON (line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{file}: must hold a JSON object")
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM under text_config
        cfg = cfg["text_config"]
    dim = _hf_key(cfg, "hidden_size", file, int)
    n_heads = _hf_key(cfg, "num_attention_heads", file, int)
    kv = _hf_key(cfg, "num_key_value_heads", file, int, default=n_heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        head_dim = dim // n_heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise ModelError(f"{file}: key 'head_dim' must be int, got {head_dim!r}")
    model_type = str(cfg.get("model_type", ""))
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(cfg.get("rope_parameters"), dict):
        theta = cfg["rope_parameters"].get("rope_theta")
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, int | float)):
        raise ModelError(f"{file}: key 'rope_theta' must be a number, got {theta!r}")
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ModelError(f"{file}: key 'tie_word_embeddings' must be true or false, got {tie!r}")
    try:
        return ModelArgs(
            name=folder.name or str(folder),
            vocab_size=_hf_key(cfg, "vocab_size", file, int),
            dim=dim,
            n_layers=_hf_key(cfg, "num_hidden_layers", file, int),
            n_heads=n_heads,
            n_kv_heads=kv,
            head_dim=head_dim,
            intermediate_size=_hf_key(cfg, "intermediate_size", file, int),
            rms_eps=_hf_key(cfg, "rms_norm_eps", file, float, default=1e-6),
            rope_theta=float(theta) if theta is not None else 10000.0,
            tie_embeddings=tie,
            qk_norm=model_type.startswith("qwen3"),
        )
    except ModelError as exc:
        raise ModelError(f"{file}: {exc}") from None


def resolve_target(spec: str) -> ModelArgs:
    """A preset name (``qwen3-8b``) or a local checkpoint folder holding ``config.json``."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    if Path(spec).is_dir():
        return from_hf_dir(spec)
    raise ModelError(f"unknown target {spec!r}: not a preset ({', '.join(PRESETS)}) "
                     f"nor a folder with config.json")


@dataclass(frozen=True)
class DrafterSpec:
    name: str  # canonical, e.g. "eagle-1l"
    kind: Literal["autoregressive", "parallel"]
    n_layers: int


# family -> (kind, layers when the name carries no -<N>l suffix)
DRAFTER_FAMILIES: dict[str, tuple[Literal["autoregressive", "parallel"], int]] = {
    "eagle": ("autoregressive", 1),  # EAGLE-style: K sequential steps of one token per request
    "mtp": ("autoregressive", 1),  # multi-token-prediction head used recurrently, same cost shape
    "dflash": ("parallel", 1),  # block drafter: one forward over K positions per request
}

_DRAFTER_RE = re.compile(r"^(?P<family>[a-z]+)(?:-(?P<layers>\d+)l)?$")


def parse_drafter(s: str) -> DrafterSpec:
    """``eagle-<N>l`` / ``mtp-<N>l`` (autoregressive) or ``dflash-<N>l`` (parallel); a bare family
    name means one layer."""
    m = _DRAFTER_RE.match(s.strip().lower())
    if m is None or m["family"] not in DRAFTER_FAMILIES:
        raise ModelError(f"unknown drafter {s!r} (expected eagle-<N>l, mtp-<N>l or dflash-<N>l, "
                         f"e.g. eagle-1l)")
    kind, default_layers = DRAFTER_FAMILIES[m["family"]]
    layers = int(m["layers"]) if m["layers"] else default_layers
    if not 1 <= layers <= 64:
        raise ModelError(f"drafter {s!r}: layer count must be in 1..64, got {layers}")
    return DrafterSpec(f"{m['family']}-{layers}l", kind, layers)


# workload dtype name -> (activation dtype, target projections in FP8); the names are the table's
# ``workload.dtype`` choices (runtime/table.py DTYPES)
DTYPES: dict[str, tuple[torch.dtype, bool]] = {
    "bfloat16": (torch.bfloat16, False),
    "float16": (torch.float16, False),
    "float32": (torch.float32, False),
    "fp8": (torch.bfloat16, True),  # e4m3 projections; activations, attention, KV, drafter bf16
}


def parse_dtype(name: str) -> tuple[torch.dtype, bool]:
    """``"fp8"`` -> (torch.bfloat16, True); ``"float32"`` -> (torch.float32, False)."""
    if name not in DTYPES:
        raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(N out, K in) of one decoder layer's projection weights, by the decoder's names: fused
    qkv, o, gate/up, down."""
    return {
        "wqkv": ((args.n_heads + 2 * args.n_kv_heads) * args.head_dim, args.dim),
        "wo": (args.dim, args.n_heads * args.head_dim),
        "w13": (2 * args.intermediate_size, args.dim),
        "w2": (args.dim, args.intermediate_size),
    }


def projection_outputs(args: ModelArgs) -> int:
    """Output channels of one decoder layer's projections (fused qkv, o, gate/up, down): the
    per-channel scales an FP8 layer keeps."""
    return sum(n for n, _ in projection_shapes(args).values())


def projection_params(args: ModelArgs) -> int:
    """Parameters of one decoder layer's projections (what ``--dtype fp8`` stores in e4m3)."""
    return sum(n * k for n, k in projection_shapes(args).values())


def norm_params(args: ModelArgs) -> int:
    """One decoder layer's norm weights: two RMSNorms over dim, q/k RMSNorms over head_dim."""
    return 2 * args.dim + (2 * args.head_dim if args.qk_norm else 0)


def layer_params(args: ModelArgs) -> int:
    """Parameters of one decoder layer (fused qkv, o, gate/up, down, two norms, q/k norms)."""
    return projection_params(args) + norm_params(args)


def param_count(args: ModelArgs) -> int:
    embed = args.vocab_size * args.dim
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return embed + head + args.n_layers * layer_params(args) + args.dim


def weight_bytes(args: ModelArgs, dtype: torch.dtype = torch.bfloat16) -> int:
    return param_count(args) * _dtype_bytes(dtype)


def weight_read_bytes(args: ModelArgs, dtype: torch.dtype = torch.bfloat16, *, fp8: bool = False) -> int:
    """Weight bytes one target step reads: every layer's projections (1 byte each and a float32
    scale per output channel with ``fp8``) and norms, the final norm and the lm_head (the tied
    embedding when there is none). The embedding table is read only at the step's tokens: left out."""
    width = _dtype_bytes(dtype)
    proj = projection_params(args) + 4 * projection_outputs(args) if fp8 else projection_params(args) * width
    head = args.vocab_size * args.dim + args.dim  # lm_head (or tied embedding) + final norm
    return args.n_layers * (proj + norm_params(args) * width) + head * width


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype = torch.bfloat16,
                       n_layers: int | None = None) -> int:
    """K and V of one token over all layers (or ``n_layers``, e.g. a drafter's)."""
    layers = args.n_layers if n_layers is None else n_layers
    return 2 * layers * args.n_kv_heads * args.head_dim * _dtype_bytes(dtype)


def drafter_params(args: ModelArgs, spec: DrafterSpec, *, share_embeddings: bool = True) -> int:
    """Drafter parameters: fc over [embedding, target hidden] + its layers (+ embedding/head when
    not shared with the target)."""
    own = 2 * args.dim * args.dim + spec.n_layers * layer_params(args) + args.dim
    if spec.kind == "parallel":
        own += args.dim  # mask-token embedding
    if not share_embeddings:
        own += args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return own
