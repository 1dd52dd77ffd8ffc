"""Tree drafting in the decode loop: greedy identity, sampling conformance, broken variants.

Conformance: 3,000 sequences per case, chi-square at significance level ALPHA = 0.001.
"""

from __future__ import annotations

import pytest
import torch

from helpers import ALPHA, MarkovLM, chi_square_pvalue, sample_sequences, sequence_law
from specdecode.core.sampling import SamplingConfig
from specdecode.core.tree import TreeVerification
from specdecode.engine import Decoder, GenerationConfig, TreeConfig
from specdecode.errors import ConfigError
from specdecode.proposers import NgramProposer
from specdecode.proposers.base import PerRequest, ProposerCaps

PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 0, 1]  # "1 2" is followed by 3, 4 and 0: a branching tree
N_SAMPLES = 3_000  # the correct variants, and the broken ones but one (20,000 before)
N_SUBTLE = 20_000  # keeping rejected siblings' mass is subtle here: p = 0.04 at 3,000, so it keeps 20,000


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def tree_pvalue(sampling: SamplingConfig, n: int = N_SAMPLES) -> float:
    target = MarkovLM(5, seed=21)
    decoder = Decoder(target, NgramProposer(max_ngram=2), k=3, tree=TreeConfig(max_nodes=8))
    counts = sample_sequences(decoder, PROMPT, 4, sampling, n)
    return chi_square_pvalue(counts, sequence_law(target, PROMPT, 4, sampling))


def test_ngram_tree_greedy_identical():
    target = MarkovLM(5, seed=21)
    cfg = GenerationConfig(max_new_tokens=30)
    plain = Decoder(target, None).generate(PROMPT, cfg).token_ids
    out = Decoder(target, NgramProposer(max_ngram=2), k=4, tree=TreeConfig(max_nodes=12)).generate(PROMPT, cfg)
    assert out.token_ids == plain and out.stats["tree_nodes"] > 0


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_ngram_tree_sampling_is_exact(temperature):
    assert tree_pvalue(SamplingConfig(temperature=temperature)) > ALPHA


def _broken_tree_verify(keep_rejected_siblings: bool = False, resample_from_p: bool = False):
    def verify(tree, target_probs, generator=None):
        kids, tokens = tree.children(), tree.tokens.tolist()
        path = [0]
        while True:
            node = path[-1]
            p = target_probs[node].float()
            residual = p.clone()
            for child in kids[node]:
                x = tokens[child - 1]
                ref = p if keep_rejected_siblings else residual / residual.sum()
                if float(torch.rand((), generator=generator)) < float(ref[x]):
                    path.append(child)
                    break
                residual[x] = 0.0
            else:
                dist = p if resample_from_p else residual / residual.sum()
                return TreeVerification(path, int(torch.multinomial(dist, 1, generator=generator)))

    return verify


@pytest.mark.parametrize("bug", ["keep_rejected_siblings", "resample_from_p"])
def test_broken_tree_verifiers_are_caught(bug, monkeypatch):
    import specdecode.engine.request as loop

    monkeypatch.setattr(loop, "verify_tree_sampling", _broken_tree_verify(**{bug: True}))
    n = N_SUBTLE if bug == "keep_rejected_siblings" else N_SAMPLES
    assert tree_pvalue(SamplingConfig(temperature=1.0), n) < ALPHA


def test_tree_refused_for_chain_only_proposer_or_backend():
    from helpers import tiny_llama

    class ChainOnly(PerRequest):
        name = "chain-only"
        caps = ProposerCaps(trees=False)

    with pytest.raises(ConfigError, match="cannot draft trees"):
        Decoder(MarkovLM(5, seed=0), ChainOnly(), k=2, tree=TreeConfig())
    with pytest.raises(ConfigError, match="cannot verify trees"):
        Decoder(tiny_llama(), NgramProposer(), k=2, tree=TreeConfig())


# -- lookahead (Jacobi side branch in the tree forward) -------------------------------------------


def test_lookahead_greedy_identical_and_accepts_on_repetitive_model():
    from specdecode.proposers.lookahead import LookaheadProposer

    target = MarkovLM(5, seed=21, sharpness=4.0)  # sharp: Jacobi iterates converge quickly
    cfg = GenerationConfig(max_new_tokens=60)
    plain = Decoder(target, None).generate(PROMPT, cfg).token_ids
    out = Decoder(target, LookaheadProposer(window=5, ngram=3), k=4, tree=TreeConfig(max_nodes=12)).generate(
        PROMPT, cfg
    )
    assert out.token_ids == plain
    assert out.stats["accepted_tokens"] > 0 and out.stats["mean_accepted_length"] > 1.2


@pytest.mark.parametrize("temperature", [1.0])
def test_lookahead_sampling_is_exact(temperature):
    from specdecode.proposers.lookahead import LookaheadProposer

    target = MarkovLM(5, seed=21)
    sampling = SamplingConfig(temperature=temperature)
    decoder = Decoder(target, LookaheadProposer(window=4, ngram=3), k=3, tree=TreeConfig(max_nodes=8))
    counts = sample_sequences(decoder, PROMPT, 4, sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, sequence_law(target, PROMPT, 4, sampling)) > ALPHA


def test_broken_lookahead_verifier_is_caught(monkeypatch):
    import specdecode.engine.request as loop
    from specdecode.proposers.lookahead import LookaheadProposer

    monkeypatch.setattr(loop, "verify_tree_sampling", _broken_tree_verify(resample_from_p=True))
    target = MarkovLM(5, seed=21)
    sampling = SamplingConfig(temperature=1.0)
    decoder = Decoder(target, LookaheadProposer(window=4, ngram=3), k=3, tree=TreeConfig(max_nodes=8))
    counts = sample_sequences(decoder, PROMPT, 4, sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, sequence_law(target, PROMPT, 4, sampling)) < ALPHA


# -- draft-model trees (dynamic by cumulative probability, or static rank paths) ------------------


@pytest.mark.parametrize("static", [None, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]])
def test_draft_tree_greedy_identical(static):
    from specdecode.proposers import DraftModelProposer

    target, draft = MarkovLM(5, seed=21), MarkovLM(5, seed=22)
    cfg = GenerationConfig(max_new_tokens=40)
    plain = Decoder(target, None).generate(PROMPT, cfg).token_ids
    proposer = DraftModelProposer(draft, branch=2, static_tree=static)
    out = Decoder(target, proposer, k=3, tree=TreeConfig(max_nodes=10)).generate(PROMPT, cfg)
    assert out.token_ids == plain and out.stats["tree_nodes"] > 0


def test_draft_tree_sampling_is_exact():
    from specdecode.proposers import DraftModelProposer

    target, draft = MarkovLM(5, seed=21), MarkovLM(5, seed=22, sharpness=1.0)
    sampling = SamplingConfig(temperature=1.0)
    decoder = Decoder(target, DraftModelProposer(draft, branch=2), k=3, tree=TreeConfig(max_nodes=6))
    counts = sample_sequences(decoder, PROMPT, 4, sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, sequence_law(target, PROMPT, 4, sampling)) > ALPHA
