"""Medusa proposer: exact sampling (chi-square), greedy identity, which feature drafts, shipped heads."""

from __future__ import annotations

import hashlib
import json
import types

import pytest
import torch

from helpers import ALPHA, greedy_draft_lengths, proposer_pvalue, tiny_native
from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.engine import Decoder, GenerationConfig, TreeConfig
from specdecode.errors import ConfigError
from specdecode.networks.medusa_heads import MedusaConfig, MedusaHeads
from specdecode.networks.storage import DRAFTERS_DIR, load_head
from specdecode.proposers.medusa import MedusaProposer
from specdecode.train.data import target_features

N_SAMPLES = 2_000  # enough to catch a wrong q at ALPHA (p ~ 0 at 3000), fast enough to run always
SHIPPED = DRAFTERS_DIR / "smollm2-135m-instruct" / "medusa"

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def random_heads(target, seed: int = 0, num_heads: int = 4, draft_vocab: int | None = None) -> MedusaHeads:
    """Random residual blocks; ``draft_vocab`` < vocab keeps a random subset of ids (q is 0 elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads, draft_vocab or vocab))
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=g) * 0.5)
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=g))
        heads.vocab_ids.copy_(torch.randperm(vocab, generator=g)[: heads.cfg.draft_vocab].sort().values)
    return heads.eval()


class WrongTemperature(MedusaProposer):
    """Samples at the request's temperature but reports q at a sharper one."""

    def _reported(self, q, logits, sampling):
        return logits_to_probs(logits, SamplingConfig(temperature=sampling.temperature * 0.3, top_k=sampling.top_k))


def test_medusa_sampling_is_exact():
    target = tiny_native(vocab=5, seed=0)
    proposer = MedusaProposer(target, heads=random_heads(target, draft_vocab=4))
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES) > ALPHA


def test_confidence_stopped_chains_sample_exactly():
    target = tiny_native(vocab=5, seed=0)
    proposer = MedusaProposer(target, heads=random_heads(target, draft_vocab=4), confidence_threshold=0.5)
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES) > ALPHA


def test_confidence_threshold_cuts_chains():
    target = tiny_native(vocab=6, seed=5, layers=3)
    heads = random_heads(target, draft_vocab=5)
    lengths = greedy_draft_lengths(
        lambda t: MedusaProposer(target, heads=heads, confidence_threshold=t), (0.0, 0.5, 0.999)
    )
    assert lengths[0] == heads.cfg.num_heads and lengths[2] == 0 and lengths[0] >= lengths[1] >= lengths[2]


def test_wrong_temperature_q_is_caught():
    target = tiny_native(vocab=5, seed=0)
    proposer = WrongTemperature(target, heads=random_heads(target, draft_vocab=4))
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES) < ALPHA


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identity_chain_and_tree(k):
    target = tiny_native(vocab=6, seed=5, layers=3)
    cfg = GenerationConfig(max_new_tokens=30)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2]
    expected = Decoder(target, None).generate(prompt, cfg).token_ids
    for tree, threshold in ((None, 0.0), (None, 0.4), (TreeConfig(max_nodes=3 * k), 0.0)):
        heads = random_heads(target, seed=k, draft_vocab=5)
        proposer = MedusaProposer(target, heads=heads, branch=2, confidence_threshold=threshold)
        assert Decoder(target, proposer, k=k, tree=tree).generate(prompt, cfg).token_ids == expected


def test_draft_token_one_is_head_zero_on_the_last_known_feature():
    """Head i on the target's own h_{n-2} (the last fed position) proposes draft token i+1 = x_{n+i}."""
    target = tiny_native(vocab=6, seed=5, layers=3)
    heads = random_heads(target, seed=1, num_heads=3)
    context = [1, 2, 3, 4, 1, 2, 5, 0]
    proposer = MedusaProposer(target, heads=heads)
    proposer.reset(context[:-1])
    ids = torch.tensor(context[:-1])
    _, hidden = target.forward(ids.unsqueeze(0), target.new_cache(16), return_hidden=True)
    proposer.observe_forward(ids, torch.arange(len(ids)), None, hidden)  # the prefill, as the engine hands it over
    draft = proposer.propose(context, 5, SamplingConfig(), None)
    fresh = target_features(target, context[:-1])[-1]
    assert draft.k == 3  # one token per head, however large k is
    assert draft.tokens[0].tolist() == heads.vocab_ids[heads(fresh).argmax(-1)].tolist()


