"""A Llama / Qwen3-style decoder on a packed token axis, with random weights (cost is what counts).

``Transformer(args, backend)(input_ids [T], positions [T], meta) -> logits [T, vocab]``. Attention
goes through an injected backend (see ``spectune.models.attention``) that owns the KV cache.
Weights are created empty on the target device and filled in place (``normal_``), so even a 16 GB
model builds in seconds on a GPU; no default module initialisers run. ``quantize_linears_`` then
turns a model's decoder-layer projections into FP8 (``Fp8Linear``, maths in ``kernels/fp8.py``);
embeddings, norms and the lm_head stay in the activation dtype, as FP8 checkpoints keep them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.fp8 import fp8_linear, quantize_weight
from spectune.kernels.fused import DTYPES as FUSED_DTYPES
from spectune.kernels.fused import (
    add_rms_norm,
    add_rms_norm_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
    qk_norm_rope_write,
    rms_norm,
    rms_norm_ref,
    silu_mul,
    silu_mul_ref,
    triton_runs,
)
from spectune.kernels.gemv import rows_linear, small_m_linear
from spectune.models.attention import AttentionBackend
from spectune.models.config import ModelArgs
from spectune.models.paged import PagedTritonAttention

Device = torch.device | str | None


def _empty(*shape: int, device: Device, dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class Fp8Linear(nn.Module):
    """A projection weight [N, K] held as e4m3 with one float32 scale per output channel."""

    def __init__(self, weight: Tensor):
        super().__init__()
        q, scale = quantize_weight(weight)
        self.qweight: Tensor
        self.scale: Tensor
        self.register_buffer("qweight", q)  # [N, K] float8_e4m3fn
        self.register_buffer("scale", scale)  # [N] float32

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.qweight, self.scale)


Weight = nn.Parameter | Fp8Linear
PROJECTIONS = ("wqkv", "wo", "w13", "w2")  # the weights quantize_linears_ turns into FP8


def linear(x: Tensor, w: Weight) -> Tensor:
    return w(x) if isinstance(w, Fp8Linear) else F.linear(x, w)


def linear_small_m(x: Tensor, w: Weight) -> Tensor:
    """``linear`` with bf16/fp16 weights at one row through the one-row kernel
    (``kernels/gemv.py``: ``small_m_linear``), F.linear elsewhere; FP8 weights as ``linear``."""
    return w(x) if isinstance(w, Fp8Linear) else small_m_linear(x, w)


def linear_rows(x: Tensor, w: Weight) -> Tensor:
    """``linear_small_m``, and 17..64 rows under cuBLASLt (``kernels/gemv.py``: ``rows_linear``)."""
    return w(x) if isinstance(w, Fp8Linear) else rows_linear(x, w)


@dataclass(frozen=True)
class LayerOps:
    """The elementwise pieces of a layer: the torch references or the fused Triton kernels.

    ``qk_norm_rope_write`` (None: not used) is q/k-norm + RoPE with the paged KV-cache write in the
    same kernel; a layer uses it only where it is exact (``Attention.forward``), else
    ``qk_norm_rope`` and the backend's own write. ``linear`` runs the projections."""

    rms_norm: Callable[..., Tensor]
    add_rms_norm: Callable[..., tuple[Tensor, Tensor]]
    silu_mul: Callable[[Tensor], Tensor]
    qk_norm_rope: Callable[..., tuple[Tensor, Tensor, Tensor]]
    qk_norm_rope_write: Callable[..., Tensor] | None = None
    linear: Callable[[Tensor, Weight], Tensor] = linear


REFERENCE_OPS = LayerOps(rms_norm_ref, add_rms_norm_ref, silu_mul_ref, qk_norm_rope_ref)
FUSED_OPS = LayerOps(rms_norm, add_rms_norm, silu_mul, qk_norm_rope, qk_norm_rope_write)
FUSED_OPS_SEPARATE_WRITE = LayerOps(rms_norm, add_rms_norm, silu_mul, qk_norm_rope)


def layer_ops(device: torch.device, dtype: torch.dtype, kv_write: bool = True,
              small_m: bool = False, lt_rows: bool = False) -> LayerOps:
    """The fused kernels where Triton runs (CUDA, or CPU under ``TRITON_INTERPRET=1``) and takes
    the dtype (bf16, fp32), else the references (the same maths, unfused). ``kv_write``: the
    KV-cache write folded into the q/k-norm + RoPE kernel (False: the backend writes, a kernel
    of its own). ``small_m``: the projections through ``linear_small_m`` (else F.linear);
    ``lt_rows`` with it: through ``linear_rows``."""
    if not (triton_runs(device) and dtype in FUSED_DTYPES):
        ops = REFERENCE_OPS
    else:
        ops = FUSED_OPS if kv_write else FUSED_OPS_SEPARATE_WRITE
    if not small_m:
        return ops
    return replace(ops, linear=linear_rows if lt_rows else linear_small_m)


