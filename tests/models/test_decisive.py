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
