import pytest
import torch

from spectune.kernels.attention import gather_dense_kv
from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.attention import DenseTorchAttention
from spectune.models.build import build_models, even_split
from spectune.models.config import ModelArgs, ModelError, parse_drafter
from spectune.models.paged import PagedTritonAttention


@pytest.fixture(scope="module")
def models():
    return build_models(ModelArgs.from_name("tiny"), parse_drafter("eagle-1l"), device="cpu",
                        dtype=torch.float32, max_batch=8, max_q=8, context_len=32)


def test_even_split():
    assert even_split(10, 3) == [4, 3, 3]
    assert even_split(4, 4) == [1, 1, 1, 1]


def test_target_step_shape_and_cache(models):
    step = models.target_step(batch=3, q=4)
    assert (step.tokens, step.batch) == (12, 3)
    logits = step.run()
    assert logits.shape == (12, models.args.vocab_size) and torch.isfinite(logits).all()
    backend = models.target.backend
    assert isinstance(backend, DenseTorchAttention)
    assert backend.shape_key == (3, 32, 4)  # sized exactly for the point
    assert backend.k_store.abs().sum() > 0  # cached context is random, not zeros


def test_refresh_rewrites_inputs_in_place(models):
    step = models.target_step(batch=2, q=2)
    first = step.run().clone()
    step.refresh()
    assert not torch.equal(step.run(), first)


def test_tier_step_pads_after_real_rows(models):
    step = models.tier_step(tier=16, batch=3)
    assert (step.tokens, step.batch) == (16, 3)
    assert models.target.backend.max_q == 6  # 16 over 3 requests: 6, 5, 5
    step = models.tier_step(tier=16, batch=2, q_lens=[1, 5])
    logits = step.run()
    assert logits.shape == (16, models.args.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ModelError, match="tier"):
        models.tier_step(tier=4, batch=2, q_lens=[3, 3])
    with pytest.raises(ModelError, match="exceeds tier"):
        models.tier_step(tier=2, batch=3)


def test_new_point_releases_previous_cache(models):
    old = models.target_step(batch=2, q=1)
    old_backend = models.target.backend
    new = models.target_step(batch=4, q=1)
    assert old_backend.released and old_backend.k_store.numel() == 0
    assert new.run().shape[0] == 4
    with pytest.raises(RuntimeError, match="released"):
        old.run()


@pytest.mark.parametrize("drafter", ["eagle-2l", "dflash-1l"])
def test_drafter_step(drafter):
    models = build_models(ModelArgs.from_name("tiny"), parse_drafter(drafter), device="cpu",
                          dtype=torch.bfloat16, max_batch=4, max_q=8, context_len=16)
    step = models.drafter_step(batch=3, k=5)
    assert (step.tokens, step.batch) == (15, 3)
    ids, conf = step.run()
    assert ids.shape == conf.shape == (3, 5)
    assert models.drafter.kind == parse_drafter(drafter).kind
    assert models.drafter.embed_weight is models.target.embed


def test_auto_attention_is_the_dense_torch_path_on_cpu(models):
    assert (models.attention, models.attention_name) == ("torch", "torch_folded")
    with pytest.raises(ModelError, match="attention must be"):
        build_models(ModelArgs.from_name("tiny"), parse_drafter("eagle-1l"), device="cpu",
                     dtype=torch.float32, max_batch=2, max_q=2, context_len=8, attention="flash")


@pytest.fixture(scope="module")
def paged_models():
    return build_models(ModelArgs.from_name("tiny"), parse_drafter("dflash-1l"), device="cpu",
                        dtype=torch.float32, max_batch=4, max_q=4, context_len=24, attention="triton")