def writes_in_kernel(backend: AttentionBackend, dtype: torch.dtype) -> bool:
    """Whether ``LayerOps.qk_norm_rope_write`` may write ``backend``'s cache: it is the paged
    Triton cache and holds the activations' dtype (the write is then an exact copy, the cache bit
    for bit what the backend's own write leaves). Dense torch caches and a cache of another dtype
    keep the backend's write."""
    return isinstance(backend, PagedTritonAttention) and backend.dtype == dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE, rotate-half layout. ``forward(positions [T]) -> (cos, sin)`` each [T, 1, D]."""

    def __init__(self, head_dim: int, theta: float, *, device: Device = None):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", inv, persistent=False)  # [D/2]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq  # [T, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv: Weight = _empty(qkv_out, args.dim, device=device, dtype=dtype)  # fused q, k, v
        self.wo: Weight = _empty(args.dim, args.n_heads * args.head_dim, device=device, dtype=dtype)
        self.q_norm = RMSNorm(args.head_dim, args.rms_eps, device=device, dtype=dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_eps, device=device, dtype=dtype) if args.qk_norm else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: AttnMeta,
                backend: AttentionBackend, layer: int, ops: LayerOps | None = None) -> Tensor:
        t = x.shape[0]  # x: [T, dim]
        ops = ops or REFERENCE_OPS
        qkv = ops.linear(x, self.wqkv)  # [T, (H + 2 Hkv) D]
        qw = self.q_norm.weight if self.q_norm is not None else None
        kw = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        heads = (self.n_heads, self.n_kv_heads, self.head_dim)
        if ops.qk_norm_rope_write is not None and writes_in_kernel(backend, qkv.dtype):
            paged = cast(PagedTritonAttention, backend)
            meta, k_cache, v_cache, slots = paged.write_target(layer, meta, t)
            q = ops.qk_norm_rope_write(qkv, *rope, qw, kw, eps, *heads, k_cache, v_cache, slots)
            o = paged.attend(layer, q, meta)  # [T, H, D]
        else:
            q, k, v = ops.qk_norm_rope(qkv, *rope, qw, kw, eps, *heads)
            o = backend(layer, q, k, v, meta)  # [T, H, D]
        return ops.linear(o.reshape(t, self.n_heads * self.head_dim), self.wo)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.inter = args.intermediate_size
        self.w13: Weight = _empty(2 * args.intermediate_size, args.dim, device=device, dtype=dtype)  # gate, up
        self.w2: Weight = _empty(args.dim, args.intermediate_size, device=device, dtype=dtype)

    def forward(self, x: Tensor, ops: LayerOps | None = None) -> Tensor:
        ops = ops or REFERENCE_OPS
        return ops.linear(ops.silu_mul(ops.linear(x, self.w13)), self.w2)  # w13: [gate | up]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.rms_eps, device=device, dtype=dtype)
        self.attn = Attention(args, device=device, dtype=dtype)
        self.mlp_norm = RMSNorm(args.dim, args.rms_eps, device=device, dtype=dtype)
        self.mlp = MLP(args, device=device, dtype=dtype)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: AttnMeta,
                backend: AttentionBackend, layer: int) -> Tensor:
        h = x + self.attn(self.attn_norm(x), rope, meta, backend, layer)
        return h + self.mlp(self.mlp_norm(h))


def run_layers(layers: Sequence[DecoderLayer], x: Tensor, rope: tuple[Tensor, Tensor], meta: AttnMeta,
               backend: AttentionBackend, norm: RMSNorm, fused: bool,
               kv_write: bool = True, small_m: bool = False, lt_rows: bool = False) -> tuple[Tensor, Tensor]:
    """x [T, dim] through ``layers`` -> (residual stream after the last layer, ``norm`` of it).

    Unfused: each layer as ``DecoderLayer.forward`` reads, then the norm. Fused: the residual is
    carried beside the normalised input, so each residual add is one kernel with the norm after
    it (the last one with ``norm``), and q/k-norm + RoPE and SiLU x mul are one kernel each, the
    KV-cache write inside the q/k-norm + RoPE kernel where ``kv_write`` and ``writes_in_kernel``
    allow, and the projections through the one-row kernel where ``small_m`` (and at 17..64 rows
    through cuBLASLt where ``lt_rows`` too); the references
    stand in where Triton cannot run (CPU without its interpreter)."""
    if not fused or not layers:
        for i, layer in enumerate(layers):
            x = layer(x, rope, meta, backend, i)
        return x, norm(x)
    ops = layer_ops(x.device, x.dtype, kv_write, small_m, lt_rows)
    residual, h = x, ops.rms_norm(x, layers[0].attn_norm.weight, layers[0].attn_norm.eps)
    for i, layer in enumerate(layers):
        a = layer.attn(h, rope, meta, backend, i, ops)
        h, residual = ops.add_rms_norm(a, residual, layer.mlp_norm.weight, layer.mlp_norm.eps)
        after = layers[i + 1].attn_norm if i + 1 < len(layers) else norm
        h, residual = ops.add_rms_norm(layer.mlp(h, ops), residual, after.weight, after.eps)
    return residual, h


@torch.no_grad()
def init_random_(module: nn.Module, n_layers: int, generator: torch.Generator | None = None) -> None:
    """In-place random init that keeps activations O(1) in bf16: norms 1, embeddings N(0, 1),
    projections N(0, 1/fan_in), residual outputs (wo, w2) further scaled by 1/sqrt(2 n_layers)."""
    residual = 1.0 / math.sqrt(2 * max(n_layers, 1))
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif leaf in ("embed", "mask_embed"):
            p.normal_(0.0, 1.0, generator=generator)
        else:
            std = 1.0 / math.sqrt(p.shape[-1])
            if leaf in ("wo", "w2"):
                std *= residual
            p.normal_(0.0, std, generator=generator)


@torch.no_grad()
def quantize_linears_(module: nn.Module) -> None:
    """Every attention and MLP projection of ``module`` to ``Fp8Linear``, in place; each
    high-precision weight is dropped as soon as its FP8 copy exists (peak memory: the model plus
    one weight in float32)."""
    for layer in module.modules():
        if not isinstance(layer, Attention | MLP):
            continue
        for name in PROJECTIONS:
            weight = getattr(layer, name, None)
            if isinstance(weight, nn.Parameter):
                delattr(layer, name)
                setattr(layer, name, Fp8Linear(weight.data))
                del weight


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, backend: AttentionBackend | None = None, *,
                 device: Device = None, dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None, fused: bool = False):
        super().__init__()
        self.args = args
        self.backend = backend
        self.fused = fused  # run_layers with the fused kernels
        # fused: the KV-cache write inside the q/k-norm + RoPE kernel where it is exact (paged Triton
        # attention, cache in the activations' dtype); bit for bit the separate write, one launch
        # less per layer (H200 qwen3-8b: 0.987-0.994x the step with the separate write,
        # benchmarks/fused_step.py)
        self.kv_write = True
        # fused: the projections and the lm_head at one row (a batch-1 decode step) through the
        # one-row Triton kernel (kernels/gemv.py) instead of F.linear (H200 qwen3-8b batch 1:
        # 4.665 vs 5.088 ms a step, benchmarks/fused_step.py); more rows stay on F.linear
        self.small_m = True
        # fused with small_m: the projections at 17..64 rows through cuBLASLt (kernels/gemv.py,
        # rows_linear) instead of torch's default cuBLAS (H200 qwen3-8b, context 2048: batch 32
        # 7.259 vs 7.457 ms a step, batch 64 9.503 vs 9.655; batch 16 and 128 within 0.2 %)
        self.lt_rows = True
        self.embed = _empty(args.vocab_size, args.dim, device=device, dtype=dtype)  # [vocab, dim]
        self.layers = nn.ModuleList(DecoderLayer(args, device=device, dtype=dtype)
                                    for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.rms_eps, device=device, dtype=dtype)
        self.lm_head = None if args.tie_embeddings else _empty(args.vocab_size, args.dim, device=device, dtype=dtype)
        self.rotary = Rotary(args.head_dim, args.rope_theta, device=device)
        init_random_(self, args.n_layers, generator)

    @property
    def head_weight(self) -> Tensor:  # [vocab, dim]
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttnMeta,
                return_hidden: bool = False, logit_rows: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        # input_ids, positions: [T]; returns logits [T, vocab] (and hidden [T, dim] after the final norm);
        # with ``logit_rows`` [R] the logits of those rows only, [R, vocab] (a prefill forward needs
        # its pieces' last tokens: the lm_head over every prompt token is ~8 % of a 4 096-token forward)
        if self.backend is None:
            raise RuntimeError("Transformer has no attention backend; assign model.backend first")
        x = F.embedding(input_ids, self.embed)  # [T, dim]
        rope = self.rotary(positions, x.dtype)
        _, hidden = run_layers(cast(Sequence[DecoderLayer], self.layers), x, rope, meta, self.backend, self.norm,
                               self.fused, self.kv_write, self.small_m, self.lt_rows)
        w = self.head_weight
        rows = hidden if logit_rows is None else hidden.index_select(0, logit_rows)
        logits = small_m_linear(rows, w) if self.fused and self.small_m else F.linear(rows, w)  # [T or R, vocab]
        return (logits, hidden) if return_hidden else logits
