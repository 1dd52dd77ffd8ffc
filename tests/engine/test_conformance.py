"""Statistical conformance: speculative sampling must reproduce the target's sequence law exactly.

Tiny models with enumerable outputs (vocab 5-6, 3-4 new tokens); 3,000 sampled sequences per
case; Pearson chi-square at significance level ALPHA = 0.001. Every broken verifier below must be
rejected by the same test, so the test is shown able to fail.
"""

from __future__ import annotations

import pytest
import torch

from helpers import ALPHA, MarkovLM, chi_square_pvalue, sample_sequences, sequence_law, tiny_llama
from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.core.verify import Draft, Verification, draft_probs_or_onehot
from specdecode.engine import Decoder
from specdecode.proposers import DraftModelProposer, NgramProposer

N_SAMPLES = 3_000  # every broken variant in this file is rejected at ALPHA with this many (20,000 before)
PROMPT = [1, 2, 3, 1, 2, 0, 1]  # repeats, so n-gram lookup finds matches

# Temperatures 0.5, 1 and 1.5, with top-k and top-p folded into the outer two.
SAMPLINGS = {
    "t0.5-topk3": SamplingConfig(temperature=0.5, top_k=3),
    "t1.0": SamplingConfig(temperature=1.0),
    "t1.5-topp0.8": SamplingConfig(temperature=1.5, top_p=0.8),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def markov_pair():
    return MarkovLM(5, seed=11), MarkovLM(5, seed=12, sharpness=1.0)


def conformance_pvalue(target, proposer, sampling: SamplingConfig, k: int = 3, n_new: int = 4) -> float:
    decoder = Decoder(target, proposer, k=k)
    counts = sample_sequences(decoder, PROMPT, n_new, sampling, N_SAMPLES)
    return chi_square_pvalue(counts, sequence_law(target, PROMPT, n_new, sampling))


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_draft_model_proposer_is_exact(name):
    target, draft = markov_pair()
    assert conformance_pvalue(target, DraftModelProposer(draft), SAMPLINGS[name]) > ALPHA


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_ngram_proposer_is_exact(name):
    target, _ = markov_pair()
    assert conformance_pvalue(target, NgramProposer(), SAMPLINGS[name]) > ALPHA


def test_tiny_transformer_draft_is_exact():
    target, draft = tiny_llama(vocab=5, seed=0), tiny_llama(vocab=5, seed=1)
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    assert conformance_pvalue(target, DraftModelProposer(draft), sampling, k=2, n_new=3) > ALPHA


def test_tiny_transformer_draft_reading_a_window_of_the_prompt_is_exact():
    """``prompt_window=1`` skips two of the prompt's seven tokens: the draft's q changes, and
    what it reports is still what it drew from (a misreported q is what the broken drafts below
    stand for)."""
    target, draft = tiny_llama(vocab=5, seed=0), tiny_llama(vocab=5, seed=1)
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    proposer = DraftModelProposer(draft, prompt_window=1)
    assert proposer.start(PROMPT).dropped == 2
    assert conformance_pvalue(target, proposer, sampling, k=2, n_new=3) > ALPHA


def test_hybrid_with_k_planned_per_source_is_exact():
    """The hybrid (n-gram lookup, else a draft model) under the batch planner: each round's k is
    chosen from the estimates of the source it names (lookup or drafter), and the draft model
    reads the context only before its own rounds. Both sources draft over a thousand rounds,
    and the law is the target's."""
    from specdecode.engine.policy import make_policy
    from specdecode.proposers.hybrid import HybridProposer

    target, draft = tiny_llama(vocab=5, seed=0), tiny_llama(vocab=5, seed=1)
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    states = []
    proposer = HybridProposer(DraftModelProposer(draft), lookup="ngram")
    start = proposer.start
    proposer.start = lambda *args: states.append(start(*args)) or states[-1]
    decoder = Decoder(target, proposer, policy=make_policy("auto", 3))
    for n in (1, 200):  # a flat curve of slow forwards, so both sources draft at varied k
        decoder.memory.costs.observe(n, 1.0 + 0.0001 * n)
    decoder.memory.costs.ema = 0.0
    decoder.memory.costs.forget_after = 1 << 30  # nor forget it
    prompt = [1, 2, 3, 4, 0, 1, 2]  # its tail repeats: the first round looks up, later ones draft
    counts = sample_sequences(decoder, prompt, 3, sampling, N_SAMPLES)
    assert chi_square_pvalue(counts, sequence_law(target, prompt, 3, sampling)) > ALPHA
    rounds = {key: sum(s.rounds[key] for s in states) for key in ("lookup", "drafter")}
    assert min(rounds.values()) > 1000, rounds


def test_tiny_transformer_ngram_is_exact():
    target = tiny_llama(vocab=5, seed=2)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    assert conformance_pvalue(target, NgramProposer(), sampling, k=2, n_new=3) > ALPHA


# -- broken variants: the same test must catch each ----------------------------------------------


def _broken_verify(no_residual: bool = False, bonus_from_draft: bool = False):
    """A verifier with one deliberate bug, same signature as ``verify_sampling``."""

    def verify(draft: Draft, target_probs: torch.Tensor, generator=None) -> Verification:
        k, vocab = draft.k, target_probs.shape[-1]
        q = draft_probs_or_onehot(draft, vocab)[0]
        p = target_probs[0]
        for i in range(k):
            x = int(draft.tokens[0, i])
            if torch.rand(1, generator=generator).item() * q[i, x] >= p[i, x]:
                dist = p[i] if no_residual else (p[i] - q[i]).clamp_min(0)
                return Verification(torch.tensor([i]), sample(dist.unsqueeze(0) / dist.sum(), generator))
        bonus = q[k - 1] if bonus_from_draft and k > 0 else p[k]
        return Verification(torch.tensor([k]), sample(bonus.unsqueeze(0), generator))

    return verify


class WrongTemperatureDraft(DraftModelProposer):
    """Samples drafts at the request's temperature but reports q at temperature 1."""

    def propose(self, context, k, sampling, generator):
        logits = self._sync(context)
        tokens, probs = [], []
        for i in range(k):
            x = sample(logits_to_probs(logits, sampling), generator)
            tokens.append(x)
            probs.append(logits_to_probs(logits, SamplingConfig(temperature=1.0)))
            if i + 1 < k:
                logits = self.model.forward(x.view(1, 1), self.cache)[:, -1]
                self.cached.append(int(x))
        return Draft(torch.stack(tokens, dim=1), torch.stack(probs, dim=1))


@pytest.mark.parametrize("bug", ["no_residual", "bonus_from_draft"])
def test_broken_verifier_is_caught(bug, monkeypatch):
    import specdecode.engine.request as loop

    monkeypatch.setattr(loop, "verify_sampling", _broken_verify(**{bug: True}))
    target, draft = markov_pair()
    assert conformance_pvalue(target, DraftModelProposer(draft), SAMPLINGS["t1.0"]) < ALPHA


def test_broken_ngram_residual_is_caught(monkeypatch):
    import specdecode.engine.request as loop

    monkeypatch.setattr(loop, "verify_sampling", _broken_verify(no_residual=True))
    target, _ = markov_pair()
    assert conformance_pvalue(target, NgramProposer(), SAMPLINGS["t1.0"]) < ALPHA


def test_draft_probabilities_at_wrong_temperature_are_caught():
    target, draft = markov_pair()
    assert conformance_pvalue(target, WrongTemperatureDraft(draft), SAMPLINGS["t0.5-topk3"]) < ALPHA


# -- the native backend passes the same conformance tests ----------------------------------------


def test_native_draft_model_is_exact():
    from helpers import tiny_native

    target, draft = tiny_native(vocab=5, seed=0), tiny_native(vocab=5, seed=1, layers=1)
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    assert conformance_pvalue(target, DraftModelProposer(draft), sampling, k=2, n_new=3) > ALPHA


def _cut_native_draft():
    """A native draft whose head keeps tokens 0 and 1: each request adds the others its context
    holds (PROMPT's 2 and 3 at once, 4 once committed), so a round's q covers a growing set."""
    from helpers import tiny_native
    from specdecode.models.native import restrict_output

    target = tiny_native(vocab=5, seed=0)
    draft = restrict_output(tiny_native(vocab=5, seed=1, layers=1, pack=False), torch.tensor([0, 1]))
    assert draft.caps.columns
    return target, draft


def test_native_draft_with_a_cut_head_and_its_contexts_tokens_is_exact():
    target, draft = _cut_native_draft()
    sampling = SamplingConfig(temperature=1.0)
    assert conformance_pvalue(target, DraftModelProposer(draft), sampling, k=2, n_new=3) > ALPHA


def test_a_cut_draft_reporting_q_without_its_contexts_columns_is_caught():
    """Drawing over the context's columns but reporting q over the static head alone (renormalised
    there) is the bug this path invites; the same test rejects it."""
    from specdecode.core.sampling import to_vocab

    class Forgets(DraftModelProposer):
        def _reported(self, q):
            static = q[..., : len(self.vocab_ids)]
            return to_vocab(static / static.sum(-1, keepdim=True), self.vocab_ids, self.model.vocab_size)

    target, draft = _cut_native_draft()
    assert conformance_pvalue(target, Forgets(draft), SAMPLINGS["t1.0"], k=2, n_new=3) < ALPHA


def test_native_early_exit_is_exact():
    from helpers import tiny_native
    from specdecode.proposers.early_exit import EarlyExitProposer

    target = tiny_native(vocab=5, seed=3, layers=3)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    assert conformance_pvalue(target, EarlyExitProposer(target, layers=1), sampling, k=2, n_new=3) > ALPHA


def test_native_early_exit_wrong_temperature_is_caught():
    """The early-exit path through a broken draft distribution is caught too."""
    from helpers import tiny_native
    from specdecode.proposers.early_exit import EarlyExitProposer

    class Broken(EarlyExitProposer, WrongTemperatureDraft):
        pass

    target = tiny_native(vocab=5, seed=3, layers=3)
    assert conformance_pvalue(target, Broken(target, layers=1), SAMPLINGS["t0.5-topk3"], k=2, n_new=3) < ALPHA
