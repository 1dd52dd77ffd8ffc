"""Suffix decoding: the automaton, the proposer, statistical conformance and real-model identity."""

from __future__ import annotations

import random

import pytest

from helpers import ALPHA, MarkovLM, chi_square_pvalue, no_residual_verify, sample_sequences, sequence_law
from specdecode.core.sampling import SamplingConfig
from specdecode.engine import Decoder, GenerationConfig
from specdecode.errors import ConfigError
from specdecode.proposers.suffix import SuffixAutomaton, SuffixCorpus, SuffixProposer, token_score

GREEDY = SamplingConfig()


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def occurrences(seq: list[int], pat: list[int]) -> int:
    return sum(seq[i : i + len(pat)] == pat for i in range(len(seq) - len(pat) + 1))


def local(**kw) -> SuffixProposer:
    return SuffixProposer(use_corpus=False, **kw)


# -- the automaton ---------------------------------------------------------------------------------


def test_counts_and_longest_repeat_match_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        sam = SuffixAutomaton(count_depth=10**9)
        sam.extend_all(seq)
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + 6) + 1):
                state, matched = sam.match(seq[i:j])
                assert matched == j - i and sam.count[state] == occurrences(seq, seq[i:j])
        state, matched = sam.longest_repeat()
        best = max((n for n in range(1, len(seq)) if occurrences(seq[:-1], seq[len(seq) - n :])), default=0)
        assert matched == best


def test_incremental_build_equals_batch_build():
    seq = [random.Random(1).randrange(4) for _ in range(300)]
    a, b = SuffixAutomaton(), SuffixAutomaton()
    a.extend_all(seq)
    for t in seq:
        b.extend(t)
        b.longest_repeat()  # queries between appends do not disturb the build
    assert (a.next, a.link, a.length, a.count) == (b.next, b.link, b.length, b.count)
    assert len(a.length) < 2 * len(seq)  # at most 2n - 1 states: linear size


def test_separators_stop_matches_at_document_ends():
    sam = SuffixAutomaton()
    sam.extend_all([1, 2])
    sam.end_document()
    sam.extend_all([3, 4])
    assert sam.match([2, 3])[1] == 1  # [2, 3] never occurs: only [3] matches
    state, _ = sam.match([1, 2])
    assert sam.children(state) == []  # the separator is not a continuation


# -- the proposer ----------------------------------------------------------------------------------


def test_longest_match_wins():
    # [7, 1, 2] occurred once, followed by 8; the shorter [1, 2] is mostly followed by 5
    ctx = [1, 2, 5, 1, 2, 5, 7, 1, 2, 8, 0, 1, 2, 5, 7, 1, 2]
    assert local(min_token_prob=0.0).propose(ctx, 1, GREEDY, None).tokens.tolist() == [[8]]


def test_most_frequent_continuation_is_chosen():
    ctx = [9, 1, 4, 9, 1, 3, 9, 1, 3, 9, 1, 3, 6, 1, 4, 6, 9, 1]
    # after [9, 1]: 3 three times, 4 once (the longer [6, 9, 1] match does not exist earlier)
    draft = local().propose(ctx, 4, GREEDY, None)
    assert draft.tokens[0, 0].item() == 3 and draft.probs is None
    # scored by the 2-token match and the frequency: 2 / (2 + 2) times 3 of the 4 continuations
    assert draft.scores is not None and draft.scores[0, 0].item() == pytest.approx(2 / 4 * 3 / 4)
    assert local().caps.scored_drafts and not local(scored=False).caps.scored_drafts
    assert SuffixProposer.caps.scored_drafts  # the option changes the instance, not the class


def test_a_longer_match_scores_its_drafts_higher():
    """A token that followed a long matched passage is more likely right than one that followed a
    short common phrase the same number of times; each draft deeper in the chain extends the
    match by one more token."""
    short = local().propose([7, 8, 5, 3, 9, 5, 3], 2, GREEDY, None)  # [5, 3] matched, then 9
    long = local().propose([1, 2, 4, 6, 5, 3, 9, 0, 1, 2, 4, 6, 5, 3], 2, GREEDY, None)  # 6 matched
    assert short.tokens[0, 0].item() == 9 and long.tokens[0, 0].item() == 9
    assert short.scores[0, 0].item() == pytest.approx(token_score(2, 1, 1)) == pytest.approx(0.5)
    assert long.scores[0, 0].item() == pytest.approx(token_score(6, 1, 1)) == pytest.approx(0.75)
    assert long.scores[0, 1].item() == pytest.approx(token_score(7, 1, 1))  # 0 after 7 matched
    assert token_score(30, 1, 4) < token_score(30, 4, 4)  # and the frequency still counts


