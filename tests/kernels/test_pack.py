"""Ragged packing kernel vs its torch reference, and the padding accounting."""

from __future__ import annotations

import pytest
import torch

from spectune.kernels.kv_cache import PAD_SLOT, KernelInputError
from spectune.kernels.pack import (
    PAD_REQUEST,
    PAD_TOKEN_ID,
    PackedBatch,
    pack,
    pack_ref,
    padding_waste,
)

FIELDS = ("input_ids", "positions", "slot_mapping", "token_req", "cu_seqlens_q", "grant_used")


def _inputs(batch: int, max_k: int, seed: int, zero_grants: bool = False):
    g = torch.Generator().manual_seed(seed)
    last = torch.randint(1, 1000, (batch,), generator=g)
    drafts = torch.randint(1, 1000, (batch, max_k), generator=g)
    grant = torch.randint(0, max_k + 1, (batch,), generator=g).to(torch.int32)
    if zero_grants:
        grant.zero_()
    ctx = torch.randint(0, 60, (batch,), generator=g).to(torch.int32)
    tables = torch.randperm(400, generator=g)[: batch * 8].reshape(batch, 8).to(torch.int32)
    return last, drafts, grant, ctx, tables


@pytest.mark.parametrize("batch, max_k, tier, num_reqs", [
    (1, 0, 1, None), (1, 15, 16, None), (7, 5, 48, None), (7, 5, 12, None),  # 12: grants cut
    (33, 15, 96, None), (33, 3, 256, 20), (5, 3, 5, None), (6, 4, 16, 0),
])
@pytest.mark.parametrize("zero_grants", [False, True])
def test_kernel_matches_reference(batch, max_k, tier, num_reqs, zero_grants):
    last, drafts, grant, ctx, tables = _inputs(batch, max_k, seed=batch + tier, zero_grants=zero_grants)
    want = pack_ref(last, drafts, grant, ctx, tables, 8, tier, num_reqs=num_reqs)
    got = pack(last, drafts, grant, ctx, tables, 8, tier, num_reqs=num_reqs)
    on_device = None if num_reqs is None else torch.tensor([num_reqs], dtype=torch.int32)
    got_dev = pack(last, drafts, grant, ctx, tables, 8, tier, num_reqs=on_device)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert torch.equal(getattr(got_dev, f), getattr(want, f)), f
    assert int(got.cu_seqlens_q[-1]) <= tier


def test_hand_made_layout():
    last = torch.tensor([10, 20], dtype=torch.int64)
    drafts = torch.tensor([[11, 12, 13], [21, 22, 23]], dtype=torch.int64)
    grant = torch.tensor([2, 0], dtype=torch.int32)
    ctx = torch.tensor([5, 3], dtype=torch.int32)
    tables = torch.tensor([[7, 9], [4, 0]], dtype=torch.int32)
    out = pack(last, drafts, grant, ctx, tables, 4, 6)
    assert out.input_ids.tolist() == [10, 11, 12, 20, PAD_TOKEN_ID, PAD_TOKEN_ID]
    assert out.positions.tolist()[:4] == [5, 6, 7, 3]
    # pos 5, 6, 7 of request 0 -> its 2nd block (9), offsets 1..3; pos 3 of request 1 -> block 4
    assert out.slot_mapping.tolist() == [37, 38, 39, 19, PAD_SLOT, PAD_SLOT]
    assert out.token_req.tolist() == [0, 0, 0, 1, PAD_REQUEST, PAD_REQUEST]
    assert out.cu_seqlens_q.tolist() == [0, 3, 4]


def test_overflowing_grants_are_cut_in_request_order():
    last, drafts, _, ctx, tables = _inputs(3, 4, seed=1)
    grant = torch.tensor([4, 4, 4], dtype=torch.int32)
    out = pack(last, drafts, grant, ctx, tables, 8, 8)  # room for 5 drafts after 3 real tokens
    assert out.grant_used.tolist() == [4, 1, 0]
    assert out.cu_seqlens_q.tolist() == [0, 5, 7, 8]


def test_writes_into_preallocated_buffers():
    last, drafts, grant, ctx, tables = _inputs(4, 3, seed=2)
    out = PackedBatch.empty(4, 16, "cpu")
    got = pack(last, drafts, grant, ctx, tables, 8, 16, out=out)
    assert got is out and got.input_ids.data_ptr() == out.input_ids.data_ptr()


def test_bad_input_names_the_argument():
    last, drafts, grant, ctx, tables = _inputs(4, 3, seed=2)
    with pytest.raises(KernelInputError, match="context_lens"):
        pack(last, drafts, grant, ctx.long(), tables, 8, 16)
    with pytest.raises(KernelInputError, match="out.input_ids"):
        pack(last, drafts, grant, ctx, tables, 8, 16, out=PackedBatch.empty(4, 8, "cpu"))


def test_padding_waste():
    w = padding_waste([3, 0, 1, 0], tiers=[4, 8, 16])
    assert (w.tokens, w.tier, w.tier_pad_rows) == (8, 8, 0)
    assert w.request_pad_rows == 4 * 4 - 8
    assert padding_waste([3, 0], tiers=[4], max_q=8).tier is None
    assert padding_waste([3, 0], tiers=[4, 8], max_q=8).request_pad_rows == 16 - 5
    with pytest.raises(KernelInputError, match="max_q"):
        padding_waste([3], tiers=[8], max_q=2)
