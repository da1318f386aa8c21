"""Small-M linear: the kernel vs its torch reference on fresh random inputs (Triton's interpreter on
CPU), with and without split-K; the heuristic's configs; ``small_m_linear``'s fallback to F.linear.
The one-row streaming GEMV (``gemv_row``) the same way: vs the reference, its inputs, its configs."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from spectune.kernels.attention_configs import ConfigTableError
from spectune.kernels.gemv import (
    LT_ROWS,
    MAX_M,
    TABLE_ENV,
    GemvConfig,
    GemvRowConfig,
    candidate_configs,
    config_for,
    gemv_row,
    heuristic_config,
    launch_splits,
    row_candidate_configs,
    row_heuristic_config,
    rows_linear,
    small_m_linear,
    small_m_matmul,
    small_m_matmul_ref,
    small_m_ok,
    table_for_device,
    table_from_dict,
    table_to_json,
)
from spectune.kernels.kv_cache import KernelInputError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: Triton's interpreter on CPU


def rand(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def run(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig | None) -> torch.Tensor:
    return small_m_matmul(x.to(DEVICE), w.to(DEVICE), cfg).cpu()


def assert_near_reference(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within the rounding of the fp32 sums' order, then one cast: |got - exact| <= one ulp of the
    output dtype at the value plus a float32 accumulation bound."""
    exact = x.double() @ w.double().t()  # [M, N]
    ref = small_m_matmul_ref(x, w)
    assert got.dtype == ref.dtype == x.dtype and got.shape == ref.shape
    eps = torch.finfo(x.dtype).eps
    acc_bound = x.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())
    err = (got.double() - exact).abs()
    assert (err <= eps * exact.abs() + acc_bound + 1e-30).all(), float((err - eps * exact.abs()).max())
    # and against the reference itself: equal but for a last-bit cast difference
    assert ((got.double() - ref.double()).abs() <= eps * exact.abs() + acc_bound + 1e-30).all()


SHAPES = [(64, 128), (96, 256), (128, 320), (80, 200)]  # (N, K); 320, 200: K not a multiple of BLOCK_K
CONFIGS = {
    "one_split": GemvConfig(block_n=32, block_k=64, split_k=1),
    "split_3": GemvConfig(block_n=64, block_k=32, split_k=3),
    "split_4_wide_k": GemvConfig(block_n=16, block_k=128, split_k=4),
}


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference(m, n, k, cfg, dtype):
    x = rand(m, k, seed=m * 1000 + n + k, dtype=dtype)  # [M, K]
    w = rand(n, k, seed=n * k, dtype=dtype) / k**0.5  # [N, K]
    assert_near_reference(run(x, w, CONFIGS[cfg]), x, w)


@pytest.mark.parametrize("m, n, k", [(2, 64, 128), (5, 96, 320)])
def test_fp16_and_the_default_config(m, n, k):
    x = rand(m, k, seed=7, dtype=torch.float16)
    w = rand(n, k, seed=8, dtype=torch.float16) / k**0.5
    assert_near_reference(run(x, w, None), x, w)


def test_split_k_is_deterministic_and_close_to_unsplit():
    x = rand(4, 320, seed=1, dtype=torch.float32)
    w = rand(96, 320, seed=2, dtype=torch.float32)
    one = run(x, w, GemvConfig(block_n=32, block_k=32, split_k=1))
    split = run(x, w, GemvConfig(block_n=32, block_k=32, split_k=5))
    assert torch.equal(split, run(x, w, GemvConfig(block_n=32, block_k=32, split_k=5)))
    torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5)


def test_strided_rows_of_x():
    base = rand(3, 400, seed=3, dtype=torch.bfloat16)
    x = base[:, 40:360]  # [3, 320], row stride 400
    w = rand(64, 320, seed=4, dtype=torch.bfloat16) / 320**0.5
    assert_near_reference(run(x, w, GemvConfig(block_n=32, block_k=64, split_k=2)), x.contiguous(), w)