def test_low_probability_path_stops_the_draft():
    ctx = [5, 1, 2, 5, 1, 3, 5, 1, 4, 5, 1, 6, 0, 5, 1]
    # after [5, 1] four continuations each with probability 1/4
    assert local(min_token_prob=0.3).propose(ctx, 4, GREEDY, None).k == 0
    assert local(min_token_prob=0.2).propose(ctx, 4, GREEDY, None).k >= 1


def test_draft_length_scales_with_match_length():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 4]
    assert local(max_spec_factor=1.0).propose(ctx, 8, GREEDY, None).tokens.tolist() == [[5]]
    long = local(max_spec_factor=1.0).propose(ctx[:-1] + [6, 7], 8, GREEDY, None)
    assert long.tokens.tolist() == [[8, 0]]
    assert local(max_spec_factor=3.0).propose(ctx, 8, GREEDY, None).tokens.tolist() == [[5, 6, 7]]


def test_incremental_updates_follow_the_context():
    p = local()
    p.reset([1, 2, 3])
    assert p.propose([1, 2, 3], 4, GREEDY, None).k == 0
    states = len(p.local.length)
    draft = p.propose([1, 2, 3, 1, 2], 4, GREEDY, None)  # only the two new tokens are added
    assert draft.tokens.tolist() == [[3, 1]] and len(p.local.length) <= states + 4
    assert p.ids == [1, 2, 3, 1, 2]


def test_tree_lists_branches_best_first():
    ctx = [9, 1, 3, 7, 9, 1, 3, 7, 9, 1, 4, 8, 9, 1, 3, 5, 0, 9, 1]
    p = local(max_spec_factor=2.0)
    paths = p.propose_tree(ctx, 3, max_nodes=8)
    assert paths[0] == p.propose(ctx, 3, GREEDY, None).tokens[0].tolist() == [3, 7, 9]
    assert paths == [[3, 7, 9], [3, 5, 0], [4, 8, 9]]  # by expected accepted length
    assert sum(len(x) for x in paths) <= 8 + len(paths)  # shared prefixes: at most max_nodes nodes
    assert p.propose_tree(ctx, 3, max_nodes=1) == [[3]]


def test_corpus_supplies_matches_across_requests():
    corpus = SuffixCorpus(max_tokens=100)
    p = SuffixProposer(corpus=corpus)
    first = p.start([0])
    first.propose([0, 4, 5, 6, 7], 4, GREEDY, None)
    first.finish([0, 4, 5, 6, 7])  # the first request's output: 4 5 6 7
    assert list(corpus.docs) == [[4, 5, 6, 7]]
    assert p.start([9, 9]).propose([9, 9, 4, 5], 4, GREEDY, None).tokens.tolist() == [[6, 7]]
    assert local().propose([9, 9, 4, 5], 4, GREEDY, None).k == 0


def test_each_proposer_owns_its_corpus_unless_one_is_shared():
    a, b = SuffixProposer(), SuffixProposer()
    request = a.start([0])
    request.finish([0, 4, 5, 6, 7])
    assert list(a.corpus.docs) == [[4, 5, 6, 7]] and not b.corpus.docs  # no per-process corpus
    shared = SuffixCorpus()
    c, d = SuffixProposer(corpus=shared), SuffixProposer(corpus=shared)
    c.start([0]).finish([0, 1, 2])
    assert d.corpus is shared and list(shared.docs) == [[1, 2]]


def test_a_salted_requests_output_drafts_only_for_requests_with_its_salt():
    """A request's ``cache_salt`` scopes the corpus, as it scopes the prefix store: another
    tenant's output would otherwise be drafted, and acceptance (so timing) would show it."""
    from specdecode.engine import Engine, EngineConfig, Speculation
    from specdecode.models.prefix_cache import PrefixScope
    from specdecode.proposers import suffix as suffix_module

    corpus = SuffixCorpus(max_tokens=100)
    p = SuffixProposer(corpus=corpus)
    p.start([0], prefix_scope=PrefixScope(None, "alice")).finish([0, 4, 5, 6, 7])
    assert not corpus.docs and list(corpus.scoped("alice").docs) == [[4, 5, 6, 7]]

    def drafted(salt):
        return p.start([9, 9], prefix_scope=PrefixScope(None, salt)).propose([9, 9, 4, 5], 4, GREEDY, None).k

    assert (drafted("alice"), drafted("bob"), drafted(None)) == (2, 0, 0)
    for i in range(suffix_module.MAX_SCOPES):
        corpus.scoped(f"tenant-{i}")
    assert drafted("alice") == 0  # the least recently used salts' corpora go first

    engine = Engine(MarkovLM(6, seed=1), config=EngineConfig(prefix_cache_mb=0))  # salts reach it without a store
    spec = Speculation(SuffixProposer(corpus=corpus), k=3)
    engine.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=5, cache_salt="carol"), spec)
    assert corpus.scoped("carol").docs and not corpus.docs


