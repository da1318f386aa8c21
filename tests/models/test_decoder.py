import dataclasses

import pytest
import torch

from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.fp8 import FP8, quantize_weight
from spectune.models.attention import DenseTorchAttention
from spectune.models.config import ModelArgs
from spectune.models.decoder import PROJECTIONS, Fp8Linear, Transformer, quantize_linears_
from spectune.models.drafters import BlockDrafter, EagleDrafter, greedy_confidence

TINY = ModelArgs.from_name("tiny")


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
def test_fused_drafter_proposes_what_the_unfused_one_does(cls):
    g = torch.Generator().manual_seed(2)
    plain = cls(TINY, 2, dtype=torch.float32, generator=g)
    fused = cls(TINY, 2, dtype=torch.float32, fused=True)
    fused.load_state_dict(plain.state_dict())
    causal = cls is EagleDrafter
    hidden, last = drafter_inputs(3)
    ctx = torch.tensor([4, 7, 2], dtype=torch.int32)
    out = []
    for d in (plain, fused):
        d.backend = fresh_cache(2, 3, 12, 1 if causal else 3, dtype=torch.float32, causal=causal)
        d.backend.randomize_(torch.Generator().manual_seed(4))
        out.append(d.propose(hidden.float(), last, 3, context_lens=ctx))
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-5, rtol=1e-5)
