"""FP8 linear maths: the row-quantisation kernel vs its torch reference (bit for bit), the reference
vs independent truths (the e4m3 value grid, float64 sums, torch's own ``_scaled_mm``), and on CUDA
the ``_scaled_mm`` path vs the reference."""

from __future__ import annotations

import pytest
import torch

from spectune.kernels.fp8 import (
    FP8,
    FP8_MAX,
    MIN_AMAX,
    fp8_linear,
    fp8_linear_ref,
    quantize_rows,
    quantize_rows_ref,
    quantize_weight,
    scale_out,
    scale_out_ref,
)
from spectune.kernels.kv_cache import KernelInputError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: Triton's interpreter on CPU


def kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows on DEVICE, results back on the CPU."""
    q, s = quantize_rows(x.to(DEVICE))
    return q.cpu(), s.cpu()


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, sorted, as float64 (254 of them: +-0 counted once each)."""
    v = torch.arange(256, dtype=torch.uint8).view(FP8).double()
    return v[torch.isfinite(v)].sort().values


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def rand(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed rows with per-row magnitudes 1e-3..1e3, as activations are
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 3)
    return x.to(dtype)


@pytest.mark.parametrize("m, k", [(1, 16), (3, 100), (4, 256), (5, 4096), (2, 4097), (7, 9000), (33, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference_bit_for_bit(m, k, dtype):
    x = rand(m, k, seed=m * k, dtype=dtype)
    x[0, : min(3, k)] = 0
    if m > 2:
        x[2] = 0  # a zero row
    q, s = kernel(x)
    q_ref, s_ref = quantize_rows_ref(x)
    assert q.dtype == FP8 and q.shape == (m, k) and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    assert torch.equal(bits(q), bits(q_ref))
    if m > 2:
        assert float(s[2]) == pytest.approx(MIN_AMAX / FP8_MAX) and not bits(q[2]).any()


def test_kernel_rounds_every_e4m3_value_and_midpoint_as_torch():
    grid = e4m3_values().float()
    mids = (grid[1:] + grid[:-1]) / 2  # ties: to even
    x = torch.cat([grid, mids, torch.tensor([-0.0, FP8_MAX])])[None, :]  # max 448: the scale is 1
    q, s = kernel(x)
    q_ref, s_ref = quantize_rows_ref(x)
    assert float(s) == 1.0 and torch.equal(s, s_ref)
    assert torch.equal(bits(q), bits(q_ref))
    assert torch.equal(q[0, : grid.numel()].float(), grid)  # representable values are kept exactly


def test_kernel_reads_a_strided_input_and_writes_into_given_buffers():
    wide = rand(6, 200, seed=4).to(DEVICE)
    x = wide[:, 30:150]  # row stride 200, last dim contiguous
    out = (torch.empty(6, 120, dtype=FP8, device=DEVICE), torch.empty(6, 1, device=DEVICE))
    q, s = quantize_rows(x, out=out)
    assert q is out[0] and s is out[1]
    q_ref, s_ref = quantize_rows_ref(x.cpu())
    assert torch.equal(bits(q.cpu()), bits(q_ref)) and torch.equal(s.cpu(), s_ref)


@pytest.mark.parametrize("m, n", [(1, 16), (3, 1000), (7, 4097), (2, 24576)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_out_kernel_matches_reference_bit_for_bit(m, n, dtype):
    g = torch.Generator().manual_seed(m * n)
    acc = torch.randn(m, n, generator=g) * 1e5  # integer-product sums are large
    s_x = torch.rand(m, 1, generator=g) * 1e-2
    s_w = torch.rand(n, generator=g) * 1e-3
    got = scale_out(acc.to(DEVICE), s_x.to(DEVICE), s_w.to(DEVICE), dtype).cpu()
    want = scale_out_ref(acc, s_x, s_w, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_reference_is_nearest_e4m3_value_of_each_scaled_element():
    x = rand(9, 300, seed=7, dtype=torch.float32)
    q, s = quantize_rows_ref(x)
    scaled = x.double() / s.double()
    # independent: nearest value of the e4m3 grid by search (random inputs: no ties)
    grid = e4m3_values()
    idx = torch.searchsorted(grid, scaled.clamp(-FP8_MAX, FP8_MAX).contiguous()).clamp(
        1, grid.numel() - 1
    )
    lo, hi = grid[idx - 1], grid[idx]
    nearest = torch.where((scaled - lo).abs() <= (hi - scaled).abs(), lo, hi)
    assert torch.equal(q.double(), nearest)
    # each row's largest magnitude maps to +-448 exactly: the scale is amax / 448
    assert torch.equal(q.double().abs().amax(-1), torch.full((9,), FP8_MAX, dtype=torch.float64))
    assert torch.allclose(s[:, 0].double(), x.double().abs().amax(-1) / FP8_MAX, rtol=1e-7)


def test_one_rows_scale_ignores_the_other_rows():
    x = rand(4, 64, seed=11)
    q, s = quantize_rows_ref(x)
    big = x.clone()
    big[1:] *= 1000  # another request, or padding rows, with huge values
    q2, s2 = quantize_rows_ref(big)
    assert torch.equal(bits(q2[0]), bits(q[0])) and torch.equal(s2[0], s[0])


@pytest.mark.parametrize("m, k, n", [(1, 16, 16), (5, 64, 48), (33, 256, 96), (2, 48, 1000)])
def test_reference_linear_is_the_scaled_integer_product(m, k, n):
    x = rand(m, k, seed=m + k + n, dtype=torch.float32)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) / k**0.5
    q_w, s_w = quantize_weight(w)
    assert q_w.shape == (n, k) and s_w.shape == (n,)
    q_x, s_x = quantize_rows_ref(x)
    # float64 sums of the same e4m3 operands, scales applied after
    want = (q_x.double() @ q_w.double().t()) * s_x.double() * s_w.double()[None, :]
    got = fp8_linear_ref(x, q_w, s_w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # against the unquantised product: e4m3 keeps 3 mantissa bits on each operand
    exact = x.double() @ w.double().t()
    rel = float((got.double() - exact).norm() / exact.norm())
    assert rel < 0.06


@pytest.mark.parametrize("m, k, n", [(1, 16, 16), (7, 64, 32), (40, 128, 80)])
def test_reference_linear_matches_torch_scaled_mm_on_cpu(m, k, n):
    x = rand(m, k, seed=3 * m + n)
    q_w, s_w = quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(k)))
    q_x, s_x = quantize_rows_ref(x)
    try:
        theirs = torch._scaled_mm(
            q_x, q_w.t(), scale_a=s_x, scale_b=s_w.view(1, n), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch has no CPU row-wise _scaled_mm: {str(exc).splitlines()[0][:80]}")
    ours = fp8_linear_ref(x, q_w, s_w)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(
        ours.float(), theirs.float(), rtol=2**-7, atol=1e-3 * float(theirs.abs().max())
    )


def test_fp8_linear_keeps_leading_dims_and_names_bad_inputs():
    q_w, s_w = quantize_weight(torch.randn(32, 16))
    x = torch.randn(2, 3, 16)
    y = fp8_linear(x, q_w, s_w)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y, fp8_linear_ref(x.reshape(6, 16), q_w, s_w).view(2, 3, 32))
    with pytest.raises(KernelInputError, match="x"):
        fp8_linear(torch.randn(3, 8), q_w, s_w)
    with pytest.raises(KernelInputError, match="q_w"):
        fp8_linear(x, q_w.float(), s_w)
    with pytest.raises(KernelInputError, match="s_w"):
        fp8_linear(x, q_w, s_w[:4])
    with pytest.raises(KernelInputError, match="x"):
        quantize_rows(torch.randn(4, 8, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 128, 129, 1000])  # both sides of UNSCALED_MAX_M
@pytest.mark.parametrize("k, n", [(4096, 6144), (12288, 4096), (256, 151936)])
def test_scaled_mm_path_matches_reference_on_cuda(m, k, n):
    # the reference runs on the CPU: torch's CUDA division by a scalar multiplies by its reciprocal
    x = rand(m, k, seed=m, dtype=torch.bfloat16)
    q_w, s_w = quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(k)) / k**0.5)
    q, s = quantize_rows(x.cuda())
    q_ref, s_ref = quantize_rows_ref(x)
    assert torch.equal(bits(q.cpu()), bits(q_ref)) and torch.equal(s.cpu(), s_ref)
    got = fp8_linear(x.cuda(), q_w.cuda(), s_w.cuda()).cpu()
    want = fp8_linear_ref(x, q_w, s_w)
    torch.testing.assert_close(
        got.float(), want.float(), rtol=2**-7, atol=1e-3 * float(want.abs().max())
    )


@pytest.mark.gpu
def test_fp8_linear_replays_in_a_cuda_graph():
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    q_w, s_w = quantize_weight(torch.randn(256, 512, device="cuda"))
    fp8_linear(x, q_w, s_w)  # warm-up: compile the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, q_w, s_w)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, fp8_linear(x, q_w, s_w))