@pytest.mark.parametrize("k, block_k, split_k, want", [
    (4096, 256, 8, (8, 512)),
    (12288, 256, 9, (8, 1536)),  # 48 chunks over 9 splits: 6 each, 8 splits
    (320, 64, 3, (3, 128)),  # 5 chunks: 2, 2, 1
    (100, 64, 4, (2, 64)),  # only 2 chunks
    (64, 64, 1, (1, 64)),
])
def test_launch_splits(k, block_k, split_k, want):
    splits, chunk = launch_splits(k, block_k, split_k)
    assert (splits, chunk) == want
    assert (splits - 1) * chunk < k <= splits * chunk  # every split non-empty, K covered


@pytest.mark.parametrize("n, k, splits", [
    (4096, 4096, 8), (6144, 4096, 6), (4096, 12288, 8), (24576, 4096, 2), (151936, 4096, 1),
    (64, 128, 1),
])
def test_heuristic_fills_the_gpu(n, k, splits):
    cfg = heuristic_config(n, k, 132)
    assert cfg.split_k == splits
    assert launch_splits(k, cfg.block_k, cfg.split_k)[0] == cfg.split_k


def test_config_validation_names_the_field():
    with pytest.raises(KernelInputError, match="block_n"):
        GemvConfig(block_n=48)
    with pytest.raises(KernelInputError, match="split_k"):
        GemvConfig(split_k=0)


def test_small_m_linear_runs_the_one_row_kernel_and_falls_back_to_f_linear():
    # one row: the one-row kernel; 2..16 rows: F.linear (the small-M kernel loses to cuBLAS there)
    w = rand(96, 256, seed=5, dtype=torch.bfloat16).to(DEVICE) / 16
    x = rand(2, 3, 256, seed=6, dtype=torch.bfloat16).to(DEVICE)  # [..., K], 6 rows
    assert small_m_ok(x, w)
    y = small_m_linear(x, w)
    assert y.shape == (2, 3, 96) and torch.equal(y, F.linear(x, w))
    one = x[:1, :1]  # [1, 1, K]
    y1 = small_m_linear(one, w)
    assert y1.shape == (1, 1, 96) and torch.equal(y1.reshape(1, 96), gemv_row(one.reshape(1, 256), w))
    torch.testing.assert_close(y1.float(), F.linear(one, w).float(), atol=2e-2, rtol=2e-2)
    big = rand(MAX_M + 1, 256, seed=7, dtype=torch.bfloat16).to(DEVICE)  # M > 16
    fp32 = x.float()
    for a, b in ((big, w), (fp32, w.float()), (x[:, :0].reshape(0, 256), w)):
        assert not small_m_ok(a, b)
        assert torch.equal(small_m_linear(a, b), F.linear(a, b))


@pytest.mark.parametrize("rows", [1, 6, 17, 32, 64, 65])
def test_rows_linear_is_small_m_linear_off_cuda_and_f_linear_on_its_rows(rows):
    # cuBLASLt needs CUDA: elsewhere rows_linear is small_m_linear at every row count; on CUDA its
    # 17..64 rows are F.linear under cuBLASLt (another kernel: close to cuBLAS's, not bit-equal)
    w = rand(80, 128, seed=rows, dtype=torch.bfloat16).to(DEVICE) / 16
    x = rand(rows, 128, seed=rows + 1, dtype=torch.bfloat16).to(DEVICE)
    before = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    y = rows_linear(x, w)
    assert y.shape == (rows, 80)
    if x.is_cuda and rows in LT_ROWS:
        torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)
        assert torch.backends.cuda.preferred_blas_library() == before  # restored
    else:
        assert torch.equal(y, small_m_linear(x, w))
    assert 17 in LT_ROWS and 64 in LT_ROWS and 16 not in LT_ROWS and 65 not in LT_ROWS


