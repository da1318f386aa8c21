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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.fp8 import fp8_linear, quantize_weight
from spectune.models.attention import AttentionBackend
from spectune.models.config import ModelArgs

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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


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


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, heads, D]; rotate_half(x) = [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


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
                backend: AttentionBackend, layer: int) -> Tensor:
        t = x.shape[0]  # x: [T, dim]
        hq, hkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = linear(x, self.wqkv).split([hq, hkv, hkv], dim=-1)
        q = q.view(t, self.n_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.n_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = backend(layer, q, k, v, meta)  # [T, H, D]
        return linear(o.reshape(t, hq), self.wo)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, *, device: Device = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.inter = args.intermediate_size
        self.w13: Weight = _empty(2 * args.intermediate_size, args.dim, device=device, dtype=dtype)  # gate, up
        self.w2: Weight = _empty(args.dim, args.intermediate_size, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = linear(x, self.w13).split([self.inter, self.inter], dim=-1)
        return linear(F.silu(gate) * up, self.w2)


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
                 generator: torch.Generator | None = None):
        super().__init__()
        self.args = args
        self.backend = backend
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
                return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        # input_ids, positions: [T]; returns logits [T, vocab] (and hidden [T, dim] after the final norm)
        if self.backend is None:
            raise RuntimeError("Transformer has no attention backend; assign model.backend first")
        x = F.embedding(input_ids, self.embed)  # [T, dim]
        rope = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, meta, self.backend, i)
        hidden = self.norm(x)
        logits = F.linear(hidden, self.head_weight)
        return (logits, hidden) if return_hidden else logits
