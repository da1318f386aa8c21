"""The step shapes the profiler times. Each factory returns a ``StepFn``: ``run()`` does one forward
of exactly that shape on static preallocated buffers (what a timer captures into a CUDA graph),
``refresh()`` rewrites those buffers with fresh non-zero random values in place.

KV caches are sized per point (exact batch, context and query length, so the attention reads what
the server would read). A step owns its cache; building the next step for the same model releases
the previous cache first (that older step then refuses to run), so only one point's cache lives. An allocation that does not
fit raises ``torch.cuda.OutOfMemoryError``; the caller records the point as infeasible.

Attention (``build_models(attention=...)``): "triton" is the paged Triton backend (block tables
and slot mapping built once per step as static device buffers, blocks scattered over the pool as
a server's cache is), "torch" the dense folded-GQA SDPA backend, "auto" = triton on CUDA, torch
elsewhere. ``Models.attention_name`` says which one the measurements used.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.kv_cache import blocks_needed
from spectune.models.attention import AttnMode, DenseTorchAttention
from spectune.models.config import DrafterSpec, ModelArgs, ModelError
from spectune.models.decoder import Transformer, quantize_linears_
from spectune.models.drafters import BlockDrafter, EagleDrafter, make_drafter
from spectune.models.paged import PagedTritonAttention

Drafter = EagleDrafter | BlockDrafter
AttentionChoice = Literal["auto", "triton", "torch"]
ATTENTION_NAMES = {"triton": "triton_paged", "torch": "torch_folded"}
PAGE_SIZE = 16  # tokens per KV cache block of the paged backend


@dataclass(frozen=True)
class StepFn:
    run: Callable[[], object]  # one forward on static buffers
    refresh: Callable[[], None]  # new random inputs, written in place
    tokens: int  # tokens the step processes (target: packed rows incl. padding; drafter: batch*k)
    batch: int  # real requests
    label: str = ""


def free_device_memory(device: torch.device | None = None) -> None:
    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.empty_cache()


def resolve_attention(attention: str, device: torch.device) -> Literal["triton", "torch"]:
    """"auto" -> "triton" on CUDA, "torch" elsewhere."""
    if attention == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if attention not in ("triton", "torch"):
        raise ModelError(f"attention must be 'auto', 'triton' or 'torch', got {attention!r}")
    return attention  # type: ignore[return-value]


def _release_old(module: nn.Module) -> None:
    old = getattr(module, "backend", None)
    module.backend = None  # type: ignore[assignment]
    if isinstance(old, DenseTorchAttention | PagedTritonAttention):
        old.release()  # steps built earlier may still hold it; its memory goes now


def _make_room(module: nn.Module) -> tuple[ModelArgs, torch.Tensor]:
    """Release ``module``'s cache and free device memory for a new one; returns the model's args and
    one of its weights (dtype and device of the new cache)."""
    _release_old(module)
    args: ModelArgs = module.args  # type: ignore[assignment]
    weight = next(module.parameters())
    free_device_memory(weight.device)
    return args, weight


def fit_paged_cache(module: nn.Module, n_layers: int, *, batch: int, ctx_max: int, max_q: int,
                    causal: bool = True) -> PagedTritonAttention:
    """Give ``module.backend`` a paged cache with room for ``batch`` requests of ``ctx_max`` + ``max_q``
    tokens, context prefilled with random K/V, block tables scattered over the pool (reused if it
    already is that size)."""
    old = getattr(module, "backend", None)
    key = (batch, ctx_max, max_q)
    if (isinstance(old, PagedTritonAttention) and not old.released and old.causal == causal
            and old.shape_key == key):
        return old
    del old
    args, weight = _make_room(module)
    num_blocks = batch * blocks_needed(ctx_max + max_q, PAGE_SIZE)
    backend = PagedTritonAttention(n_layers, num_blocks, PAGE_SIZE, args.n_kv_heads, args.head_dim,
                                   weight.dtype, weight.device, causal=causal)
    backend.allocate(batch, ctx_max, max_q, generator=torch.Generator().manual_seed(num_blocks))
    module.backend = backend  # type: ignore[assignment]
    return backend


def fit_cache(module: nn.Module, n_layers: int, *, batch: int, ctx_max: int, max_q: int,
              causal: bool = True, mode: AttnMode | None = None) -> DenseTorchAttention:
    """Give ``module.backend`` a dense cache of exactly this size (reuse it if it already is)."""
    old = getattr(module, "backend", None)
    old_mode = old.mode if isinstance(old, DenseTorchAttention) else "folded"
    mode = mode or old_mode
    if (isinstance(old, DenseTorchAttention) and old.shape_key == (batch, ctx_max, max_q)
            and old.causal == causal and old.mode == mode):
        return old
    del old
    args, weight = _make_room(module)
    backend = DenseTorchAttention(n_layers, batch, ctx_max, max_q, args.n_kv_heads, args.head_dim,
                                  dtype=weight.dtype, device=weight.device, mode=mode, causal=causal)
    backend.randomize_()
    module.backend = backend  # type: ignore[assignment]
    return backend


def even_split(tokens: int, batch: int) -> list[int]:
    """``tokens`` over ``batch`` requests as evenly as possible (first ones get the remainder)."""
    base, extra = divmod(tokens, batch)
    return [base + (1 if i < extra else 0) for i in range(batch)]


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ModelError(f"{key} must be >= 1, got {value}")


def _packed_step(model: Transformer, q_lens: Sequence[int], tokens: int, context_len: int,
                 label: str, generator: torch.Generator | None, attention: str) -> StepFn:
    batch, max_q, device = len(q_lens), max(q_lens), model.device
    backend: DenseTorchAttention | PagedTritonAttention
    if resolve_attention(attention, device) == "triton":
        backend = fit_paged_cache(model, model.args.n_layers, batch=batch, ctx_max=context_len, max_q=max_q)
        # static device buffers: offsets, block tables [B, max_blocks], slot mapping [T]
        meta = backend.meta_for(backend.block_tables, q_lens, [context_len] * batch,  # type: ignore[arg-type]
                                num_tokens=tokens, max_q=max_q)
    else:
        backend = fit_cache(model, model.args.n_layers, batch=batch, ctx_max=context_len, max_q=max_q)
        meta = AttnMeta.from_lens(q_lens, [context_len] * batch, device=device, max_q=max_q)
    pos = [context_len + j for q in q_lens for j in range(q)]
    pos += [0] * (tokens - len(pos))  # padding rows
    positions = torch.tensor(pos, dtype=torch.long, device=device)  # [T]
    ids = torch.empty(tokens, dtype=torch.long, device=device)  # [T]
    vocab = model.args.vocab_size

    def refresh() -> None:
        ids.random_(1, vocab, generator=generator)

    def run() -> object:
        model.backend = backend
        return model(ids, positions, meta)

    refresh()
    return StepFn(run=run, refresh=refresh, tokens=tokens, batch=batch, label=label)


def target_step(model: Transformer, *, batch: int, q: int, context_len: int,
                generator: torch.Generator | None = None, attention: AttentionChoice = "auto") -> StepFn:
    """Target verification with ``q`` tokens for each of ``batch`` requests (T = batch * q)."""
    _check_positive(batch=batch, q=q, context_len=context_len)
    return _packed_step(model, [q] * batch, batch * q, context_len,
                        f"target b={batch} q={q} ctx={context_len}", generator, attention)


def tier_step(model: Transformer, *, tier: int, batch: int, context_len: int,
              q_lens: Sequence[int] | None = None, generator: torch.Generator | None = None,
              attention: AttentionChoice = "auto") -> StepFn:
    """``tier`` packed rows: ``batch`` requests with ``q_lens`` tokens, padding rows after."""
    _check_positive(tier=tier, batch=batch, context_len=context_len)
    if batch > tier:
        raise ModelError(f"batch {batch} exceeds tier {tier} (each request needs a token)")
    lens = list(q_lens) if q_lens is not None else even_split(tier, batch)
    if len(lens) != batch:
        raise ModelError(f"q_lens has {len(lens)} entries, expected batch={batch}")
    if min(lens) < 1 or sum(lens) > tier:
        raise ModelError(f"q_lens must be >= 1 each and sum to <= tier={tier}, got {lens}")
    return _packed_step(model, lens, tier, context_len,
                        f"tier {tier} b={batch} ctx={context_len}", generator, attention)


def drafter_step(drafter: Drafter, *, batch: int, k: int, context_len: int,
                 generator: torch.Generator | None = None, attention: AttentionChoice = "auto") -> StepFn:
    """Drafter proposing ``k`` tokens for each of ``batch`` requests."""
    _check_positive(batch=batch, context_len=context_len)
    if k < 0:
        raise ModelError(f"k must be >= 0, got {k}")
    args = drafter.args
    weight = next(drafter.parameters())
    backend: DenseTorchAttention | PagedTritonAttention
    if resolve_attention(attention, weight.device) == "triton":
        # block drafter: one block of k tokens sees itself whole; autoregressive: k steps of 1
        backend = fit_paged_cache(drafter, drafter.n_layers, batch=batch, ctx_max=context_len,
                                  max_q=max(k, 1), causal=not isinstance(drafter, BlockDrafter))
    elif isinstance(drafter, BlockDrafter):
        backend = fit_cache(drafter, drafter.n_layers, batch=batch, ctx_max=context_len,
                            max_q=max(k, 1), causal=False)
    else:
        backend = fit_cache(drafter, drafter.n_layers, batch=batch, ctx_max=context_len + k, max_q=1)
    device = weight.device
    hidden = torch.empty(batch, args.dim, dtype=weight.dtype, device=device)  # [B, dim]
    last_ids = torch.empty(batch, dtype=torch.long, device=device)  # [B]
    ctx = torch.full((batch,), context_len, dtype=torch.int32, device=device)  # [B]

    def refresh() -> None:
        hidden.normal_(generator=generator)
        last_ids.random_(1, args.vocab_size, generator=generator)

    def run() -> object:
        drafter.backend = backend
        return drafter.propose(hidden, last_ids, k, context_lens=ctx)

    refresh()
    return StepFn(run=run, refresh=refresh, tokens=batch * k, batch=batch,
                  label=f"drafter {drafter.kind} b={batch} k={k} ctx={context_len}")


@dataclass
class Models:
    """The target (allocated once) and the drafter sharing its embeddings; caches come per point."""

    args: ModelArgs
    spec: DrafterSpec
    target: Transformer
    drafter: Drafter
    device: torch.device
    dtype: torch.dtype
    max_batch: int
    max_q: int
    context_len: int
    attention: Literal["triton", "torch"] = "torch"  # resolved backend of every step
    fp8: bool = False  # the target's projections in e4m3 (the drafter stays in ``dtype``)
    fused: bool = False  # target and drafter layers with the fused kernels (kernels/fused.py)

    @property
    def attention_name(self) -> str:
        """What the steps' attention is, for the measurement records: triton_paged / torch_folded."""
        return ATTENTION_NAMES[self.attention]

    def _check(self, batch: int, q: int, context_len: int) -> None:
        if batch > self.max_batch:
            raise ModelError(f"batch {batch} exceeds max_batch={self.max_batch}")
        if q > self.max_q:
            raise ModelError(f"{q} tokens per request exceeds max_q={self.max_q}")
        if context_len > self.context_len:
            raise ModelError(f"context_len {context_len} exceeds the built context_len={self.context_len}")

    def target_step(self, *, batch: int, q: int, context_len: int | None = None) -> StepFn:
        ctx = context_len or self.context_len
        self._check(batch, q, ctx)
        return target_step(self.target, batch=batch, q=q, context_len=ctx, attention=self.attention)

    def tier_step(self, *, tier: int, batch: int, context_len: int | None = None,
                  q_lens: Sequence[int] | None = None) -> StepFn:
        ctx = context_len or self.context_len
        self._check(batch, 1, ctx)
        return tier_step(self.target, tier=tier, batch=batch, context_len=ctx, q_lens=q_lens,
                         attention=self.attention)

    def drafter_step(self, *, batch: int, k: int, context_len: int | None = None) -> StepFn:
        ctx = context_len or self.context_len
        self._check(batch, 1, ctx)
        return drafter_step(self.drafter, batch=batch, k=k, context_len=ctx, attention=self.attention)

    def free_caches(self) -> None:
        self.target.backend = None
        self.drafter.backend = None
        free_device_memory(self.device)