def test_tree_is_best_first_and_prefix_closed():
    target = tiny_native(vocab=6, seed=5, layers=3)
    proposer = MedusaProposer(target, heads=random_heads(target, seed=2), branch=3)
    context = [1, 2, 3, 4, 1, 2, 5, 0]
    proposer.reset(context[:-1])
    paths = proposer.propose_tree(context, 3, 10)
    nodes = {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}
    assert len(nodes) == 10 and max(len(p) for p in paths) <= 3
    with torch.no_grad():
        probs = torch.softmax(proposer.heads(proposer.feats[len(context) - 2], 3), -1)
    index = {int(t): i for i, t in enumerate(proposer.heads.vocab_ids)}

    def score(path):
        return float(torch.prod(torch.stack([probs[d, index[t]] for d, t in enumerate(path)])))

    chosen = min(score(n) for n in nodes)
    frontier = [n + (t,) for n in list(nodes) + [()] if len(n) < 3 for t in range(6) if n + (t,) not in nodes]
    assert all(score(f) <= chosen + 1e-6 for f in frontier)  # nothing left out beats what was kept


def test_missing_features_are_recomputed():
    """Without the target's forwards, drafts come from the private feature forward and stay the same."""
    target = tiny_native(vocab=6, seed=5, layers=3)
    heads = random_heads(target, seed=3)
    context = [1, 2, 3, 4, 1, 2, 5, 0]
    a = MedusaProposer(target, heads=heads)
    a.reset(context[:-1])
    ids = torch.tensor(context[:-1])
    _, hidden = target.forward(ids.unsqueeze(0), target.new_cache(16), return_hidden=True)
    a.observe_forward(ids, torch.arange(len(ids)), None, hidden)
    first = a.propose(context, 4, SamplingConfig(), None).tokens
    b = MedusaProposer(target, heads=heads)
    b.reset(context[:-1])
    assert torch.equal(first, b.propose(context, 4, SamplingConfig(), None).tokens)


def test_needs_native_backend_and_heads(tmp_path):
    from helpers import tiny_llama
    from specdecode.api import make_proposer

    with pytest.raises(ConfigError):
        MedusaProposer(tiny_llama(vocab=5), heads=None)
    with pytest.raises(ConfigError, match="no trained medusa drafter"):
        make_proposer("medusa", types.SimpleNamespace(source=str(tmp_path), model=None), draft=str(tmp_path))


# -- the shipped heads ---------------------------------------------------------------------------


def test_shipped_heads_load_and_match_card():
    assert SHIPPED.is_dir(), "the default model's Medusa heads must ship with the package"
    heads, card = load_head(SHIPPED, MedusaHeads)
    weights = SHIPPED / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == card["weights_sha256"]
    assert card["config"] == json.loads(json.dumps(heads.cfg.__dict__))
    assert card["method"] == "medusa" and card["steps"] > 0 and card["num_heads"] == heads.cfg.num_heads
    assert card["heldout"]["mean_accepted_length"] >= 1.0
    assert card["reproduce"].startswith("specdecode train medusa")
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) <= 4 * 1024 * 1024


@pytest.mark.slow
def test_shipped_heads_greedy_identity_on_real_model():
    from real_model import PROMPTS, chat_ids, default_target
    from specdecode.api import make_proposer

    loaded = default_target("native")
    cfg = GenerationConfig(max_new_tokens=24)
    accepted = []
    for prompt in PROMPTS[:2]:
        ids = chat_ids(loaded, prompt)
        expected = Decoder(loaded.model, None, eos_token_ids=loaded.eos_token_ids).generate(ids, cfg).token_ids
        for tree in (None, TreeConfig(max_nodes=16)):
            decoder = Decoder(
                loaded.model, make_proposer("medusa", loaded), k=4, tree=tree, eos_token_ids=loaded.eos_token_ids
            )
            out = decoder.generate(ids, cfg)
            assert out.token_ids == expected, (prompt, tree)
            accepted.append(out.stats["mean_accepted_length"])
    assert sum(accepted) / len(accepted) > 1.2  # trained heads, not random ones


def test_packed_drafting_matches_the_plain_heads():
    """The prepacked draft kernels against the plain float32 heads they copy."""
    target = tiny_native(vocab=6, seed=5, layers=3)
    if target.weights.linear is torch.nn.functional.linear:
        pytest.skip("this torch build has no oneDNN packing")
    heads = random_heads(target, draft_vocab=5)
    heads.attach(target)
    feats = torch.randn(heads.cfg.hidden)
    with torch.no_grad():
        plain = [heads(feats, n) for n in (1, 3)]
        heads.pack_for_drafting(target)
        fast = [heads(feats, n) for n in (1, 3)]
    for a, b in zip(plain, fast):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    heads.train()
    assert heads._packed is None  # training drops the snapshot
