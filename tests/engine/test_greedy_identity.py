"""Greedy speculative decoding must be token-identical to plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

from helpers import MarkovLM, tiny_llama, tiny_native
from specdecode.engine import Decoder, GenerationConfig, TreeConfig
from specdecode.proposers import DraftModelProposer, NgramProposer
from specdecode.proposers.lookahead import LookaheadProposer

GREEDY = GenerationConfig(max_new_tokens=40)
PROMPT = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2]


def plain(target, prompt, cfg=GREEDY):
    return Decoder(target, None).generate(prompt, cfg).token_ids


@pytest.fixture(scope="module")
def tiny_models():
    torch.set_num_threads(1)
    return {
        "markov": (MarkovLM(6, seed=3), MarkovLM(6, seed=4)),
        "llama": (tiny_llama(vocab=6, seed=5, layers=2), tiny_llama(vocab=6, seed=6, layers=1)),
        "native": (tiny_native(vocab=6, seed=5, layers=3), tiny_native(vocab=6, seed=6, layers=1)),
    }


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("kind", ["markov", "llama", "native"])
def test_tiny_models_all_k(kind, k, tiny_models):
    target, draft = tiny_models[kind]
    expected = plain(target, PROMPT)
    for proposer in (
        NgramProposer(),
        DraftModelProposer(draft),
        DraftModelProposer(target),
        *_native_only(kind, target),
    ):
        out = Decoder(target, proposer, k=k).generate(PROMPT, GREEDY)
        assert out.token_ids == expected, proposer.name
    if kind != "llama":  # trees need attention masks: the table model and the native backend
        tree = TreeConfig(max_nodes=3 * k)
        for proposer in (NgramProposer(), DraftModelProposer(draft), LookaheadProposer(window=4, ngram=3)):
            out = Decoder(target, proposer, k=k, tree=tree).generate(PROMPT, GREEDY)
            assert out.token_ids == expected, f"{proposer.name} tree"


def _native_only(kind, target):
    if kind != "native":
        return ()
    from specdecode.proposers.early_exit import EarlyExitProposer

    return (EarlyExitProposer(target, layers=1), EarlyExitProposer(target, layers=2))


def test_self_draft_accepts_everything(tiny_models):
    target, _ = tiny_models["llama"]
    out = Decoder(target, DraftModelProposer(target), k=4).generate(PROMPT, GREEDY)
    assert out.stats["acceptance_rate"] == 1.0
    assert out.stats["mean_accepted_length"] > 4.0  # 5 per full round; the last round is shorter


def test_metrics_are_consistent(tiny_models):
    target, draft = tiny_models["llama"]
    s = Decoder(target, DraftModelProposer(draft), k=3).generate(PROMPT, GREEDY).stats
    assert s["new_tokens"] == 40
    assert s["accepted_tokens"] <= s["drafted_tokens"] <= 3 * s["target_calls"]
    hist = {int(n): c for n, c in s["accepted_length_histogram"].items()}
    assert sum(hist.values()) <= s["target_calls"]  # rounds that drafted at least one token
    assert sum(n * c for n, c in hist.items()) == s["accepted_tokens"]
    assert len(s["per_position_acceptance"]) == 3
    assert all(0 <= a <= 1 for a in s["per_position_acceptance"])
    assert s["target_calls_per_token"] == pytest.approx(s["target_calls"] / 40)
