"""Fused decoder-layer kernels vs their torch references (the unfused decoder's maths), on fresh
random inputs at several shapes, bf16 and fp32; plus hand-computed cases and row independence."""

from __future__ import annotations

import math

import pytest
import torch

from spectune.kernels.fused import (
    add_rms_norm,
    add_rms_norm_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
    qk_norm_rope_write,
    qk_norm_rope_write_ref,
    rms_norm,
    rms_norm_ref,
    silu_mul,
    silu_mul_ref,
)
from spectune.kernels.kv_cache import PAD_SLOT, KernelInputError, write_kv_ref
from spectune.models.decoder import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: Triton's interpreter on CPU
TOKENS = [1, 7, 64, 300]
DTYPES = [torch.bfloat16, torch.float32]


def tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: a couple of ulps of 2^-8 relative (the kernels round where the references round, but
    # sum in another order); fp32: float32 summation-order noise
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


def rand(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def dev(x: torch.Tensor) -> torch.Tensor:
    return x.to(DEVICE)


def on_dev(*xs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(x if x is None else dev(x) for x in xs)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n", [128, 1000, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference(t, n, dtype):
    x = rand(t, n, seed=t * n, dtype=dtype)
    res = rand(t, n, seed=t * n + 1, dtype=dtype, scale=3.0)
    w = rand(n, seed=n, dtype=dtype).abs() + 0.5
    y_ref, h_ref = add_rms_norm_ref(x, res, w, 1e-6)
    xd, rd = dev(x), dev(res)
    y, h = add_rms_norm(xd, rd, dev(w), 1e-6)
    assert y.data_ptr() == xd.data_ptr() and h.data_ptr() == rd.data_ptr()  # in place
    close(y, y_ref, dtype)
    # the residual sum is one rounded add in both: exact
    assert torch.equal(h.cpu(), h_ref)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("n", [128, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(t, n, dtype):
    x = rand(t, n, seed=7 * t + n, dtype=dtype, scale=5.0)
    w = rand(n, seed=n + 3, dtype=dtype)
    close(rms_norm(dev(x), dev(w), 1e-5), rms_norm_ref(x, w, 1e-5), dtype)


def test_rms_norm_hand_computed():
    # row [3, 4]: mean square 12.5, eps 0 -> [3, 4] / sqrt(12.5) * [1, 2]
    x = torch.tensor([[3.0, 4.0]]).repeat(1, 8)  # 16 columns, same mean square
    w = torch.tensor([1.0, 2.0]).repeat(8)
    want = torch.tensor([3.0, 8.0]).repeat(8) / math.sqrt(12.5)
    torch.testing.assert_close(rms_norm(dev(x), dev(w), 0.0).cpu()[0], want)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("inter", [256, 1000, 3072])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(t, inter, dtype):
    gu = rand(t, 2 * inter, seed=t + inter, dtype=dtype, scale=2.0)
    close(silu_mul(dev(gu)), silu_mul_ref(gu), dtype)


def test_silu_mul_hand_computed():
    gate = torch.tensor([0.0, 1.0, -2.0, 10.0] * 4)
    up = torch.tensor([5.0, 2.0, 1.0, 0.5] * 4)
    want = gate / (1 + torch.exp(-gate)) * up
    got = silu_mul(dev(torch.cat([gate, up])[None])).cpu()[0]
    torch.testing.assert_close(got, want)


def rope_for(
    t: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(seed))
    return Rotary(head_dim, 1e6)(positions, dtype)  # [T, 1, D] each


# (H, Hkv, D): the tiny preset, qwen3-8b / llama-3.1-8b, a head dim that is not a power of two
HEADS = [(4, 2, 32), (32, 8, 128), (6, 2, 80)]


# (T, heads): every T on the tiny preset's heads, short steps on the wide ones (the interpreter
# runs one program per (token, head))
QK_CASES = [
    *((t, HEADS[0]) for t in TOKENS),
    (1, HEADS[1]),
    (7, HEADS[1]),
    (7, HEADS[2]),
    (64, HEADS[2]),
]


@pytest.mark.parametrize("t, heads", QK_CASES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_matches_reference(t, heads, qk_norm, dtype):
    h, hkv, d = heads
    qkv = rand(t, (h + 2 * hkv) * d, seed=t * d + h, dtype=dtype, scale=2.0)
    qw = rand(d, seed=d, dtype=dtype) if qk_norm else None
    kw = rand(d, seed=d + 1, dtype=dtype) if qk_norm else None
    cos, sin = rope_for(t, d, dtype, seed=t)
    q_ref, k_ref, v_ref = qk_norm_rope_ref(qkv, cos, sin, qw, kw, 1e-6, h, hkv, d)
    q, k, v = qk_norm_rope(*on_dev(qkv, cos, sin, qw, kw), 1e-6, h, hkv, d)
    assert (
        q.is_contiguous() and k.is_contiguous() and q.shape == (t, h, d) and k.shape == (t, hkv, d)
    )
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)
    assert torch.equal(v.cpu(), v_ref)


def paged_case(
    t: int, hkv: int, d: int, dtype: torch.dtype, seed: int, *, block_size: int = 4, pads: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches [num_blocks, block_size, Hkv, D] (never zeros) and slots [T]: distinct
    slots scattered over the pool, the last ``pads`` rows padding (PAD_SLOT)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-2 * t // block_size) + 1
    shape = (num_blocks, block_size, hkv, d)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[t - pads :] = PAD_SLOT
    return k_cache, v_cache, slots


# (T, heads, padding rows): the tiny preset, qwen3-8b / llama-3.1-8b (32q / 8kv heads of 128),
# an odd head layout; steps with and without padding rows
WRITE_CASES = [
    (1, HEADS[0], 0),
    (7, HEADS[0], 2),
    (64, HEADS[0], 5),
    (1, HEADS[1], 0),
    (5, HEADS[1], 1),
    (9, HEADS[2], 3),
]


@pytest.mark.parametrize("t, heads, pads", WRITE_CASES)
@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3 / Llama
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_qk_norm_rope_write_matches_reference(t, heads, pads, qk_norm, dtype, slot_dtype):
    h, hkv, d = heads
    qkv = rand(t, (h + 2 * hkv) * d, seed=3 * t + d, dtype=dtype, scale=2.0)
    qw = rand(d, seed=d + 5, dtype=dtype) if qk_norm else None
    kw = rand(d, seed=d + 6, dtype=dtype) if qk_norm else None
    cos, sin = rope_for(t, d, dtype, seed=t + 1)
    k_cache, v_cache, slots = paged_case(t, hkv, d, dtype, seed=t + h, pads=pads)
    slots = slots.to(slot_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = qk_norm_rope_write_ref(qkv, cos, sin, qw, kw, 1e-6, h, hkv, d, k_ref, v_ref, slots)
    kc, vc = dev(k_cache), dev(v_cache)
    q = qk_norm_rope_write(*on_dev(qkv, cos, sin, qw, kw), 1e-6, h, hkv, d, kc, vc, dev(slots))
    assert q.is_contiguous() and q.shape == (t, h, d)
    close(q, q_ref, dtype)
    close(kc, k_ref, dtype)
    assert torch.equal(vc.cpu(), v_ref)  # v is copied, not computed
    # slots no row names keep their old contents (padding rows write nowhere)
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    untouched = ~written.view(k_cache.shape[:2])
    assert torch.equal(kc.cpu()[untouched], k_cache[untouched])
    assert torch.equal(vc.cpu()[untouched], v_cache[untouched])
    # the cache is bit for bit what the separate kernel + cache write leave (decoder exactness)
    q_sep, k_sep, v_sep = qk_norm_rope(*on_dev(qkv, cos, sin, qw, kw), 1e-6, h, hkv, d)
    k_two, v_two = k_cache.clone(), v_cache.clone()
    write_kv_ref(k_sep.cpu(), v_sep.cpu(), k_two, v_two, slots.long())
    assert torch.equal(q.cpu(), q_sep.cpu())
    assert torch.equal(kc.cpu(), k_two) and torch.equal(vc.cpu(), v_two)


def test_qk_norm_rope_write_hand_computed():
    # one token, H = Hkv = 1, D = 32, a quarter turn, no norm: k -> [-y2, y1] at slot 6 of
    # blocks of 4 (block 1, offset 2); v copied there; every other slot untouched
    d = 32
    qkv = torch.arange(3 * d, dtype=torch.float32)[None] + 1.0
    angle = torch.full((1, 1, d), math.pi / 2)
    k_cache, v_cache = torch.full((3, 4, 1, d), -7.0), torch.full((3, 4, 1, d), -7.0)
    kc, vc = dev(k_cache), dev(v_cache)
    slots = dev(torch.tensor([6]))
    q = qk_norm_rope_write(
        dev(qkv), dev(angle.cos()), dev(angle.sin()), None, None, 1e-6, 1, 1, d, kc, vc, slots
    )
    x1, x2 = qkv[0, :d].chunk(2)
    y1, y2 = qkv[0, d : 2 * d].chunk(2)
    torch.testing.assert_close(q.cpu()[0, 0], torch.cat([-x2, x1]), atol=1e-5, rtol=0)
    torch.testing.assert_close(kc.cpu()[1, 2, 0], torch.cat([-y2, y1]), atol=1e-5, rtol=0)
    assert torch.equal(vc.cpu()[1, 2, 0], qkv[0, 2 * d :])
    rest = torch.ones(3, 4, dtype=torch.bool)
    rest[1, 2] = False
    assert (kc.cpu()[rest] == -7.0).all() and (vc.cpu()[rest] == -7.0).all()
    # the same token as padding: nothing written, q still computed
    k2, v2 = dev(k_cache.clone()), dev(v_cache.clone())
    pad = dev(torch.tensor([PAD_SLOT]))
    q2 = qk_norm_rope_write(*on_dev(qkv, angle.cos(), angle.sin()), None, None, 1e-6, 1, 1, d, k2, v2, pad)
    assert torch.equal(q2.cpu(), q.cpu())
    assert torch.equal(k2.cpu(), k_cache) and torch.equal(v2.cpu(), v_cache)


def test_rope_hand_computed():
    # position 0: cos 1, sin 0 -> identity; one head of D = 32, every angle a quarter turn
    d = 32
    qkv = torch.arange(3 * d, dtype=torch.float32)[None]  # H = Hkv = 1
    angle = torch.full((1, 1, d), math.pi / 2)
    q, k, _ = qk_norm_rope(dev(qkv), dev(angle.cos()), dev(angle.sin()), None, None, 1e-6, 1, 1, d)
    x1, x2 = qkv[0, :d].chunk(2)
    # a quarter turn: [x1, x2] -> [-x2, x1]
    torch.testing.assert_close(q.cpu()[0, 0], torch.cat([-x2, x1]), atol=1e-5, rtol=0)
    y1, y2 = qkv[0, d : 2 * d].chunk(2)
    torch.testing.assert_close(k.cpu()[0, 0], torch.cat([-y2, y1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_other_rows(dtype):
    # a token's output is the same whether it is alone in the step or one of 64 (greedy exactness)
    n, inter, (h, hkv, d) = 256, 512, HEADS[0]
    x, res = rand(64, n, seed=1, dtype=dtype), rand(64, n, seed=2, dtype=dtype)
    w = rand(n, seed=3, dtype=dtype)
    y_all, _ = add_rms_norm(dev(x.clone()), dev(res.clone()), dev(w), 1e-6)
    y_one, _ = add_rms_norm(dev(x[5:6].clone()), dev(res[5:6].clone()), dev(w), 1e-6)
    assert torch.equal(y_all[5:6].cpu(), y_one.cpu())
    gu = rand(64, 2 * inter, seed=4, dtype=dtype)
    assert torch.equal(silu_mul(dev(gu))[9:10].cpu(), silu_mul(dev(gu[9:10].clone())).cpu())
    qkv = rand(64, (h + 2 * hkv) * d, seed=5, dtype=dtype)
    cos, sin = rope_for(64, d, dtype, seed=6)
    qw, kw = rand(d, seed=7, dtype=dtype), rand(d, seed=8, dtype=dtype)
    q_all, k_all, _ = qk_norm_rope(dev(qkv), dev(cos), dev(sin), dev(qw), dev(kw), 1e-6, h, hkv, d)
    q_one, k_one, _ = qk_norm_rope(
        dev(qkv[3:4].clone()),
        dev(cos[3:4].clone()),
        dev(sin[3:4].clone()),
        dev(qw),
        dev(kw),
        1e-6,
        h,
        hkv,
        d,
    )
    assert torch.equal(q_all[3:4].cpu(), q_one.cpu()) and torch.equal(k_all[3:4].cpu(), k_one.cpu())


def test_bad_inputs_name_the_argument():
    x = dev(torch.zeros(2, 16))
    with pytest.raises(KernelInputError, match="^x:"):
        rms_norm(dev(torch.zeros(2, 16, dtype=torch.float16)), dev(torch.ones(16)), 1e-6)
    with pytest.raises(KernelInputError, match="^weight:"):
        rms_norm(x, dev(torch.ones(8)), 1e-6)
    with pytest.raises(KernelInputError, match="^residual:"):
        add_rms_norm(x, dev(torch.zeros(3, 16)), dev(torch.ones(16)), 1e-6)
    with pytest.raises(KernelInputError, match="^gu:"):
        silu_mul(dev(torch.zeros(2, 15)))
    with pytest.raises(KernelInputError, match="^qkv:"):
        qk_norm_rope(
            dev(torch.zeros(2, 100)),
            dev(torch.ones(2, 1, 32)),
            dev(torch.ones(2, 1, 32)),
            None,
            None,
            1e-6,
            1,
            1,
            32,
        )
    qkv, cs = dev(torch.zeros(2, 96)), dev(torch.ones(2, 1, 32))
    cache = dev(torch.zeros(2, 4, 1, 32))
    slots = dev(torch.tensor([0, 1]))
    with pytest.raises(KernelInputError, match="^k_cache:"):
        qk_norm_rope_write(qkv, cs, cs, None, None, 1e-6, 1, 1, 32, cache.bfloat16(), cache.bfloat16(), slots)
    with pytest.raises(KernelInputError, match="^k_cache:"):
        qk_norm_rope_write(qkv, cs, cs, None, None, 1e-6, 1, 1, 32, cache[..., :16], cache[..., :16], slots)
    with pytest.raises(KernelInputError, match="^v_cache:"):
        qk_norm_rope_write(qkv, cs, cs, None, None, 1e-6, 1, 1, 32, cache, cache[:1], slots)
    with pytest.raises(KernelInputError, match="^slot_mapping:"):
        qk_norm_rope_write(qkv, cs, cs, None, None, 1e-6, 1, 1, 32, cache, cache.clone(), slots[:1])
    with pytest.raises(KernelInputError, match="^slot_mapping:"):
        qk_norm_rope_write(qkv, cs, cs, None, None, 1e-6, 1, 1, 32, cache, cache.clone(), slots.float())
