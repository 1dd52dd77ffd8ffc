"""Hybrid proposer (prompt lookup, else a trained drafter): exact sampling with every source in play,
a mis-reported q caught, greedy identity, no missed features, and the shipped configuration."""

from __future__ import annotations

import pytest
import torch
from test_eagle import random_head
from test_medusa import random_heads

from helpers import ALPHA, proposer_pvalue, tiny_native
from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.engine import Decoder, GenerationConfig, TreeConfig
from specdecode.errors import ConfigError
from specdecode.proposers.eagle import EagleProposer
from specdecode.proposers.hybrid import HybridProposer
from specdecode.proposers.medusa import MedusaProposer
from specdecode.proposers.suffix import SuffixProposer

N_SAMPLES = 5_000  # chi-square at ALPHA over the 625 4-token continuations; the broken variant gets p ~ 0
SAMPLING = SamplingConfig(temperature=1.0, top_k=4)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def hybrid(target, kind: str, threshold: float = 0.0, cls=HybridProposer, lookup: str = "ngram") -> HybridProposer:
    if kind == "eagle":
        drafter = EagleProposer(target, head=random_head(target, gain=3.0), confidence_threshold=threshold)
    else:
        drafter = MedusaProposer(target, heads=random_heads(target, draft_vocab=4), confidence_threshold=threshold)
    return cls(drafter, lookup=lookup)


class UniformQOnLookups(HybridProposer):
    """Broken: lookup tokens go out with a uniform q, as if drawn at random, instead of one-hot."""

    def propose(self, context, k, sampling, generator):
        draft = super().propose(context, k, sampling, generator)
        if self._source == "drafter" or draft.k == 0:
            return draft
        vocab = self.drafter.target.vocab_size
        return Draft(tokens=draft.tokens, probs=torch.full((1, draft.k, vocab), 1.0 / vocab))


def rounds_of(proposer) -> dict:
    """Which source drafted, summed over every request the proposer starts from now on."""
    states, start = [], proposer.start
    proposer.start = lambda *args: states.append(start(*args)) or states[-1]

    def total() -> dict:
        return {key: sum(s.rounds[key] for s in states) for key in ("lookup", "drafter", "short")}

    return total


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_hybrid_sampling_is_exact_with_every_source(lookup):
    # the drafter is unsure often enough for short rounds (suffix: 1-token drafts, which a corpus
    # of the 5,000 earlier samples would make rare)
    proposer = hybrid(
        tiny_native(vocab=5, seed=0), "eagle", threshold=0.6 if lookup == "ngram" else 0.75, lookup=lookup
    )
    if lookup == "suffix":
        proposer.suffix = SuffixProposer(use_corpus=False)
    rounds = rounds_of(proposer)
    assert proposer_pvalue(proposer.drafter.target, proposer, SAMPLING, N_SAMPLES, n_new=4) > ALPHA
    assert min(rounds().values()) > 200, rounds()  # lookup, drafter and short matches all drafted


def test_a_wrong_q_on_lookup_tokens_is_caught():  # whichever lookup drafted them: the q is the hybrid's
    target = tiny_native(vocab=5, seed=0)
    proposer = hybrid(target, "eagle", threshold=0.6, cls=UniformQOnLookups)
    assert proposer_pvalue(target, proposer, SAMPLING, N_SAMPLES, n_new=4) < ALPHA


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identity(kind, k, lookup):
    target = tiny_native(vocab=6, seed=5, layers=3)
    cfg = GenerationConfig(max_new_tokens=30)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2]
    expected = Decoder(target, None).generate(prompt, cfg).token_ids
    for threshold in (0.0, 0.4):
        proposer = hybrid(target, kind, threshold, lookup=lookup)
        out = Decoder(target, proposer, k=k).generate(prompt, cfg)
        assert out.token_ids == expected
        assert out.stats["hybrid_rounds"]["lookup"] and out.stats["hybrid_rounds"]["drafter"]


def test_lookup_rounds_keep_the_drafter_s_features_without_recomputing():
    target = tiny_native(vocab=6, seed=5, layers=3)
    proposer = hybrid(target, "eagle")
    fills = []
    proposer.drafter._fill = lambda context, needed: fills.append(needed)
    out = Decoder(target, proposer, k=3).generate(
        [1, 2, 3, 4, 1, 2, 3, 0, 1, 2] * 3, GenerationConfig(max_new_tokens=40)
    )
    assert out.stats["hybrid_rounds"]["lookup"] >= 5 and fills == []


def test_bad_settings_and_trees_are_refused():
    target = tiny_native(vocab=6, seed=5, layers=3)
    with pytest.raises(ConfigError, match="min_match"):
        HybridProposer(hybrid(target, "medusa").drafter, min_match=4, max_ngram=3)
    with pytest.raises(ConfigError, match="hybrid lookup must be one of ngram, suffix"):
        HybridProposer(hybrid(target, "medusa").drafter, lookup="suffix-tree")
    with pytest.raises(ConfigError, match="cannot draft trees"):
        Decoder(target, hybrid(target, "medusa"), k=2, tree=TreeConfig(max_nodes=4))


# -- the shipped configuration -------------------------------------------------------------------


