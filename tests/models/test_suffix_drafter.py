import pytest

from spectune.models.suffix_drafter import (
    Candidate,
    SuffixDrafter,
    SuffixDrafterError,
    SuffixTrie,
    draft_length,
    follow,
)


def test_trie_counts_every_substring_up_to_depth():
    trie = SuffixTrie(depth=3)
    trie.add([1, 2, 1, 2, 3])
    assert trie.count([1]) == 2
    assert trie.count([2]) == 2
    assert trie.count([1, 2]) == 2
    assert trie.count([2, 1]) == 1
    assert trie.count([1, 2, 3]) == 1
    assert trie.count([1, 2, 1]) == 1
    assert trie.count([2, 1, 2, 3]) == 0  # longer than depth
    assert trie.count([3, 1]) == 0


def test_sequences_do_not_join():
    trie = SuffixTrie(depth=4)
    trie.add([5, 6])
    trie.add([7, 8])
    assert trie.count([6, 7]) == 0
    assert trie.count([5, 6]) == 1


def test_follow_takes_most_frequent_child_with_shrunk_frequency():
    trie = SuffixTrie(depth=4)
    trie.add([1, 2, 9, 1, 2, 9, 1, 3, 9])
    node = trie.find([1])
    tokens, conf = follow(node, 2, prior=1.0)
    # after 1: 2 twice, 3 once -> 2 with 2 / (3 + 1); after 1 2: 9 twice -> 2 / (2 + 1)
    assert tokens == (2, 9)
    assert conf == pytest.approx((0.5, 2 / 3))


def test_draft_length_cuts_at_survival():
    assert draft_length([0.9, 0.8, 0.5, 0.9], 0.5) == 2  # 0.9, 0.72, 0.36
    assert draft_length([0.9, 0.8], 0.0) == 2
    assert draft_length([0.4], 0.5) == 0


def test_candidate_score_is_expected_accepts():
    c = Candidate(match=2, tokens=(1, 2), conf=(0.5, 0.5), shared=False)
    assert c.score == pytest.approx(0.5 + 0.25)


def test_drafts_repeated_text_of_the_request():
    d = SuffixDrafter(depth=8, max_match=4)
    ctx = [10, 11, 12, 13, 14, 20, 10, 11]
    draft = d.propose(ctx, 3)
    # 10 11 was followed once by 12 13 14: each seen once -> 1 / (1 + 1)
    assert draft.tokens == (12, 13, 14)
    assert draft.conf == pytest.approx((0.5, 0.5, 0.5))


def test_no_match_offers_nothing():
    d = SuffixDrafter(depth=8, max_match=4)
    assert d.propose([1, 2, 3], 4).tokens == ()


def test_shared_trie_carries_earlier_outputs():
    d = SuffixDrafter(depth=8, max_match=4)
    d.rollback(0)
    d.remember([40, 41, 42, 43])
    d.remember([40, 41, 42, 44])
    d.rollback(0)
    draft = d.propose([7, 40, 41], 2)
    assert draft.tokens[0] == 42
    assert draft.conf[0] == pytest.approx(2 / 3)  # seen twice of two, prior 1


def test_higher_scoring_candidate_wins():
    d = SuffixDrafter(depth=8, max_match=4)
    for _ in range(5):
        d.remember([1, 2, 3])
    # the request has 2 -> 9 once; the shared trie has 2 -> 3 five times
    draft = d.propose([2, 9, 5, 2], 1)
    assert draft.tokens == (3,)
    assert draft.conf[0] == pytest.approx(5 / 6)


def test_min_survival_shortens_the_draft():
    d = SuffixDrafter(depth=8, max_match=4, min_survival=0.3)
    draft = d.propose([10, 11, 12, 13, 14, 20, 10, 11], 3)
    assert draft.tokens == (12,)  # 0.5, then 0.25 < 0.3


def test_context_growth_and_rollback_match_a_fresh_drafter():
    ctx = [3, 4, 5, 3, 4, 6, 3, 4, 5, 7, 3, 4]
    grown = SuffixDrafter(depth=6, max_match=3)
    grown.propose(ctx[:5], 2)
    grown.propose(ctx[:9], 2)
    grown.rollback(7)  # drop what the context no longer holds
    got = grown.propose(ctx, 2)
    fresh = SuffixDrafter(depth=6, max_match=3).propose(ctx, 2)
    assert got == fresh
    assert got.tokens == (5, 3)  # 3 4 -> 5 (2 of 3); 3 4 5 -> 3 or 7 once each: the smaller id


@pytest.mark.parametrize("kw, field", [({"max_match": 8, "depth": 8}, "max_match"), ({"prior": 0.0}, "prior"),
                                       ({"min_survival": 1.5}, "min_survival")])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(SuffixDrafterError, match=field):
        SuffixDrafter(**kw)