def test_corpus_is_bounded():
    corpus = SuffixCorpus(max_tokens=50, max_docs=4)
    for i in range(100):
        corpus.add([1000 + i] * 3 + [i, i + 1])
        assert corpus.tokens <= 50 and len(corpus.docs) <= 4
        assert corpus.automaton.tokens <= 2 * 50
    assert corpus.automaton.match([1000])[1] == 0  # long evicted after rebuilds
    assert corpus.automaton.match([1099, 99, 100])[1] == 3


def test_bad_settings_rejected():
    with pytest.raises(ConfigError):
        SuffixProposer(max_spec_factor=0)
    with pytest.raises(ConfigError):
        SuffixCorpus(max_tokens=0)


def test_registered_in_api():
    from specdecode.api import METHODS, make_proposer

    assert "suffix" in METHODS
    assert make_proposer("suffix", None, use_corpus=False).name == "suffix"


# -- statistical conformance -----------------------------------------------------------------------

N_SAMPLES = 3_000  # every broken variant in this file is rejected at ALPHA with this many (20,000 before)
PROMPT = [1, 2, 3, 1, 2, 0, 1]
SAMPLINGS = {"t0.6": SamplingConfig(temperature=0.6), "t1.0-topk4": SamplingConfig(temperature=1.0, top_k=4)}


def suffix_pvalue(sampling: SamplingConfig) -> tuple[float, float]:
    target = MarkovLM(5, seed=11)
    # A small private corpus: earlier samples feed later drafts and the automaton is rebuilt often.
    proposer = SuffixProposer(corpus=SuffixCorpus(max_tokens=400), max_spec_factor=2.0)
    decoder = Decoder(target, proposer, k=3)
    counts = sample_sequences(decoder, PROMPT, 4, sampling, N_SAMPLES)
    law = sequence_law(target, PROMPT, 4, sampling)
    stats = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=4, sampling=sampling, seed=1)).stats
    return chi_square_pvalue(counts, law), stats["acceptance_rate"]


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_suffix_sampling_is_exact(name):
    pvalue, _ = suffix_pvalue(SAMPLINGS[name])
    assert pvalue > ALPHA


def test_suffix_drafting_first_under_a_planned_k_is_exact():
    """Policy auto: the engine drafts k_max, then cuts the chain by its scores (a function of the
    context alone, so the k chosen does not bias what is verified)."""
    from specdecode.engine.policy import make_policy

    target = MarkovLM(5, seed=11)
    proposer = SuffixProposer(corpus=SuffixCorpus(max_tokens=400), max_spec_factor=2.0)
    decoder = Decoder(target, proposer, policy=make_policy("auto", 3))
    sampling = SAMPLINGS["t1.0-topk4"]
    counts = sample_sequences(decoder, PROMPT, 4, sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, sequence_law(target, PROMPT, 4, sampling)) > ALPHA


def test_suffix_tree_sampling_is_exact():
    from specdecode.engine import TreeConfig

    target = MarkovLM(5, seed=11)
    proposer = SuffixProposer(corpus=SuffixCorpus(max_tokens=400), max_spec_factor=2.0, min_token_prob=0.05)
    decoder = Decoder(target, proposer, k=3, tree=TreeConfig(max_nodes=6))
    sampling = SAMPLINGS["t0.6"]
    counts = sample_sequences(decoder, PROMPT, 4, sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, sequence_law(target, PROMPT, 4, sampling)) > ALPHA
    stats = [
        decoder.generate(PROMPT, GenerationConfig(max_new_tokens=4, sampling=sampling, seed=s)).stats for s in range(50)
    ]
    assert sum(s["tree_nodes"] for s in stats) > sum(s["drafted_tokens"] for s in stats)  # real branching


def test_broken_residual_is_caught_with_suffix_drafts(monkeypatch):
    import specdecode.engine.request as loop

    monkeypatch.setattr(loop, "verify_sampling", no_residual_verify)
    assert suffix_pvalue(SAMPLINGS["t1.0-topk4"])[0] < ALPHA


# -- greedy identity on the real default model ----------------------------------------------------


REAL_CFG = GenerationConfig(max_new_tokens=32)


@pytest.fixture(scope="module")
def real_plain():
    from real_model import PROMPTS, chat_ids, default_target

    target = default_target()
    plain = Decoder(target.model, None, eos_token_ids=target.eos_token_ids)
    return target, [(chat_ids(target, p), plain.generate(chat_ids(target, p), REAL_CFG).token_ids) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 5])
def test_suffix_greedy_identical_on_real_prompts(real_plain, k):
    target, cases = real_plain
    spec = Decoder(target.model, SuffixProposer(corpus=SuffixCorpus()), k=k, eos_token_ids=target.eos_token_ids)
    accepted = 0
    for ids, expected in cases:
        out = spec.generate(ids, REAL_CFG)
        assert out.token_ids == expected
        accepted += out.stats["accepted_tokens"]
    assert accepted > 0
