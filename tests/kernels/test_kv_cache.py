import pytest
import torch

from spectune.kernels.kv_cache import (
    PAD_SLOT,
    KernelInputError,
    allocate_kv_cache,
    make_block_tables,
    slot_mapping_for,
    write_kv,
    write_kv_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_allocate_shapes_and_bytes():
    cache = allocate_kv_cache(3, 10, 16, 2, 64, torch.float16, DEVICE)
    assert cache.n_layers == 3 and cache.num_blocks == 10 and cache.block_size == 16
    assert cache.k[0].shape == (10, 16, 2, 64) and cache.v[2].dtype == torch.float16
    assert cache.nbytes_per_layer() == 2 * 10 * 16 * 2 * 64 * 2
    with pytest.raises(KernelInputError, match="^block_size:"):
        allocate_kv_cache(1, 10, 0, 2, 64)


@pytest.mark.parametrize("shuffle", [False, True])
def test_block_tables_are_disjoint_and_sized(shuffle):
    gen = torch.Generator().manual_seed(1)
    tables = make_block_tables([1, 17, 32, 0, 40], 16, 20, shuffle=shuffle, generator=gen)
    assert tables.shape == (5, 3) and tables.dtype == torch.int32
    used = [tables[0, :1], tables[1, :2], tables[2, :2], tables[4, :3]]
    flat = torch.cat(used).tolist()
    assert len(set(flat)) == len(flat) == 8
    assert all(0 <= x < 20 for x in flat)
    if not shuffle:
        assert flat == list(range(8))


def test_block_tables_errors():
    with pytest.raises(KernelInputError, match="^num_blocks:"):
        make_block_tables([40, 40], 16, 5)
    with pytest.raises(KernelInputError, match="^max_blocks:"):
        make_block_tables([40], 16, 5, max_blocks=2)


def test_slot_mapping_positions_and_padding():
    tables = torch.tensor([[7, 2, 0], [4, 9, 5]], dtype=torch.int32)
    context = torch.tensor([15, 30], dtype=torch.int32)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    slots = slot_mapping_for(tables, context, cu, num_tokens=7, block_size=16)
    # request 0: positions 15, 16 -> block 7 offset 15, block 2 offset 0
    # request 1: positions 30, 31, 32 -> block 9 offsets 14, 15, then block 5 offset 0
    expect = [7 * 16 + 15, 2 * 16, 9 * 16 + 14, 9 * 16 + 15, 5 * 16, PAD_SLOT, PAD_SLOT]
    assert slots.tolist() == expect and slots.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv_heads,head_dim", [(1, 64), (2, 128), (3, 40)])
def test_write_kv_matches_reference(dtype, n_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_tokens = 6, 16, 9
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 8]] = PAD_SLOT
    k = torch.randn((num_tokens, n_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    v = torch.randn((num_tokens, n_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    base_k = torch.randn((num_blocks, block_size, n_kv_heads, head_dim), generator=gen).to(dtype).to(DEVICE)
    base_v = torch.randn_like(base_k)
    slots = slots.to(DEVICE)
    k_ref, v_ref = base_k.clone(), base_v.clone()
    write_kv_ref(k, v, k_ref, v_ref, slots)
    k_out, v_out = base_k.clone(), base_v.clone()
    write_kv(k, v, k_out, v_out, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    # real rows landed where the slots say; everything else is untouched
    flat = k_out.view(-1, n_kv_heads, head_dim)
    for t in range(num_tokens):
        if slots[t] >= 0:
            assert torch.equal(flat[slots[t]], k[t])
    changed = (k_out != base_k).view(num_blocks * block_size, -1).any(1)
    assert changed.nonzero().flatten().tolist() == sorted(s for s in slots.tolist() if s >= 0)


def test_write_kv_all_padding_writes_nothing():
    k = torch.randn(4, 2, 64, device=DEVICE)
    cache_k = torch.randn(3, 16, 2, 64, device=DEVICE)
    cache_v = torch.randn(3, 16, 2, 64, device=DEVICE)
    before = cache_k.clone(), cache_v.clone()
    write_kv(k, k, cache_k, cache_v, torch.full((4,), PAD_SLOT, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache_k, before[0]) and torch.equal(cache_v, before[1])


def test_write_kv_bad_shapes():
    cache = torch.zeros(3, 16, 2, 64, device=DEVICE)
    with pytest.raises(KernelInputError, match="^k:"):
        write_kv(torch.zeros(4, 3, 64), torch.zeros(4, 3, 64), cache, cache.clone(), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="^slot_mapping:"):
        write_kv(torch.zeros(4, 2, 64), torch.zeros(4, 2, 64), cache, cache.clone(), torch.zeros(3, dtype=torch.int64))