def test_bad_inputs_name_the_field():
    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="x"):
        small_m_matmul(torch.zeros(17, 128, dtype=torch.bfloat16), w)
    with pytest.raises(KernelInputError, match="w"):
        small_m_matmul(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(KernelInputError, match="w"):
        small_m_matmul(torch.zeros(2, 128, dtype=torch.float16), w)


def test_candidates_start_with_the_heuristic_and_run_as_launched():
    cands = candidate_configs(4096, 4096, 132)
    assert cands[0] == heuristic_config(4096, 4096, 132)
    assert len(set(cands)) == len(cands) > 20
    for c in cands:
        assert launch_splits(4096, c.block_k, c.split_k)[0] == c.split_k
    assert {c.block_n for c in cands} == {32, 64, 128} and {c.split_k for c in cands} >= {4, 8, 16}
    assert max(c.block_k for c in candidate_configs(64, 100, 132)) == 128  # at most K's power of 2


def test_table_round_trip_and_override(tmp_path, monkeypatch):
    entries = {(4096, 4096): GemvConfig(32, 128, 4, 8, 4), (96, 256): GemvConfig(16, 64, 2)}
    path = tmp_path / "t.json"
    path.write_text(table_to_json("NVIDIA H200", 132, "test", entries))
    assert table_from_dict(json.loads(path.read_text()), "t") == entries
    monkeypatch.setenv(TABLE_ENV, str(path))
    config_for.cache_clear()
    try:
        assert config_for("NVIDIA H200", 132, 4096, 4096) == entries[(4096, 4096)]
        assert config_for("NVIDIA H200", 132, 6144, 4096) == heuristic_config(6144, 4096, 132)  # not in it
        # the table's config runs and gives the reference's result
        x = rand(3, 256, seed=9, dtype=torch.bfloat16)
        w = rand(96, 256, seed=10, dtype=torch.bfloat16) / 16
        assert_near_reference(run(x, w, config_for("NVIDIA H200", 132, 96, 256)), x, w)
    finally:
        config_for.cache_clear()
    monkeypatch.delenv(TABLE_ENV)
    assert table_for_device("No Such GPU") == {}


@pytest.mark.parametrize("change, field", [
    ({"format": "x"}, "format"),
    ({"extra": 1}, "extra"),
    ({"sm_count": 0}, "sm_count"),
    ({"configs": []}, "configs"),
    ({"configs": [{"n": 64, "k": 128, "block_n": 48}]}, "configs[0]"),
    ({"configs": [{"n": 0, "k": 128}]}, "configs[0].n"),
    ({"configs": [{"n": 64, "k": 128, "splits": 2}]}, "configs[0].splits"),
])
def test_bad_table_names_the_field(change, field):
    good = json.loads(table_to_json("NVIDIA H200", 132, "", {(64, 128): GemvConfig()}))
    with pytest.raises(ConfigTableError, match=re.escape(f"t.json: {field}")):
        table_from_dict({**good, **change}, "t.json")


# ---------------------------------------------------------------------------------------------
# gemv_row: one row


ROW_SHAPES = [(64, 128), (100, 200), (257, 1000), (1024, 4096)]  # (N, K); tails in N and in K
ROW_CONFIGS = {
    "heuristic": None,  # row_heuristic_config(N, K, 132), as on an H200
    "narrow_many_k_steps": GemvRowConfig(block_n=4, block_k=128, num_warps=4, num_stages=2),
    "wide_8_warps": GemvRowConfig(block_n=32, block_k=256, num_warps=8, num_stages=4),
}


def run_row(x: torch.Tensor, w: torch.Tensor, cfg: GemvRowConfig | None) -> torch.Tensor:
    return gemv_row(x.to(DEVICE), w.to(DEVICE), cfg).cpu()


@pytest.mark.parametrize("n, k", ROW_SHAPES)
@pytest.mark.parametrize("cfg", list(ROW_CONFIGS), ids=list(ROW_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_row_matches_reference(n, k, cfg, dtype):
    x = rand(1, k, seed=n + k, dtype=dtype)  # [1, K]
    w = rand(n, k, seed=n * k + 1, dtype=dtype) / k**0.5  # [N, K]
    got = run_row(x, w, ROW_CONFIGS[cfg] or row_heuristic_config(n, k, 132))
    assert got.shape == (1, n)
    assert_near_reference(got, x, w)
    ref = (x.float() @ w.float().t()).to(dtype)
    assert float((got.float() - ref.float()).abs().max() / ref.float().abs().max()) < 1e-2


def test_gemv_row_default_config_fp16_and_determinism():
    x = rand(1, 320, seed=11, dtype=torch.float16)
    w = rand(96, 320, seed=12, dtype=torch.float16) / 320**0.5
    got = run_row(x, w, None)  # row_default_config: the heuristic for this device's SMs
    assert_near_reference(got, x, w)
    assert torch.equal(got, run_row(x, w, None))
    # the same sums as small_m_matmul's one-row result, but for their order
    torch.testing.assert_close(got, run(x, w, GemvConfig(block_n=32, block_k=64)), rtol=2e-3, atol=2e-3)


def test_gemv_row_bad_inputs_name_the_field():
    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="^x: must be \\[1, K\\]"):
        gemv_row(torch.zeros(2, 128, dtype=torch.bfloat16), w)  # two rows
    with pytest.raises(KernelInputError, match="^x: "):
        gemv_row(torch.zeros(128, dtype=torch.bfloat16), w)  # 1-D
    with pytest.raises(KernelInputError, match="^w: K 128 != x's K 64"):
        gemv_row(torch.zeros(1, 64, dtype=torch.bfloat16), w)
    with pytest.raises(KernelInputError, match="^w: dtype"):
        gemv_row(torch.zeros(1, 128, dtype=torch.float16), w)
    with pytest.raises(KernelInputError, match="^x: must be bf16"):
        gemv_row(torch.zeros(1, 128, dtype=torch.float64), w.double())
    with pytest.raises(KernelInputError, match="^w: needs a contiguous last dim"):
        gemv_row(torch.zeros(1, 64, dtype=torch.bfloat16), w.t())


def test_gemv_row_config_validation_names_the_field():
    with pytest.raises(KernelInputError, match="block_n"):
        GemvRowConfig(block_n=12, block_k=256)
    with pytest.raises(KernelInputError, match="block_k"):
        GemvRowConfig(block_n=8, block_k=8)
    with pytest.raises(KernelInputError, match="num_warps"):
        GemvRowConfig(block_n=8, block_k=256, num_warps=3)
    with pytest.raises(KernelInputError, match="num_stages"):
        GemvRowConfig(block_n=8, block_k=256, num_stages=0)


@pytest.mark.parametrize("n, k, block_n, block_k", [
    (4096, 4096, 8, 512), (6144, 4096, 8, 512), (4096, 12288, 8, 512), (24576, 4096, 32, 256),
    (151936, 4096, 32, 256), (64, 100, 8, 128),
])
def test_row_heuristic_fills_the_gpu(n, k, block_n, block_k):
    cfg = row_heuristic_config(n, k, 132)
    assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (block_n, block_k, 4, 3)
    assert -(-n // cfg.block_n) >= 512 or cfg.block_n == 8  # about 4 programs per SM, or the narrowest


@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288),
                                  (151936, 4096), (64, 100), (100, 200)])
def test_row_candidates_start_with_the_heuristic(n, k):
    cands = row_candidate_configs(n, k, 132)
    assert cands[0] == row_heuristic_config(n, k, 132)
    assert len(set(cands)) == len(cands)
    k_pow2 = 1 << (k - 1).bit_length()
    assert all(c.block_k <= max(16, k_pow2) for c in cands)
    if k >= 1024:
        assert 20 <= len(cands) <= 30
        assert {c.block_n for c in cands} == {4, 8, 16, 32} and {c.block_k for c in cands} == {256, 512, 1024}
        assert {c.num_warps for c in cands} == {4, 8} and {c.num_stages for c in cands} == {2, 3, 4}