def test_hybrid_method_names_its_drafter():
    from real_model import default_target
    from specdecode.api import make_proposer

    loaded = default_target("native")
    assert make_proposer("hybrid", loaded, drafter="eagle").drafter.name == "eagle"
    assert make_proposer("hybrid", loaded).drafter.name in ("eagle", "medusa", "draft")
    with pytest.raises(ConfigError, match="hybrid drafter must be one of"):
        make_proposer("hybrid", loaded, drafter="ngram")


@pytest.mark.slow
def test_shipped_hybrid_greedy_identity_on_real_model():
    from real_model import PROMPTS, chat_ids, default_target
    from specdecode.api import make_proposer

    loaded = default_target("native")
    cfg = GenerationConfig(max_new_tokens=32)
    for drafter in ("eagle", "medusa"):
        proposer = make_proposer("hybrid", loaded, drafter=drafter, confidence_threshold=0.3)
        rounds = {"lookup": 0, "drafter": 0}
        for prompt in (PROMPTS[4], PROMPTS[6], PROMPTS[9]):
            ids = chat_ids(loaded, prompt)
            expected = Decoder(loaded.model, None, eos_token_ids=loaded.eos_token_ids).generate(ids, cfg).token_ids
            out = Decoder(loaded.model, proposer, k=4, eos_token_ids=loaded.eos_token_ids).generate(ids, cfg)
            assert out.token_ids == expected, (drafter, prompt)
            for source in rounds:
                rounds[source] += out.stats["hybrid_rounds"][source]
        assert rounds["lookup"] and rounds["drafter"], rounds


def test_shipped_hybrid_card_names_a_shipped_drafter():
    import json

    from specdecode.networks.storage import DRAFTERS_DIR

    folder = DRAFTERS_DIR / "smollm2-135m-instruct"
    card = json.loads((folder / "hybrid" / "card.json").read_text())
    settings = card["benchmark"]["settings"]
    assert card["method"] == "hybrid" and settings["k"] >= 1
    assert (folder / settings["drafter"] / "model.safetensors").exists()


def test_hybrid_given_a_draft_model_uses_it_as_its_second_source():
    """A target with no trained drafter (the Qwen 1.5B) and a loaded same-tokenizer draft: the
    hybrid looks up where it can, else drafts with that model."""
    from helpers import MarkovLM
    from specdecode.api import make_proposer
    from specdecode.models.loading import LoadedModel

    class Vocab:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    target = LoadedModel(model=MarkovLM(5, seed=0), tokenizer=Vocab(), source="/nowhere/target")
    draft = LoadedModel(model=MarkovLM(5, seed=1), tokenizer=Vocab(), source="/nowhere/draft")
    proposer = make_proposer("hybrid", target, draft)
    assert proposer.drafter.name == "draft"


def test_the_hybrids_lookup_is_suffix_decoding_unless_asked_for_ngram():
    """Suffix decoding measured at least as fast as n-gram lookup in every pairing we have
    (BENCHMARKS.md, session 42), so it is the default; ``lookup="ngram"`` keeps n-gram."""
    target = tiny_native(vocab=5, seed=0)
    drafter = hybrid(target, "medusa").drafter
    assert HybridProposer(drafter).suffix is not None
    assert HybridProposer(drafter, lookup="ngram").suffix is None


def test_a_suffix_lookup_round_is_scored_and_an_ngram_one_is_not():
    """A suffix lookup round keeps suffix decoding's scores and is named a scored source, so the
    engine drafts it first and prices it by them, as it does plain suffix decoding's rounds; an
    n-gram round has no scores to offer."""
    target = tiny_native(vocab=5, seed=0)
    drafter = hybrid(target, "medusa").drafter
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2, 3]
    for lookup, scored in (("suffix", True), ("ngram", False)):
        state = HybridProposer(drafter, lookup=lookup).start(prompt)
        source = state.source(prompt, 4)
        assert source.name == "lookup" and source.scored is scored
        draft = state.propose(prompt, 4, SamplingConfig(), None)
        assert draft.k and (draft.scores is not None) is scored
        assert draft.probs is None  # deterministic: q one-hot, as the scored path requires


def test_a_drafter_round_offers_suffix_decodings_short_draft_as_its_fallback():
    """A round named for the drafter (the lookup drafted fewer than min_match tokens) offers the
    short suffix draft as a scored second source; once taken, the round drafts it. A round the
    lookup covers, or one with no short draft, offers none."""
    target = tiny_native(vocab=5, seed=0)
    drafter = hybrid(target, "medusa").drafter
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2, 3]
    state = HybridProposer(drafter).start(prompt)
    context = prompt + [2]  # "2" follows "1" elsewhere: suffix drafts 1 token, short of min_match 2
    assert state.source(context, 4).name == "drafter"
    second = state.fallback(context)
    assert second is not None and second.name == "lookup" and second.scored
    assert state.source(context, 4) == second  # named again, the round's source is the fallback
    draft = state.propose(context, 4, SamplingConfig(), None)
    assert draft.tokens.tolist() == [[3]] and draft.scores is not None and state.rounds["short"] == 1
    covered = HybridProposer(drafter, lookup="suffix").start(prompt)
    assert covered.source(prompt, 4).name == "lookup" and covered.fallback(prompt) is None
    fresh = HybridProposer(drafter).start([0, 1, 2])
    assert fresh.source([0, 1, 2], 4).name == "drafter" and fresh.fallback([0, 1, 2]) is None  # nothing repeats
