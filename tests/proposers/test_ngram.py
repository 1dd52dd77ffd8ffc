import pytest

from specdecode.core.sampling import SamplingConfig
from specdecode.errors import ConfigError
from specdecode.proposers import NgramProposer
from specdecode.proposers.ngram import lookup


def test_longest_ngram_wins_and_latest_match_is_used():
    ctx = [5, 1, 2, 9, 9, 7, 1, 2, 3, 4, 8, 1, 2]
    # the bigram [1, 2] occurs at 1 and 6; the latest earlier one is followed by 3, 4
    assert lookup(ctx, 2, max_ngram=3) == [3, 4]
    ctx = [7, 1, 2, 3, 4, 1, 2, 5, 6, 7, 1, 2]
    # the trigram [7, 1, 2] only occurs at the start: it beats the later bigram match
    assert lookup(ctx, 3, max_ngram=3) == [3, 4, 1]


def test_no_match_gives_empty_draft():
    assert lookup([1, 2, 3, 4], 3, max_ngram=3) == []


def test_proposal_is_truncated_at_context_end():
    assert lookup([1, 2, 1], 5, max_ngram=1) == [2, 1]


def test_proposer_returns_deterministic_draft():
    draft = NgramProposer().propose([1, 2, 3, 1, 2], 2, SamplingConfig(temperature=1.0), None)
    assert draft.tokens.tolist() == [[3, 1]] and draft.probs is None


def test_bad_ngram_sizes_rejected():
    with pytest.raises(ConfigError):
        NgramProposer(max_ngram=1, min_ngram=2)
