import torch

from spectune.kernels.attention_metadata import AttnMeta
from spectune.models.decisive import DecisiveLogits, decisive_token


def fake_target(ids, positions, meta):
    # near-tied random logits: any tiny perturbation could flip the argmax
    gen = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(ids.shape[0], 50, generator=gen) * 1e-3


def test_argmax_is_the_hashed_token_and_wins_by_a_wide_margin():
    ids = torch.tensor([3, 7, 7, 11])
    pos = torch.tensor([10, 10, 11, 12])
    meta = AttnMeta.from_lens([1, 1, 2], [10, 10, 10], max_q=2)
    logits = DecisiveLogits(fake_target)(ids, pos, meta)
    want = decisive_token(ids, pos, 50)
    assert torch.equal(logits.argmax(dim=1), want)
    top2 = logits.topk(2, dim=1).values
    assert bool(((top2[:, 0] - top2[:, 1]) > 1.0).all())


def test_hash_depends_on_token_and_position_and_stays_in_vocab():
    ids = torch.arange(0, 1000)
    a = decisive_token(ids, torch.zeros_like(ids), 97)
    b = decisive_token(ids, torch.ones_like(ids), 97)
    assert int(a.min()) >= 0 and int(a.max()) < 97
    assert not torch.equal(a, b)
    assert len(set(a.tolist())) > 80  # spread over the vocabulary


def test_logit_rows_give_those_rows_of_the_full_logits():
    """The reference decoder and DecisiveLogits with ``logit_rows``: the lm_head over those rows
    only, equal to the full forward's rows (the prefill forwards' last tokens, ``engine.prefill``);
    a target without the option is indexed by ``logits_at``."""
    from spectune.engine.bench import TorchPagedAttention
    from spectune.models.build import build_models
    from spectune.models.config import ModelArgs, parse_drafter
    from spectune.models.logit_rows import logits_at

    args = ModelArgs.from_name("tiny")
    target = build_models(args, parse_drafter("eagle-1l"), device="cpu", dtype=torch.float32, max_batch=2,
                          max_q=1, context_len=32, seed=7).target
    gen = torch.Generator().manual_seed(11)
    for n, rows in ((9, [8]), (9, [0, 4, 8]), (13, [12, 3, 3])):
        ids = torch.randint(1, args.vocab_size, (n,), generator=gen)
        meta = AttnMeta(cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                        context_lens=torch.zeros(1, dtype=torch.int32), max_q=n,
                        block_tables=torch.arange(1, 5, dtype=torch.int32)[None])
        sel = torch.tensor(rows)
        for model in (target, DecisiveLogits(target)):
            full = []
            for use_rows in (False, True):  # a fresh cache each time: the forward writes its KV
                target.backend = TorchPagedAttention(args.n_layers, 6, 4, args.n_kv_heads, args.head_dim,
                                                     torch.float32, "cpu")
                pos = torch.arange(n)
                full.append(logits_at(model, ids, pos, meta, sel) if use_rows else model(ids, pos, meta)[sel])
            torch.testing.assert_close(full[1], full[0], rtol=1e-5, atol=1e-5)
    ids, pos = torch.tensor([3, 7, 7, 11]), torch.tensor([10, 10, 11, 12])
    meta = AttnMeta.from_lens([1, 1, 2], [10, 10, 10], max_q=2)
    sel = torch.tensor([2, 0])
    assert torch.equal(logits_at(fake_target, ids, pos, meta, sel), fake_target(ids, pos, meta)[sel])
    assert torch.equal(logits_at(DecisiveLogits(fake_target), ids, pos, meta, sel),
                       DecisiveLogits(fake_target)(ids, pos, meta)[sel])
