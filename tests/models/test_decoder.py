import dataclasses

import pytest
import torch

from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.fp8 import FP8, quantize_weight
from spectune.models.attention import DenseTorchAttention
from spectune.models.config import ModelArgs
from spectune.models.decoder import PROJECTIONS, Fp8Linear, Transformer, quantize_linears_
from spectune.models.drafters import BlockDrafter, EagleDrafter, greedy_confidence
from spectune.models.paged import PagedTritonAttention

TINY = ModelArgs.from_name("tiny")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # paged Triton tests: the interpreter on CPU


def build(dtype=torch.float64, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return Transformer(TINY, device="cpu", dtype=dtype, generator=g, **kw)


def fresh_cache(n_layers, batch, ctx_max, max_q, dtype=torch.float64, causal=True):
    return DenseTorchAttention(n_layers, batch, ctx_max, max_q, TINY.n_kv_heads, TINY.head_dim,
                               dtype=dtype, causal=causal)


def test_incremental_steps_match_one_prefill():
    model = build()
    length = 7
    ids = torch.randint(1, TINY.vocab_size, (2 * length,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(length).repeat(2)
    model.backend = fresh_cache(TINY.n_layers, 2, 16, length)
    full = model(ids, pos, AttnMeta.from_lens([length, length], [0, 0]))

    model.backend = fresh_cache(TINY.n_layers, 2, 16, length)
    # step 1: request 0 gets 4 tokens, request 1 gets 6, then 2 padding rows
    ids1 = torch.cat([ids[:4], ids[length:length + 6], torch.tensor([3, 3])])
    pos1 = torch.cat([pos[:4], pos[length:length + 6], torch.zeros(2, dtype=torch.long)])
    out1 = model(ids1, pos1, AttnMeta.from_lens([4, 6], [0, 0], max_q=6))
    # step 2: the rest (3 and 1 tokens) on top of the cached context, 1 padding row
    ids2 = torch.cat([ids[4:length], ids[length + 6:], torch.tensor([9])])
    pos2 = torch.cat([pos[4:length], pos[length + 6:], torch.zeros(1, dtype=torch.long)])
    out2 = model(ids2, pos2, AttnMeta.from_lens([3, 1], [4, 6], max_q=6))

    torch.testing.assert_close(out1[:4], full[:4])
    torch.testing.assert_close(out1[4:10], full[length:length + 6])
    torch.testing.assert_close(out2[:3], full[4:length])
    torch.testing.assert_close(out2[3:4], full[2 * length - 1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_finite_and_shaped(dtype):
    model = build(dtype=dtype)
    model.backend = fresh_cache(TINY.n_layers, 3, 8, 2, dtype=dtype)
    model.backend.randomize_()
    ids = torch.randint(1, TINY.vocab_size, (7,))
    logits, hidden = model(ids, torch.arange(7), AttnMeta.from_lens([2, 1, 2], [8, 3, 5], max_q=2),
                           return_hidden=True)
    assert logits.shape == (7, TINY.vocab_size) and hidden.shape == (7, TINY.dim)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert 0.1 < logits.float().std() < 10  # random init keeps logits O(1)


def test_seeded_init_is_reproducible_and_tied_head_shares_embedding():
    a, b = build(seed=5), build(seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    tied = Transformer(dataclasses.replace(TINY, tie_embeddings=True))
    assert tied.head_weight is tied.embed


def test_forward_without_backend_is_an_error():
    with pytest.raises(RuntimeError, match="backend"):
        build()(torch.tensor([1]), torch.tensor([0]), AttnMeta.from_lens([1], [0]))


def test_greedy_confidence_is_softmax_of_argmax():
    logits = torch.randn(5, 11, dtype=torch.float64)
    ids, conf = greedy_confidence(logits)
    probs = logits.softmax(-1)
    assert torch.equal(ids, probs.argmax(-1))
    torch.testing.assert_close(conf, probs.max(-1).values.float())


def drafter_inputs(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, TINY.dim, generator=g, dtype=torch.float64)
    last = torch.randint(1, TINY.vocab_size, (batch,), generator=g)
    return hidden, last


@pytest.mark.parametrize("cls", [EagleDrafter, BlockDrafter])
def test_drafter_outputs(cls):
    target = build()
    drafter = cls(TINY, 2, target=target, dtype=torch.float64)
    assert drafter.embed_weight is target.embed  # shared, not copied
    causal = cls is EagleDrafter
    drafter.backend = fresh_cache(2, 3, 10 + 4, 1 if causal else 4, causal=causal)
    hidden, last = drafter_inputs(3)
    ctx = torch.tensor([10, 0, 5], dtype=torch.int32)
    ids, conf = drafter.propose(hidden, last, 4, context_lens=ctx)
    assert ids.shape == conf.shape == (3, 4)
    assert ids.dtype == torch.long and ((ids >= 0) & (ids < TINY.vocab_size)).all()
    assert ((conf > 0) & (conf <= 1)).all()
    empty_ids, empty_conf = drafter.propose(hidden, last, 0, context_lens=ctx)
    assert empty_ids.shape == empty_conf.shape == (3, 0)


@pytest.mark.parametrize("cls", [EagleDrafter, BlockDrafter])
def test_drafter_requests_are_independent(cls):
    # request 1 of a batch of 3 drafts exactly what it drafts alone (same weights, same cache rows)
    drafter = cls(TINY, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    causal = cls is EagleDrafter
    ctx_max, max_q = 12, 1 if causal else 3
    drafter.backend = fresh_cache(1, 3, ctx_max, max_q, causal=causal)
    drafter.backend.randomize_(torch.Generator().manual_seed(4))
    hidden, last = drafter_inputs(3)
    ctx = torch.tensor([4, 7, 2], dtype=torch.int32)
    ids, conf = drafter.propose(hidden, last, 3, context_lens=ctx)

    alone = fresh_cache(1, 1, ctx_max, max_q, causal=causal)
    for full, single in zip(drafter.backend.cache(0), alone.cache(0), strict=True):
        single.copy_(full[1:2])
    drafter.backend = alone
    ids1, conf1 = drafter.propose(hidden[1:2], last[1:2], 3, context_lens=ctx[1:2])
    assert torch.equal(ids1[0], ids[1])
    torch.testing.assert_close(conf1[0], conf[1])


def test_eagle_drafts_are_sequential_prefixes():
    # K sequential steps: the first 2 drafts of k=4 are the drafts of k=2
    drafter = EagleDrafter(TINY, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    drafter.backend = fresh_cache(1, 2, 12, 1)
    hidden, last = drafter_inputs(2, seed=3)
    ctx = torch.tensor([3, 6], dtype=torch.int32)
    ids4, conf4 = drafter.propose(hidden, last, 4, context_lens=ctx)
    ids2, conf2 = drafter.propose(hidden, last, 2, context_lens=ctx)
    assert torch.equal(ids4[:, :2], ids2)
    torch.testing.assert_close(conf4[:, :2], conf2)


# ---------------------------------------------------------------------------------------------
# FP8 projections


def test_fp8_quantises_the_projections_only():
    dense, fp8 = build(dtype=torch.float32, seed=5), build(dtype=torch.float32, seed=5)
    quantize_linears_(fp8)
    for layer_d, layer_q in zip(dense.layers, fp8.layers, strict=True):
        for block_d, block_q, names in ((layer_d.attn, layer_q.attn, ("wqkv", "wo")),
                                        (layer_d.mlp, layer_q.mlp, ("w13", "w2"))):
            for name in names:
                q = getattr(block_q, name)
                assert isinstance(q, Fp8Linear) and q.qweight.dtype == FP8
                want_q, want_s = quantize_weight(getattr(block_d, name))
                assert torch.equal(q.qweight.view(torch.uint8), want_q.view(torch.uint8))
                assert torch.equal(q.scale, want_s)
    fp8_names = {n for n, _ in fp8.named_parameters()}
    assert not any(n.rsplit(".", 1)[-1] in PROJECTIONS for n in fp8_names)
    kept = dict(fp8.named_parameters())
    for name, p in dense.named_parameters():  # embeddings, norms, lm_head: untouched
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            assert torch.equal(kept[name], p), name
    quantize_linears_(fp8)  # a second call changes nothing
    assert isinstance(fp8.layers[0].attn.wqkv, Fp8Linear)


def test_fp8_logits_track_the_dense_model_and_rows_stay_independent():
    dense, fp8 = build(dtype=torch.float32, seed=2), build(dtype=torch.float32, seed=2)
    quantize_linears_(fp8)
    ids = torch.randint(1, TINY.vocab_size, (9,), generator=torch.Generator().manual_seed(4))
    meta = AttnMeta.from_lens([4, 5], [0, 0], max_q=5)
    pos = torch.cat([torch.arange(4), torch.arange(5)])
    outs = []
    for model in (dense, fp8):
        model.backend = fresh_cache(TINY.n_layers, 2, 8, 5, dtype=torch.float32)
        outs.append(model(ids, pos, meta))
    want, got = outs
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.15  # quantised (not the dense path), and close to it
    # request 1 alone gives its rows of the batched step: per-token scales see only their row
    fp8.backend = fresh_cache(TINY.n_layers, 1, 8, 5, dtype=torch.float32)
    alone = fp8(ids[4:], pos[4:], AttnMeta.from_lens([5], [0], max_q=5))
    torch.testing.assert_close(alone, got[4:])


# ---------------------------------------------------------------------------------------------
# fused layers (kernels/fused.py; Triton's interpreter on CPU)


def fused_pair(dtype, args=TINY, seed=0):
    g = torch.Generator().manual_seed(seed)
    plain = Transformer(args, device="cpu", dtype=dtype, generator=g)
    fused = Transformer(args, device="cpu", dtype=dtype, fused=True)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3 / Llama
def test_fused_layers_track_the_unfused_decoder(dtype, qk_norm):
    args = dataclasses.replace(TINY, qk_norm=qk_norm)
    plain, fused = fused_pair(dtype, args)
    meta = AttnMeta.from_lens([2, 1, 3], [8, 3, 5], max_q=3)
    ids = torch.randint(1, TINY.vocab_size, (7,), generator=torch.Generator().manual_seed(3))  # 1 padding row
    pos = torch.tensor([8, 9, 3, 5, 6, 7, 0])
    outs = []
    for model in (plain, fused):
        cache = fresh_cache(TINY.n_layers, 3, 8, 3, dtype=dtype)
        cache.randomize_(torch.Generator().manual_seed(5))
        model.backend = cache
        outs.append(model(ids, pos, meta, return_hidden=True))
    (logits, hidden), (f_logits, f_hidden) = outs
    tol = {"atol": 0.1, "rtol": 0.05} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(f_hidden.float(), hidden.float(), **tol)
    torch.testing.assert_close(f_logits.float(), logits.float(), **tol)
    if dtype == torch.float32:
        assert torch.equal(f_logits[:6].argmax(-1), logits[:6].argmax(-1))


def paged_greedy(model, dtype, steps, *, kv_write=True, follow=None):
    """Greedy decoding over a paged Triton cache (the same random context and block tables for
    every model): step 0 verifies q_lens [2, 1, 3] plus 2 padding rows, then one token per request
    per step, 1 padding row. With `follow` (tokens [steps, 3] of another run) each step feeds those
    tokens instead of its own, so two models' logits stay comparable after a 16-bit argmax flip.
    Returns (logits of each step, its own greedy tokens [steps, 3], the backend)."""
    torch.manual_seed(11)  # the cache's random context
    backend = PagedTritonAttention(TINY.n_layers, 16, 4, TINY.n_kv_heads, TINY.head_dim, dtype,
                                   DEVICE)
    tables = backend.allocate(3, 8, 3 + steps, generator=torch.Generator().manual_seed(12))
    model.to(DEVICE)
    model.backend, model.kv_write = backend, kv_write
    q_lens, ctx = [2, 1, 3], [8, 3, 5]
    ids = torch.randint(1, TINY.vocab_size, (8,), generator=torch.Generator().manual_seed(13))
    ids = ids.to(DEVICE)
    logits, tokens = [], []
    for _ in range(steps):
        meta = backend.meta_for(tables, q_lens, ctx, num_tokens=ids.shape[0])
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx, q_lens, strict=True)])
        pos = torch.cat([pos, torch.zeros(ids.shape[0] - pos.shape[0], dtype=torch.long)])
        out = model(ids, pos.to(DEVICE), meta).cpu()
        last = torch.tensor(q_lens).cumsum(0) - 1  # each request's last real row
        nxt = out[last].argmax(-1)
        logits.append(out[: sum(q_lens)])
        tokens.append(nxt)
        ctx = [c + q for c, q in zip(ctx, q_lens, strict=True)]
        q_lens = [1, 1, 1]
        fed = nxt if follow is None else follow[len(tokens) - 1]
        ids = torch.cat([fed, torch.tensor([1])]).to(DEVICE)  # one padding row
    return logits, torch.stack(tokens), backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3 / Llama
def test_fused_cache_write_decodes_what_the_unfused_decoder_does(dtype, qk_norm, monkeypatch):
    # paged Triton attention: the fused decoder with the KV-cache write inside the q/k-norm + RoPE
    # kernel, the fused decoder with the separate write, and the unfused decoder
    from spectune.models import paged

    args = dataclasses.replace(TINY, qk_norm=qk_norm)
    plain, fused = fused_pair(dtype, args)
    separate_writes = []  # the backend's own write_kv calls, one per layer and step
    real_write = paged.write_kv
    monkeypatch.setattr(paged, "write_kv", lambda *a: separate_writes.append(1) or real_write(*a))
    ref_logits, ref_tokens, ref_cache = paged_greedy(plain, dtype, 3)
    # both fused runs are fed the reference's tokens (a bf16 argmax may flip on a GPU)
    sep_logits, sep_tokens, sep_cache = paged_greedy(fused, dtype, 3, kv_write=False, follow=ref_tokens)
    assert len(separate_writes) == 2 * 3 * TINY.n_layers
    new_logits, new_tokens, new_cache = paged_greedy(fused, dtype, 3, follow=ref_tokens)
    assert len(separate_writes) == 2 * 3 * TINY.n_layers  # none: the kernel wrote the cache
    # the folded write is an exact copy of the separate one: bit for bit the same step
    for a, b in zip(new_logits, sep_logits, strict=True):
        assert torch.equal(a, b)
    for layer in range(TINY.n_layers):
        assert torch.equal(new_cache.kv(layer)[0], sep_cache.kv(layer)[0])
        assert torch.equal(new_cache.kv(layer)[1], sep_cache.kv(layer)[1])
    # and the unfused decoder's within rounding, its greedy tokens where fp32 holds them
    tol = {"atol": 0.1, "rtol": 0.05} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    for a, b in zip(new_logits, ref_logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    if dtype == torch.float32:
        assert torch.equal(new_tokens, ref_tokens)
    # the padding rows wrote into no request's slot: the caches agree with the unfused decoder's
    # (written through write_kv) everywhere, within the rounding of k
    for layer in range(TINY.n_layers):
        torch.testing.assert_close(new_cache.kv(layer)[1].float(), ref_cache.kv(layer)[1].float(), **tol)
        torch.testing.assert_close(new_cache.kv(layer)[0].float(), ref_cache.kv(layer)[0].float(), **tol)


def test_fused_cache_write_only_where_it_is_exact():
    from spectune.models import decoder

    # a dense torch cache, or a paged cache of another dtype than the activations: the separate write
    assert not decoder.writes_in_kernel(fresh_cache(1, 1, 4, 1), torch.float64)
    assert not decoder.writes_in_kernel(PagedTritonAttention(1, 1, 4, 2, 32, torch.float32), torch.bfloat16)
    assert decoder.layer_ops(torch.device("cuda"), torch.bfloat16).qk_norm_rope_write is not None
    assert decoder.layer_ops(torch.device("cuda"), torch.bfloat16, kv_write=False).qk_norm_rope_write is None
    assert decoder.REFERENCE_OPS.qk_norm_rope_write is None  # the unfused decoder writes as before


def test_fused_layers_fall_back_to_the_references_without_triton(monkeypatch):
    # CPU without TRITON_INTERPRET: the fused structure with the references, the same maths
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from spectune.models import decoder

    assert decoder.layer_ops(torch.device("cpu"), torch.float32) is decoder.REFERENCE_OPS
    plain, fused = fused_pair(torch.float64)
    meta = AttnMeta.from_lens([3], [4], max_q=3)
    ids, pos = torch.tensor([5, 6, 7]), torch.tensor([4, 5, 6])
    for model in (plain, fused):
        model.backend = fresh_cache(TINY.n_layers, 1, 4, 3)
    torch.testing.assert_close(fused(ids, pos, meta), plain(ids, pos, meta), atol=1e-12, rtol=1e-12)
    assert decoder.layer_ops(torch.device("cuda"), torch.bfloat16) is decoder.FUSED_OPS
    assert decoder.layer_ops(torch.device("cuda"), torch.float64) is decoder.REFERENCE_OPS


@pytest.mark.parametrize("cls", [EagleDrafter, BlockDrafter])
@pytest.mark.parametrize("paged", [False, True])  # dense torch cache; paged (the cache write folded in)
def test_fused_drafter_proposes_what_the_unfused_one_does(cls, paged):
    g = torch.Generator().manual_seed(2)
    plain = cls(TINY, 2, dtype=torch.float32, generator=g)
    fused = cls(TINY, 2, dtype=torch.float32, fused=True)
    fused.load_state_dict(plain.state_dict())
    causal = cls is EagleDrafter
    hidden, last = drafter_inputs(3)
    ctx = torch.tensor([4, 7, 2], dtype=torch.int32)
    device = DEVICE if paged else "cpu"
    hidden, last, ctx = hidden.float().to(device), last.to(device), ctx.to(device)
    out = []
    for d in (plain, fused):
        if paged:  # meta without block tables: the drafters' own per-step meta
            torch.manual_seed(4)
            d.to(device)
            d.backend = PagedTritonAttention(2, 12, 4, TINY.n_kv_heads, TINY.head_dim,
                                             torch.float32, device, causal=causal)
            d.backend.allocate(3, 8, 3, generator=torch.Generator().manual_seed(5))
        else:
            d.backend = fresh_cache(2, 3, 12, 1 if causal else 3, dtype=torch.float32, causal=causal)
            d.backend.randomize_(torch.Generator().manual_seed(4))
        out.append(d.propose(hidden, last, 3, context_lens=ctx))
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-5, rtol=1e-5)
    if paged:
        for layer in range(2):
            for a, b in zip(fused.backend.kv(layer), plain.backend.kv(layer), strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_row_projections_track_f_linear(dtype, monkeypatch):
    # model.small_m (on by default): a one-token forward of the fused decoder runs its projections
    # and the lm_head through the one-row kernel (bf16; fp32 stays on F.linear); a forward of more
    # tokens is F.linear throughout, bit for bit the step without it
    from spectune.kernels import gemv
    from spectune.models import decoder

    assert decoder.layer_ops(torch.device("cuda"), torch.bfloat16).linear is decoder.linear
    assert decoder.layer_ops(torch.device("cuda"), torch.bfloat16, small_m=True).linear is decoder.linear_small_m
    assert decoder.layer_ops(torch.device("cuda"), torch.bfloat16, small_m=True, lt_rows=True).linear \
        is decoder.linear_rows
    assert decoder.layer_ops(torch.device("cuda"), torch.bfloat16, lt_rows=True).linear is decoder.linear
    _, fused = fused_pair(dtype)
    assert fused.small_m is True
    calls = []
    real = gemv.gemv_row
    monkeypatch.setattr(gemv, "gemv_row", lambda x, w, *a: calls.append(w.shape) or real(x, w, *a))
    monkeypatch.setattr(gemv, "small_m_matmul", lambda *a: pytest.fail("the small-M kernel is off this path"))
    gen = torch.Generator().manual_seed(3)
    for lens, ctx, pos in (([1], [8], [8]), ([2, 1, 3], [8, 3, 5], [8, 9, 3, 5, 6, 7, 0])):
        meta = AttnMeta.from_lens(lens, ctx, max_q=max(lens))
        ids = torch.randint(1, TINY.vocab_size, (len(pos),), generator=gen)
        outs = []
        calls.clear()
        for small_m in (False, True):
            cache = fresh_cache(TINY.n_layers, len(lens), 8, 3, dtype=dtype)
            cache.randomize_(torch.Generator().manual_seed(5))
            fused.backend, fused.small_m = cache, small_m
            outs.append(fused(ids, torch.tensor(pos), meta))
        one_row = len(pos) == 1 and dtype == torch.bfloat16
        assert len(calls) == (4 * TINY.n_layers + 1 if one_row else 0)  # wqkv, wo, w13, w2 a layer; lm_head
        if one_row:
            torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=0.1, rtol=0.05)
        else:
            assert torch.equal(outs[1], outs[0])
