"""Prefill packing: schedules, buckets, and first tokens equal to a forward without a cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectune.engine import prefill as prefill_mod
from spectune.engine.bench import TorchPagedAttention
from spectune.engine.prefill import PrefillGraphs, PrefillRegion, default_buckets, schedule
from spectune.engine.run_log import top2_margin
from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.build import build_models
from spectune.models.config import ModelArgs, parse_drafter

BLOCK = 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=9), st.integers(1, 12), st.integers(1, 30))
def test_schedule_covers_every_prompt_in_order_within_the_limits(lens, chunk, max_tokens):
    forwards = schedule(lens, chunk, max_tokens)
    seen = [0] * len(lens)
    for pieces in forwards:
        assert pieces and sum(p.length for p in pieces) <= max_tokens
        assert len({p.index for p in pieces}) == len(pieces)  # one piece per request per forward
        for p in pieces:
            assert 1 <= p.length <= chunk and p.start == seen[p.index]
            seen[p.index] += p.length
            assert p.last == (seen[p.index] == lens[p.index])
    assert seen == lens


def test_default_buckets():
    assert default_buckets(512, 4096) == [16, 32, 64, 128] + list(range(256, 4097, 256))
    assert default_buckets(8, 16) == [16]
    assert default_buckets(64, 1000) == [16, 32, 64, 128, 256, 512, 768, 1000]


def uncached_first(target, prompt):
    """argmax and top2_margin after ``prompt`` from one forward over a fresh cache."""
    args = target.args
    blocks = 1 + -(-len(prompt) // BLOCK)
    backend = target.backend
    target.backend = TorchPagedAttention(args.n_layers, blocks, BLOCK, args.n_kv_heads, args.head_dim,
                                         torch.float32, "cpu")
    meta = AttnMeta(cu_seqlens_q=torch.tensor([0, len(prompt)], dtype=torch.int32),
                    context_lens=torch.zeros(1, dtype=torch.int32), max_q=len(prompt),
                    block_tables=torch.arange(1, blocks, dtype=torch.int32)[None])
    last = target(torch.tensor(prompt), torch.arange(len(prompt)), meta)[-1:]
    target.backend = backend
    return int(last.argmax()), top2_margin(last)[0]


@pytest.mark.parametrize("span", [32, 3, 1])  # attention slots of <= span tokens (SPAN: 32)
@pytest.mark.parametrize("chunk,max_tokens,row0", [(4, 8, 0), (5, 16, 1), (64, 64, 0), (3, 7, 2)])
def test_prefill_pieces_give_the_uncached_first_token_and_fill_the_cache(chunk, max_tokens, row0, span, monkeypatch):
    monkeypatch.setattr(prefill_mod, "SPAN", span)
    torch.manual_seed(chunk + max_tokens)
    args = ModelArgs.from_name("tiny")
    target = build_models(args, parse_drafter("eagle-1l"), device="cpu", dtype=torch.float32,
                          max_batch=1, max_q=1, context_len=64, seed=5).target
    lens = [11, 1, 7, 16, 3]
    max_rows, per_req = row0 + len(lens), -(-max(lens) // BLOCK)
    num_blocks = 1 + max_rows * per_req
    target.backend = TorchPagedAttention(args.n_layers, num_blocks, BLOCK, args.n_kv_heads, args.head_dim,
                                         torch.float32, "cpu")
    tables = torch.zeros(max_rows, per_req, dtype=torch.int32)  # row r owns blocks 1 + r * per_req ..
    for r in range(max_rows):
        tables[r] = torch.arange(1 + r * per_req, 1 + (r + 1) * per_req)
    runner = PrefillGraphs(target, tables, max_rows=max_rows, chunk=chunk, max_tokens=max_tokens,
                           device=torch.device("cpu"), capture=False)
    prompts = [torch.randint(1, args.vocab_size, (n,)).tolist() for n in lens]
    first, margins = runner.run(prompts, row0)
    for i, p in enumerate(prompts):
        tok, margin = uncached_first(target, p)
        assert int(first[i]) == tok
        torch.testing.assert_close(margins[i], margin, rtol=1e-4, atol=1e-4)
    # every prompt token's K is cached in the row's blocks; nothing written to the trash block 0
    k0 = target.backend.cache.k[0]
    assert torch.count_nonzero(k0[0]) == 0
    for i, n in enumerate(lens):
        blocks = tables[row0 + i]
        cached = k0[blocks.long()].reshape(-1, *k0.shape[2:])[:n]
        assert torch.count_nonzero(cached.abs().sum(dim=(1, 2))) == n
        assert torch.count_nonzero(k0[blocks.long()].reshape(-1, *k0.shape[2:])[n:]) == 0


def test_pieces_are_cut_into_attention_slots_of_span_tokens():
    tables = torch.arange(40, dtype=torch.int32).reshape(8, 5)
    region = PrefillRegion(tables, max_rows=8, chunk=8, max_tokens=16, device=torch.device("cpu"), span=3,
                           max_pieces=4)
    assert region.buckets == [16] and region.max_pieces == 4
    assert region.slots(16) == 6 + 4 - 1  # ceil(16 / 3) + pieces - 1
    # a 7-token piece from position 0 that ends its prompt, a 4-token piece from position 5 that does not
    region.load(16, [(list(range(1, 8)), 0, 2, 2), ([9, 9, 9, 9], 5, 3, None)])
    r, trash = region.slots(16), region.trash
    assert region.cu[: r + 1].tolist() == [0, 3, 6, 7, 10, 11] + [11] * (r - 5)
    assert region.ctx[:5].tolist() == [0, 3, 6, 5, 8]  # each slot's cached keys: its first position
    assert region.rows[:5].tolist() == [2, 2, 2, 3, 3]
    assert region.last_rows[:5].tolist() == [2, 5, 6, 9, 10]
    assert region.dest[:r].tolist() == [trash, trash, 2] + [trash] * (r - 3)  # the piece's last slot only
    meta = region.meta(16)
    assert meta.max_q == 3 and meta.block_tables.tolist()[:5] == [tables[i].tolist() for i in (2, 2, 2, 3, 3)]
    with pytest.raises(ValueError, match="at most 4"):
        region.load(16, [([1], 0, i, None) for i in range(5)])


def test_a_forward_larger_than_every_bucket_names_it():
    runner = PrefillGraphs(lambda *a: None, torch.zeros(1, 1, dtype=torch.int32), max_rows=1, chunk=8,
                           max_tokens=16, device=torch.device("cpu"), capture=False)
    with pytest.raises(ValueError, match="largest bucket 16"):
        runner.bucket(17)
