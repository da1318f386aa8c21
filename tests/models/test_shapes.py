import pytest
import torch

from spectune.models.attention import DenseTorchAttention
from spectune.models.config import ModelArgs, ModelError, parse_drafter
from spectune.models.shapes import build_models, even_split


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


def test_limits_name_the_field(models):
    with pytest.raises(ModelError, match="max_batch=8"):
        models.target_step(batch=9, q=1)
    with pytest.raises(ModelError, match="max_q=8"):
        models.target_step(batch=1, q=9)
    with pytest.raises(ModelError, match="context_len"):
        models.drafter_step(batch=1, k=2, context_len=64)


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle-1l", "dflash-1l"])
def test_steps_replay_in_a_cuda_graph_like_eager(drafter):
    models = build_models(ModelArgs.from_name("tiny"), parse_drafter(drafter), device="cuda",
                          dtype=torch.float32, max_batch=4, max_q=4, context_len=64)
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
