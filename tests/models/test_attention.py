import pytest
import torch

from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.attention import DenseTorchAttention, reference_attention

H, HKV, D = 8, 2, 16


def make_case(q_lens, ctx_lens, pad, *, ctx_max=12, max_q=None, mode="folded", causal=True,
              dtype=torch.float64, seed=0):
    """Backend with random cached context, random packed q/k/v with `pad` padding rows."""
    g = torch.Generator().manual_seed(seed)
    max_q = max_q or max(q_lens)
    b = len(q_lens)
    meta = AttnMeta.from_lens(q_lens, ctx_lens, max_q=max_q)
    backend = DenseTorchAttention(2, b, ctx_max, max_q, HKV, D, dtype=dtype, mode=mode, causal=causal)
    backend.randomize_(g)
    k_ctx, v_ctx = (c.clone() for c in backend.cache(1))  # cached context of layer 1
    t = sum(q_lens) + pad
    q = torch.randn(t, H, D, generator=g, dtype=dtype)
    k = torch.randn(t, HKV, D, generator=g, dtype=dtype)
    v = torch.randn(t, HKV, D, generator=g, dtype=dtype)
    return backend, meta, (q, k, v), (k_ctx, v_ctx)


CASES = [
    ([1], [7], 0),  # batch 1, plain decode
    ([5], [0], 3),  # batch 1, no context, padding rows
    ([1, 3, 5], [12, 0, 4], 2),  # odd batch, mixed q incl. 1 and max, different contexts
    ([2, 2, 2, 2], [3, 3, 9, 1], 0),
    ([4, 1, 2, 1, 4], [1, 11, 6, 0, 2], 5),
]


@pytest.mark.parametrize("mode", ["folded", "sdpa_gqa"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lens, ctx_lens, pad", CASES)
def test_backend_matches_reference(mode, causal, q_lens, ctx_lens, pad):
    backend, meta, (q, k, v), (k_ctx, v_ctx) = make_case(q_lens, ctx_lens, pad, mode=mode, causal=causal)
    out = backend(1, q, k, v, meta)
    ref = reference_attention(q, k, v, meta, k_ctx, v_ctx, causal=causal)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    n = sum(q_lens)
    assert torch.all(out[n:] == 0)  # padding rows are inert


@pytest.mark.parametrize("mode", ["folded", "sdpa_gqa"])
def test_float32_close_to_float64_reference(mode):
    backend, meta, (q, k, v), (k_ctx, v_ctx) = make_case([3, 1, 4], [5, 12, 0], 4, mode=mode,
                                                         dtype=torch.float32, seed=3)
    out = backend(1, q, k, v, meta)
    ref = reference_attention(q.double(), k.double(), v.double(), meta, k_ctx.double(),
                              v_ctx.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_cache_writes_land_in_their_slots_and_padding_writes_nowhere():
    q_lens, ctx_lens = [2, 3, 1], [4, 0, 9]
    backend, meta, (q, k, v), _ = make_case(q_lens, ctx_lens, pad=4)
    before_k, before_v = (c.clone() for c in backend.cache(1))
    backend(1, q, k, v, meta)
    after_k, after_v = backend.cache(1)
    expect_k, expect_v = before_k.clone(), before_v.clone()
    row = 0
    for b, (n, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        expect_k[b, c:c + n] = k[row:row + n]
        expect_v[b, c:c + n] = v[row:row + n]
        row += n
    assert torch.equal(after_k, expect_k)
    assert torch.equal(after_v, expect_v)
    # the other layer is untouched
    assert torch.equal(backend.cache(0)[0], make_case(q_lens, ctx_lens, pad=4)[0].cache(0)[0])


def test_padding_values_do_not_change_real_rows():
    backend, meta, (q, k, v), _ = make_case([2, 3], [5, 1], pad=3)
    out = backend(1, q, k, v, meta)
    backend2, _, _, _ = make_case([2, 3], [5, 1], pad=3)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[5:], k2[5:], v2[5:] = 1e4, -1e4, float("nan")
    out2 = backend2(1, q2, k2, v2, meta)
    torch.testing.assert_close(out2[:5], out[:5], rtol=0, atol=0)
    assert torch.isfinite(out2).all()


def test_backend_serves_smaller_batch_than_built():
    backend, _, (q, k, v), (k_ctx, v_ctx) = make_case([1, 1, 1], [3, 3, 3], 0, ctx_max=8, max_q=4)
    meta = AttnMeta.from_lens([2], [6], max_q=4)
    out = backend(1, q[:3], k[:3], v[:3], meta)
    ref = reference_attention(q[:3], k[:3], v[:3], meta, k_ctx, v_ctx)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_released_cache_refuses_to_run():
    backend, meta, (q, k, v), _ = make_case([1], [2], 0)
    backend.release()
    assert backend.k_store.numel() == 0
    with pytest.raises(RuntimeError, match="released"):
        backend(0, q, k, v, meta)


def test_step_too_big_for_cache_is_refused():
    backend, _, (q, k, v), _ = make_case([1, 1], [2, 2], 0)
    with pytest.raises(ValueError, match="batch 3"):
        backend(0, q[:2], k[:2], v[:2], AttnMeta.from_lens([1, 1, 0], [1, 1, 1]))