def test_paged_target_matches_the_dense_backend_on_the_same_cache(paged_models):
    # the Triton paged backend (CPU interpreter) and the folded torch backend, same cached context
    models = paged_models
    assert models.attention_name == "triton_paged"
    step = models.target_step(batch=2, q=3)
    paged = models.target.backend
    assert isinstance(paged, PagedTritonAttention) and paged.shape_key == (2, 24, 3)
    args = models.args
    dense = DenseTorchAttention(args.n_layers, 2, 24, 3, args.n_kv_heads, args.head_dim)
    for layer in range(args.n_layers):
        k_ctx, v_ctx = gather_dense_kv(*paged.kv(layer), paged.block_tables)  # [B, Hkv, L, D]
        k_d, v_d = dense.cache(layer)  # [B, slots, Hkv, D]
        k_d[:, :24] = k_ctx.transpose(1, 2)[:, :24]
        v_d[:, :24] = v_ctx.transpose(1, 2)[:, :24]
    ids = torch.randint(1, args.vocab_size, (6,), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([24, 25, 26, 24, 25, 26])
    meta = paged.meta_for(paged.block_tables, [3, 3], [24, 24], num_tokens=6)
    got = models.target(ids, positions, meta)
    models.target.backend = dense
    want = models.target(ids, positions, AttnMeta.from_lens([3, 3], [24, 24]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(step.run()).all()  # the step puts its own backend back


def test_paged_steps_reuse_static_buffers_and_release_old_caches(paged_models):
    models = paged_models
    step = models.tier_step(tier=8, batch=3)
    backend = models.target.backend
    tables = backend.block_tables
    assert step.run().shape == (8, models.args.vocab_size)
    assert models.target.backend is backend and backend.block_tables is tables  # nothing rebuilt
    drafts = models.drafter_step(batch=2, k=3)
    ids, conf = drafts.run()
    assert ids.shape == conf.shape == (2, 3)
    assert isinstance(models.drafter.backend, PagedTritonAttention) and not models.drafter.backend.causal
    models.target_step(batch=1, q=2)  # a new point replaces the target cache
    assert backend.released and backend.nbytes() == 0
    with pytest.raises(RuntimeError, match="released"):
        step.run()


def test_limits_name_the_field(models):
    with pytest.raises(ModelError, match="max_batch=8"):
        models.target_step(batch=9, q=1)
    with pytest.raises(ModelError, match="max_q=8"):
        models.target_step(batch=1, q=9)
    with pytest.raises(ModelError, match="context_len"):
        models.drafter_step(batch=1, k=2, context_len=64)


@pytest.mark.gpu
def test_auto_attention_on_cuda_is_triton_paged():
    models = build_models(ModelArgs.from_name("tiny"), parse_drafter("eagle-1l"), device="cuda",
                          dtype=torch.bfloat16, max_batch=2, max_q=2, context_len=32)
    assert models.attention_name == "triton_paged"
    models.target_step(batch=2, q=2).run()
    assert isinstance(models.target.backend, PagedTritonAttention)


@pytest.mark.gpu
@pytest.mark.parametrize("attention,dtype", [("triton", torch.float32), ("triton", torch.bfloat16),
                                             ("torch", torch.float32)])
@pytest.mark.parametrize("drafter", ["eagle-1l", "dflash-1l"])
def test_steps_replay_in_a_cuda_graph_like_eager(drafter, attention, dtype):
    # the paged steps' metadata (offsets, block tables, slots) are static buffers: a replay of
    # the captured forward gives the eager logits
    models = build_models(ModelArgs.from_name("tiny"), parse_drafter(drafter), device="cuda",
                          dtype=dtype, max_batch=4, max_q=4, context_len=64, attention=attention)
    for make in (lambda: models.target_step(batch=3, q=4), lambda: models.tier_step(tier=16, batch=3),
                 lambda: models.drafter_step(batch=3, k=4)):
        step = make()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step.run()
        step.refresh()
        eager = step.run()
        graph.replay()
        torch.cuda.synchronize()
        outs = captured if isinstance(captured, tuple) else (captured,)
        refs = eager if isinstance(eager, tuple) else (eager,)
        for got, want in zip(outs, refs, strict=True):
            torch.testing.assert_close(got, want)


def test_paged_drafter_serves_fewer_rows_than_allocated():
    # the bench's cost drafter is allocated for the largest batch and runs smaller steps
    from spectune.models.build import build_models, fit_paged_cache
    from spectune.models.config import parse_drafter, resolve_target

    args, spec = resolve_target("tiny"), parse_drafter("eagle-1l")
    models = build_models(args, spec, device=torch.device("cpu"), dtype=torch.float32, max_batch=4,
                          max_q=4, context_len=64, attention="triton")
    fit_paged_cache(models.drafter, spec.n_layers, batch=4, ctx_max=64, max_q=3, causal=True)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, args.dim, generator=gen)
    last = torch.randint(1, args.vocab_size, (4,), generator=gen)
    ctx = torch.full((4,), 40, dtype=torch.int32)
    full, _ = models.drafter.propose(hidden, last, 3, context_lens=ctx)
    for rows in (2, 1):
        ids, _ = models.drafter.propose(hidden[:rows], last[:rows], 3, context_lens=ctx[:rows])
        assert torch.equal(ids, full[:rows])


@pytest.mark.gpu
def test_fp8_target_on_cuda_runs_scaled_mm_in_a_graph_and_tracks_the_reference(monkeypatch):
    from spectune.kernels import fp8 as fp8_kernels

    models = build_models(ModelArgs.from_name("tiny"), parse_drafter("eagle-1l"), device="cuda",
                          dtype=torch.bfloat16, max_batch=4, max_q=4, context_len=64, fp8=True)
    wqkv = models.target.layers[0].attn.wqkv
    x = torch.randn(3, models.args.dim, device="cuda", dtype=torch.bfloat16)
    assert fp8_kernels.scaled_mm_ok(x, wqkv.qweight)  # tiny's widths are multiples of 16
    step = models.target_step(batch=3, q=4)
    step.run()  # warm-up (kernel compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step.run()
    step.refresh()
    graph.replay()
    eager = step.run()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    monkeypatch.setattr(fp8_kernels, "scaled_mm_ok", lambda *a: False)  # the float32 reference path
    ref = step.run()
    rel = float((eager.float() - ref.float()).norm() / ref.float().norm())
    assert rel < 0.02
