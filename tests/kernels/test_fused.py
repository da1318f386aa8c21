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
    rms_norm,
    rms_norm_ref,
    silu_mul,
    silu_mul_ref,
)
from spectune.kernels.kv_cache import KernelInputError
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
    q, k, v = qk_norm_rope(
        dev(qkv),
        dev(cos),
        dev(sin),
        qw if qw is None else dev(qw),
        kw if kw is None else dev(kw),
        1e-6,
        h,
        hkv,
        d,
    )
    assert (
        q.is_contiguous() and k.is_contiguous() and q.shape == (t, h, d) and k.shape == (t, hkv, d)
    )
    close(q, q_ref, dtype)
    close(k, k_ref, dtype)
    assert torch.equal(v.cpu(), v_ref)


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