def build_target(args: ModelArgs, *, device: torch.device | str, dtype: torch.dtype, fp8: bool = False,
                 generator: torch.Generator | None = None, fused: bool = False) -> Transformer:
    """The target with random weights on ``device``; ``fp8``: its projections quantised to e4m3
    (per output channel, ``kernels/fp8.py``), embeddings, norms and lm_head left in ``dtype``;
    ``fused``: its layers run the fused kernels of ``kernels/fused.py``."""
    dev = torch.device(device)
    model = Transformer(args, None, device=dev, dtype=dtype, generator=generator, fused=fused)
    if fp8:
        quantize_linears_(model)
        free_device_memory(dev)
    return model


def build_models(target: ModelArgs, drafter: DrafterSpec, *, device: torch.device | str,
                 dtype: torch.dtype, max_batch: int, max_q: int, context_len: int,
                 seed: int = 0, attention: AttentionChoice = "auto", fp8: bool = False,
                 fused: bool = False) -> Models:
    """Allocate the target and drafter weights once on ``device`` (random, seeded). ``attention``:
    "auto" (Triton paged on CUDA, torch folded elsewhere), "triton" or "torch". ``fp8``: the
    target's projections in e4m3 with ``dtype`` activations; the drafter stays in ``dtype``.
    ``fused``: target and drafter layers with the fused kernels (residual + RMSNorm, q/k-norm +
    RoPE, SiLU x mul in one kernel each; their references where Triton cannot run)."""
    _check_positive(max_batch=max_batch, max_q=max_q, context_len=context_len)
    dev = torch.device(device)
    kind = resolve_attention(attention, dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    model = build_target(target, device=dev, dtype=dtype, fp8=fp8, generator=gen, fused=fused)
    draft = make_drafter(target, drafter, None, target=model, device=dev, dtype=dtype, generator=gen,
                         fused=fused)
    return Models(args=target, spec=drafter, target=model, drafter=draft, device=dev, dtype=dtype,
                  max_batch=max_batch, max_q=max_q, context_len=context_len, attention=kind, fp8=fp8,
                  fused=fused)
