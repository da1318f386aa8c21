import dataclasses
import math

import pytest
import torch

from spectune.kernels.attention import (
    AttnConfig,
    choose_num_splits,
    plan_launch,
    verify_attention,
    verify_attention_folded,
    verify_attention_ref,
    verify_attention_sdpa_gqa,
)
from spectune.kernels.attention_metadata import AttnMeta
from spectune.kernels.kv_cache import KernelInputError, make_block_tables, slot_mapping_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
POISON = 1.0e4


def make_case(q_lens, ctx_lens, *, n_heads, n_kv_heads, head_dim, dtype=torch.float32, pad=0,
              seed=0, shuffle=True):
    """Random q [T, H, D], caches filled with random K/V (poison outside the requests' blocks),
    and an AttnMeta with shuffled block tables. T = sum(q_lens) + pad."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    meta = AttnMeta.from_lens(q_lens, ctx_lens, device=DEVICE)
    meta.block_tables = make_block_tables(seq_lens, BLOCK_SIZE, num_blocks, shuffle=shuffle,
                                          generator=gen, device=DEVICE)
    num_tokens = sum(q_lens) + pad
    meta.slot_mapping = slot_mapping_for(meta.block_tables, meta.context_lens, meta.cu_seqlens_q,
                                         num_tokens, BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn((num_tokens, n_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    return q, k_cache, v_cache, meta


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

CASES = [
    # (q_lens, ctx_lens, n_heads, n_kv_heads, head_dim, dtype, pad, num_splits)
    ([1], [37], 4, 4, 64, torch.float32, 0, 1),  # batch 1, decode, G = 1
    ([4], [0], 8, 2, 64, torch.float32, 2, 1),  # empty context, padding rows
    ([3, 1, 5], [17, 40, 5], 8, 2, 64, torch.float32, 3, 1),  # odd batch, mixed q, G = 4
    ([1, 1, 1, 1, 1], [20, 33, 0, 16, 9], 8, 1, 64, torch.float32, 0, 2),  # all-1, G = 8, split
    ([8, 8, 8], [31, 2, 50], 16, 2, 64, torch.float32, 1, 3),  # all-max, G = 8, split
    ([2, 6], [45, 19], 4, 4, 128, torch.float32, 2, 4),  # head_dim 128, split > tiles
    ([5, 1, 3], [23, 64, 0], 8, 2, 128, torch.float16, 1, 1),
    ([4, 2, 1], [30, 7, 48], 8, 2, 64, torch.bfloat16, 2, 2),
    ([16, 1, 9], [12, 33, 0], 8, 2, 64, torch.float32, 2, 2),  # K = 15: 64-row query tile
    ([16, 3], [21, 5], 8, 1, 128, torch.bfloat16, 1, 1),  # G = 8 x 16 tokens: 128 rows
    ([2, 0, 3], [10, 5, 20], 4, 2, 64, torch.float32, 1, 2),  # a request with no query this step
    ([3, 2], [40, 9], 4, 2, 48, torch.float32, 1, 1),  # head_dim not a power of 2: masked D
]


@pytest.mark.parametrize("q_lens,ctx_lens,n_heads,n_kv_heads,head_dim,dtype,pad,num_splits", CASES)
def test_kernel_matches_reference(q_lens, ctx_lens, n_heads, n_kv_heads, head_dim, dtype, pad, num_splits):
    q, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                          head_dim=head_dim, dtype=dtype, pad=pad)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = torch.full_like(q, POISON)
    verify_attention(q, k_cache, v_cache, meta, out=out, num_splits=num_splits)
    real = sum(q_lens)
    assert torch.isfinite(out.float()).all()
    assert (out[:real].float().abs() < POISON / 2).all(), "a real row was not written"
    assert (out[real:] == 0).all(), "padding rows must be zero"
    assert max_rel_err(out[:real], ref[:real]) < TOL[dtype]


def test_split_count_does_not_change_result():
    q, k_cache, v_cache, meta = make_case([3, 2], [70, 41], n_heads=4, n_kv_heads=2, head_dim=64)
    one = verify_attention(q, k_cache, v_cache, meta, num_splits=1)
    for splits in (2, 5):
        many = verify_attention(q, k_cache, v_cache, meta, num_splits=splits)
        assert max_rel_err(many, one) < 1e-5


def test_block_n_larger_than_block_size():
    q, k_cache, v_cache, meta = make_case([2, 3], [29, 51], n_heads=4, n_kv_heads=2, head_dim=64)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = verify_attention(q, k_cache, v_cache, meta, num_splits=2, config=AttnConfig(32, 1, 1))
    assert max_rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("block_m,num_splits,causal", [
    (16, 1, True),  # 32 / 64 rows cut into 16-row query tiles (several programs per kv head)
    (16, 3, True),
    (32, 2, False),
    (64, 1, True),  # 12 / 24 rows padded up to one 64-row tile
])
def test_query_tiles_match_reference(block_m, num_splits, causal):
    q_lens, ctx_lens = ([8, 1, 5], [33, 16, 0]) if block_m < 64 else ([3, 6], [40, 17])
    q, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, n_heads=8, n_kv_heads=2, head_dim=32, pad=3)
    cfg = AttnConfig(16, 1, 1, block_m=block_m)
    plan = plan_launch(q.device, num_heads=8, n_kv_heads=2, head_dim=32, batch=len(q_lens),
                       max_q=max(q_lens), max_kv_len=256, config=cfg, num_splits=num_splits)
    assert plan.block_m == block_m and plan.m_tiles == -(-4 * max(q_lens) // block_m)
    ref = verify_attention_ref(q, k_cache, v_cache, meta, causal=causal)
    out = torch.full_like(q, POISON)
    verify_attention(q, k_cache, v_cache, meta, out=out, num_splits=num_splits, config=cfg, causal=causal)
    real = sum(q_lens)
    assert max_rel_err(out[:real], ref[:real]) < 1e-4
    assert (out[real:] == 0).all()


@pytest.mark.parametrize("ctx", [31, 32, 33, 47, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_unmasked_tiles_end_exactly_at_the_context(ctx, num_splits):
    # the unmasked loop stops at the last whole tile below ctx + 1; the masked tail does the rest
    q_lens = [1, 4, 16]
    q, k_cache, v_cache, meta = make_case(q_lens, [ctx, ctx - 1, ctx + 1], n_heads=4, n_kv_heads=2,
                                          head_dim=32, pad=1)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = verify_attention(q, k_cache, v_cache, meta, num_splits=num_splits, config=AttnConfig(16, 1, 1))
    assert max_rel_err(out[:21], ref[:21]) < 1e-4


@pytest.mark.parametrize("q_lens,ctx_lens,heads,head_dim,splits,block_n,seed", [
    ([16, 16], [130, 97], (8, 2), 32, 1, 16, 11),  # 64-row tiles (q = 16, G = 4), many whole tiles
    ([16, 3, 9], [200, 64, 31], (8, 2), 32, 2, 32, 12),  # ragged, split KV, 32-key tiles
    ([1, 8], [90, 150], (4, 1), 64, 3, 16, 13),
    ([5], [0], (4, 2), 16, 1, 16, 14),  # no whole tile: the masked (exact) tail only
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_rescale_matches_reference(q_lens, ctx_lens, heads, head_dim, splits, block_n, seed, dtype):
    # the running max of whole tiles moves only past 2^LAZY_LOG2; softmax(QK^T)V is unchanged
    q, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, n_heads=heads[0], n_kv_heads=heads[1],
                                          head_dim=head_dim, dtype=dtype, pad=2, seed=seed)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    cfg = AttnConfig(block_n, 1, 1, lazy=1, max_regs=128)  # (the cap is a compiler option: no effect here)
    out = torch.full_like(q, POISON)
    verify_attention(q, k_cache, v_cache, meta, out=out, num_splits=splits, config=cfg)
    real = sum(q_lens)
    assert max_rel_err(out[:real], ref[:real]) < TOL[dtype]
    assert (out[real:] == 0).all()
    exact = verify_attention(q, k_cache, v_cache, meta, num_splits=splits, config=AttnConfig(block_n, 1, 1))
    assert max_rel_err(out[:real], exact[:real]) < TOL[dtype]


@pytest.mark.parametrize("boost", [0.0, 3.0, 30.0, 100.0])
def test_lazy_rescale_with_a_late_large_score(boost):
    # scores that climb late in the context: a small climb stays under 2^8 (stale max, p > 1),
    # a large one moves the max mid-loop (the rescale branch; past 2^128 a stale max would
    # overflow fp32), and each matches the reference
    q_lens, ctx_lens = [16, 4], [160, 120]
    q, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, n_heads=8, n_kv_heads=2, head_dim=32, seed=21)
    for b in range(len(ctx_lens)):  # keys 96..111 of each request point along its queries
        for pos in range(96, 112):
            blk, off = meta.block_tables[b, pos // BLOCK_SIZE].item(), pos % BLOCK_SIZE
            start = meta.cu_seqlens_q[b].item()
            k_cache[blk, off] += boost * q[start, ::4].float() / q[start, ::4].float().norm(dim=-1, keepdim=True)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = verify_attention(q, k_cache, v_cache, meta, num_splits=1, config=AttnConfig(16, 1, 1, lazy=1))
    assert max_rel_err(out[:20], ref[:20]) < 1e-4


def test_rows_beyond_one_tile():
    # 16 heads per kv head x 17 tokens = 272 rows: more than one 256-row tile
    q, k_cache, v_cache, meta = make_case([17, 2], [5, 20], n_heads=16, n_kv_heads=1, head_dim=16, pad=1)
    plan = plan_launch(q.device, num_heads=16, n_kv_heads=1, head_dim=16, batch=2, max_q=17,
                       max_kv_len=48, config=AttnConfig(16, 1, 1))
    assert (plan.block_m, plan.m_tiles) == (256, 2)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = verify_attention(q, k_cache, v_cache, meta, config=AttnConfig(16, 1, 1))
    assert max_rel_err(out[:19], ref[:19]) < 1e-4
    assert (out[19:] == 0).all()


def test_plan_launch_splits_from_config_are_clamped_to_the_cache():
    cpu = torch.device("cpu")
    kw = dict(num_heads=32, n_kv_heads=8, head_dim=128, batch=2, max_q=4)
    assert plan_launch(cpu, max_kv_len=4096, config=AttnConfig(num_splits=8), **kw).num_splits == 8
    assert plan_launch(cpu, max_kv_len=300, config=AttnConfig(num_splits=8), **kw).num_splits == 2
    assert plan_launch(cpu, max_kv_len=300, config=AttnConfig(num_splits=8), num_splits=5, **kw).num_splits == 5
    # a query tile smaller than one token's heads grows to hold them
    plan = plan_launch(cpu, max_kv_len=64, config=AttnConfig(block_m=16), **{**kw, "num_heads": 256})
    assert (plan.block_m, plan.m_tiles) == (32, 4)


def test_reference_matches_naive_single_request():
    # dense single request written out by hand: new token j sees positions < ctx + j + 1
    q, k_cache, v_cache, meta = make_case([3], [5], n_heads=2, n_kv_heads=1, head_dim=64, shuffle=False)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    k = k_cache.reshape(-1, 64)[:8]
    v = v_cache.reshape(-1, 64)[:8]
    for j in range(3):
        for h in range(2):
            s = (k[: 5 + j + 1] @ q[j, h]) / math.sqrt(64)
            expect = s.softmax(0) @ v[: 5 + j + 1]
            assert torch.allclose(ref[j, h], expect, atol=1e-5)


@pytest.mark.parametrize("path", [verify_attention_sdpa_gqa, verify_attention_folded])
@pytest.mark.parametrize("q_lens,ctx_lens,n_heads,n_kv_heads", [
    ([1], [33], 4, 4),
    ([3, 1, 5], [17, 40, 0], 8, 2),
    ([4, 4, 4, 4, 4], [9, 0, 31, 16, 2], 8, 1),
])
def test_torch_paths_match_reference(path, q_lens, ctx_lens, n_heads, n_kv_heads):
    q, k_cache, v_cache, meta = make_case(q_lens, ctx_lens, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                          head_dim=64, pad=2)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = path(q, k_cache, v_cache, meta)
    assert out.shape == q.shape
    assert max_rel_err(out, ref) < 1e-4
    assert (out[sum(q_lens):] == 0).all()


def test_query_length_independent_of_padding_layout():
    # the same request's rows give the same output whether or not other requests surround it
    q, k_cache, v_cache, meta = make_case([2, 4, 1], [19, 26, 8], n_heads=8, n_kv_heads=2, head_dim=64)
    full = verify_attention(q, k_cache, v_cache, meta, num_splits=1)
    alone = AttnMeta.from_lens([4], [26], device=DEVICE)
    alone.block_tables = meta.block_tables[1:2].contiguous()
    part = verify_attention(q[2:6].contiguous(), k_cache, v_cache, alone, num_splits=1)
    assert max_rel_err(part, full[2:6]) < 1e-6


def test_choose_num_splits_static():
    assert choose_num_splits(64, 8, 2048, 132) == 1  # 512 programs already fill the GPU
    assert choose_num_splits(1, 8, 2048, 132) == 16  # 8 programs: split the context
    assert choose_num_splits(1, 8, 256, 132) == 2  # but never below MIN_SPLIT_TOKENS per split
    assert choose_num_splits(4, 8, 8192, 1) == 1


def test_bad_inputs_name_the_argument():
    q, k_cache, v_cache, meta = make_case([2], [5], n_heads=4, n_kv_heads=2, head_dim=64)
    with pytest.raises(KernelInputError, match="^q:"):
        verify_attention(q[:, :3].contiguous(), k_cache, v_cache, meta)
    with pytest.raises(KernelInputError, match="^q:"):
        verify_attention(q.half(), k_cache, v_cache, meta)
    with pytest.raises(KernelInputError, match="^v_cache:"):
        verify_attention(q, k_cache, v_cache[:-1], meta)
    no_table = AttnMeta.from_lens([2], [5], device=DEVICE)
    with pytest.raises(KernelInputError, match="block_tables"):
        verify_attention(q, k_cache, v_cache, no_table)
    with pytest.raises(KernelInputError, match="^sm_scale:"):
        verify_attention(q, k_cache, v_cache, meta, sm_scale=-0.1)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_non_causal_block_matches_reference(num_splits):
    q, k_cache, v_cache, meta = make_case([4, 1, 3], [10, 0, 27], n_heads=8, n_kv_heads=2, head_dim=64, pad=1)
    ref = verify_attention_ref(q, k_cache, v_cache, meta, causal=False)
    out = verify_attention(q, k_cache, v_cache, meta, num_splits=num_splits, causal=False)
    assert max_rel_err(out, ref) < 1e-4
    causal = verify_attention_ref(q, k_cache, v_cache, meta)
    assert max_rel_err(causal[:3], ref[:3]) > 1e-3  # the mask really differs


@pytest.mark.parametrize("derive_slots", [False, True])
def test_paged_backend_matches_model_reference(derive_slots):
    from spectune.kernels.attention import gather_dense_kv
    from spectune.models.attention import reference_attention
    from spectune.models.paged import PagedTritonAttention

    backend = PagedTritonAttention(2, 40, BLOCK_SIZE, 2, 64, torch.float32, DEVICE)
    tables = backend.allocate(3, 37, 4, generator=torch.Generator().manual_seed(5))
    assert tables.shape == (3, 3) and len(set(tables.flatten().tolist())) == 9
    assert (backend.kv(1)[0] != 0).all()  # context prefilled with non-zero values
    with pytest.raises(KernelInputError, match="^num_blocks:"):
        backend.allocate(20, 37, 4)  # 60 blocks > 40
    meta = backend.meta_for(tables, [4, 1, 3], [37, 13, 0], num_tokens=10)
    if derive_slots:
        meta.slot_mapping = None
    gen = torch.Generator().manual_seed(6)
    for layer in range(2):
        q = torch.randn((10, 8, 64), generator=gen).to(DEVICE)
        k = torch.randn((10, 2, 64), generator=gen).to(DEVICE)
        v = torch.randn((10, 2, 64), generator=gen).to(DEVICE)
        k_ctx, v_ctx = (t.transpose(1, 2) for t in gather_dense_kv(*backend.kv(layer), tables))
        k_ctx, v_ctx = k_ctx.clone(), v_ctx.clone()  # context before this step's write
        out = backend(layer, q, k, v, meta)
        ref = reference_attention(q, k, v, meta, k_ctx, v_ctx)
        assert max_rel_err(out, ref) < 1e-4
        assert (out[8:] == 0).all()
        # the new rows sit right after each request's context
        k_after = gather_dense_kv(*backend.kv(layer), tables)[0].transpose(1, 2)
        assert torch.equal(k_after[0, 37:41], k[0:4]) and torch.equal(k_after[2, 0:3], k[5:8])


@pytest.mark.gpu
def test_graph_replay_follows_meta_updates():
    # capture once, then rewrite the step's device tensors in place: the replay must follow them
    q, k_cache, v_cache, meta = make_case([3, 1, 4], [300, 40, 129], n_heads=32, n_kv_heads=8,
                                          head_dim=128, dtype=torch.bfloat16, pad=2)
    out = torch.empty_like(q)
    verify_attention(q, k_cache, v_cache, meta, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_attention(q, k_cache, v_cache, meta, out=out)
    for ctx, cu in (([300, 40, 129], [0, 3, 4, 8]), ([17, 290, 0], [0, 1, 5, 7])):
        meta.context_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        meta.cu_seqlens_q.copy_(torch.tensor(cu, dtype=torch.int32))
        q.normal_()
        out.fill_(POISON)
        graph.replay()
        ref = verify_attention_ref(q, k_cache, v_cache, meta)
        assert max_rel_err(out[: cu[-1]], ref[: cu[-1]]) < 1e-2
        assert (out[cu[-1]:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    AttnConfig(64, 4, 2),  # one 64-row tile (wgmma on sm_90)
    AttnConfig(32, 2, 3, block_m=32),  # two 32-row query tiles per kv head
    AttnConfig(64, 4, 3, block_m=128),  # padded tile
    AttnConfig(128, 8, 2, block_m=128, num_splits=3),
    AttnConfig(32, 4, 4, block_m=16, num_splits=2),
])
def test_compiled_configs_match_reference(config):
    # every shape of launch the sweep can pick, compiled for the GPU, against the fp32 reference
    q, k_cache, v_cache, meta = make_case([16, 1, 9, 16], [300, 64, 63, 0], n_heads=32, n_kv_heads=8,
                                          head_dim=128, dtype=torch.bfloat16, pad=3)
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = torch.full_like(q, POISON)
    verify_attention(q, k_cache, v_cache, meta, out=out, config=config)
    assert max_rel_err(out[:42], ref[:42]) < 1e-2
    assert (out[42:] == 0).all()


def _part(meta: AttnMeta, lo: int, hi: int, max_q: int) -> AttnMeta:
    """Requests lo..hi-1 of ``meta`` as one launch's sub-batch (offsets kept: rows stay in place)."""
    return AttnMeta(cu_seqlens_q=meta.cu_seqlens_q[lo : hi + 1], context_lens=meta.context_lens[lo:hi],
                    max_q=max_q, block_tables=meta.block_tables[lo:hi])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_parts_run_one_launch_each_and_match_the_reference(seed, num_splits):
    """A mixed step's meta: decode/verify rows (1..4 tokens) then prompt pieces (up to 40 tokens),
    padding after; each part is tiled for its own max_q and the rows come out as one launch's."""
    gen = torch.Generator().manual_seed(100 + seed)
    decode = [int(x) for x in torch.randint(1, 5, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)]
    pieces = [int(x) for x in torch.randint(9, 41, (int(torch.randint(1, 3, (1,), generator=gen)),), generator=gen)]
    ctx = [int(x) for x in torch.randint(0, 60, (len(decode) + len(pieces),), generator=gen)]
    q, k_cache, v_cache, meta = make_case(decode + pieces, ctx, n_heads=8, n_kv_heads=2, head_dim=64, pad=5,
                                          seed=seed)
    n = len(decode)
    meta.parts = (_part(meta, 0, n, max(decode)), _part(meta, n, len(ctx), max(pieces)))
    ref = verify_attention_ref(q, k_cache, v_cache, meta)
    out = torch.full_like(q, POISON)
    verify_attention(q, k_cache, v_cache, meta, out=out, num_splits=num_splits)
    whole = dataclasses.replace(meta, parts=None)
    one = verify_attention(q, k_cache, v_cache, whole, num_splits=num_splits)
    real = sum(decode) + sum(pieces)
    assert rel_err(out[:real], ref[:real]) < TOL[torch.float32]
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))  # padding rows zero, not poison
    assert rel_err(out, one) < TOL[torch.float32]
