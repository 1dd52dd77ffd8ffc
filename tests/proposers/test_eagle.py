"""EAGLE proposer: exact sampling (chi-square), greedy identity, feature bookkeeping, shipped head."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from helpers import ALPHA, greedy_draft_lengths, proposer_pvalue, started_states, tiny_native
from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.engine import Decoder, GenerationConfig, TreeConfig
from specdecode.networks.eagle_head import EagleHead, HeadConfig
from specdecode.networks.storage import DRAFTERS_DIR, load_head
from specdecode.proposers.eagle import EagleProposer
from specdecode.train.data import target_features

N_SAMPLES = 3_000  # every broken variant in this file is rejected at ALPHA with this many (20,000 before)
SHIPPED = DRAFTERS_DIR / "smollm2-135m-instruct" / "eagle"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def random_head(target, seed: int = 0, gain: float = 1.0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(target, draft_vocab=target.vocab_size))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.mul_(gain)
    return head.eval()


class WrongTemperature(EagleProposer):
    """Samples from q at the request's temperature but reports q at a sharper one."""

    def _reported(self, q, feature, sampling):
        wrong = SamplingConfig(temperature=sampling.temperature * 0.3, top_k=sampling.top_k)
        return logits_to_probs(self.head.logits(feature), wrong)


def test_eagle_sampling_is_exact():
    target = tiny_native(vocab=5, seed=0)
    proposer = EagleProposer(target, head=random_head(target, gain=3.0))
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES) > ALPHA


def test_confidence_stopped_chains_sample_exactly():
    target = tiny_native(vocab=5, seed=0)
    proposer = EagleProposer(target, head=random_head(target, gain=3.0), confidence_threshold=0.6)
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES) > ALPHA


def test_confidence_threshold_cuts_chains():
    target = tiny_native(vocab=6, seed=5, layers=3)
    head = random_head(target, gain=3.0)
    lengths = greedy_draft_lengths(
        lambda t: EagleProposer(target, head=head, confidence_threshold=t), (0.0, 0.6, 0.999)
    )
    assert lengths[0] == 6 and lengths[2] == 0 and lengths[0] >= lengths[1] >= lengths[2]


def test_wrong_temperature_q_is_caught():
    target = tiny_native(vocab=5, seed=0)
    proposer = WrongTemperature(target, head=random_head(target, gain=3.0))
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES) < ALPHA


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identity_chain_and_tree(k):
    target = tiny_native(vocab=6, seed=5, layers=3)
    cfg = GenerationConfig(max_new_tokens=30)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2]
    expected = Decoder(target, None).generate(prompt, cfg).token_ids
    for tree, threshold in ((None, 0.0), (None, 0.5), (TreeConfig(max_nodes=3 * k), 0.0)):
        head = random_head(target, seed=k, gain=3.0)
        proposer = EagleProposer(target, head=head, branch=2, confidence_threshold=threshold)
        assert Decoder(target, proposer, k=k, tree=tree).generate(prompt, cfg).token_ids == expected


@pytest.mark.parametrize("tree", [False, True])
def test_features_match_a_fresh_target_forward(tree):
    """The features kept from verify forwards (chains and trees) are the target's own."""
    target = tiny_native(vocab=6, seed=5, layers=3)
    proposer = EagleProposer(target, head=random_head(target, gain=3.0), branch=2)
    decoder = Decoder(target, proposer, k=3, tree=TreeConfig(max_nodes=6) if tree else None)
    prompt = [1, 2, 3, 4, 1, 2]
    states = started_states(proposer)
    out = decoder.generate(prompt, GenerationConfig(max_new_tokens=20)).token_ids
    context = prompt + out
    (proposer,) = states
    proposer._absorb(context)
    n = min(proposer.nfeat, len(context))
    assert n >= len(context) - 2  # everything verified so far (the last tokens were never fed)
    fresh = target_features(target, context[:n])
    torch.testing.assert_close(proposer.feats[:n], fresh, atol=1e-4, rtol=1e-4)


def test_missing_features_are_recomputed():
    """Without the target's forwards, drafts come from the private feature forward and stay the same."""
    target = tiny_native(vocab=6, seed=5, layers=3)
    head = random_head(target, gain=3.0)
    context = [1, 2, 3, 4, 1, 2, 5, 0]
    greedy = SamplingConfig()
    a = EagleProposer(target, head=head)
    a.reset(context[:-1])
    ids = torch.tensor(context[:-1])
    _, hidden = target.forward(ids.unsqueeze(0), target.new_cache(16), return_hidden=True)
    a.observe_forward(ids, torch.arange(len(ids)), None, hidden)  # what the engine hands over
    first = a.propose(context, 4, greedy, None).tokens
    b = EagleProposer(target, head=head)
    b.reset(context[:-1])
    second = b.propose(context, 4, greedy, None).tokens
    assert torch.equal(first, second)


def test_rounds_sat_out_are_read_from_the_target_forwards_not_recomputed():
    """Ten plain forwards pass before the proposer drafts (speculation off, or another proposer
    drafting): their rows are absorbed then, and the drafts match a full recompute's."""
    target = tiny_native(vocab=6, seed=5, layers=3)
    head = random_head(target, gain=3.0)
    context = [1, 2, 3, 4, 1, 2, 5, 0, 3, 1, 4, 2, 5, 1]
    a = EagleProposer(target, head=head)
    a.reset(context[:4])
    fills = []
    real_fill = a._fill
    a._fill = lambda ctx, needed: fills.append(needed) or real_fill(ctx, needed)
    cache = target.new_cache(32)
    for piece in [context[:4]] + [[t] for t in context[4:-1]]:
        start = cache.length
        _, hidden = target.forward(torch.tensor([piece]), cache, return_hidden=True)
        a.observe_forward(torch.tensor(piece), torch.arange(start, start + len(piece)), None, hidden)
    drafted = a.propose(context, 4, SamplingConfig(), None).tokens
    b = EagleProposer(target, head=head)
    b.reset(context)
    assert fills == [] and torch.equal(drafted, b.propose(context, 4, SamplingConfig(), None).tokens)


def test_asking_twice_for_the_same_context_drafts_the_same():
    target = tiny_native(vocab=6, seed=5, layers=3)
    proposer = EagleProposer(target, head=random_head(target, gain=3.0))
    context = [1, 2, 3, 4, 1, 2]
    proposer.reset(context)
    first = proposer.propose(context, 3, SamplingConfig(), None).tokens
    assert torch.equal(proposer.propose(context, 3, SamplingConfig(), None).tokens, first)


def test_needs_native_backend():
    from helpers import tiny_llama
    from specdecode.errors import ConfigError

    hf = tiny_llama(vocab=5)
    with pytest.raises(ConfigError):
        EagleProposer(hf, head=None, path=None)


# -- the shipped head ----------------------------------------------------------------------------


def test_shipped_head_loads_and_matches_card():
    assert SHIPPED.is_dir(), "the default model's EAGLE head must ship with the package"
    head, card = load_head(SHIPPED)
    weights = SHIPPED / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == card["weights_sha256"]
    assert card["config"] == json.loads(json.dumps(head.cfg.__dict__))
    assert card["method"] == "eagle" and card["steps"] > 0
    assert card["heldout"]["mean_accepted_length"] >= 1.0
    assert "reproduce" in card and card["reproduce"].startswith("specdecode train eagle")
    total = sum(f.stat().st_size for f in DRAFTERS_DIR.rglob("*") if f.is_file())
    assert total <= 25 * 1024 * 1024


@pytest.mark.slow
def test_shipped_head_greedy_identity_on_real_model():
    from real_model import PROMPTS, chat_ids, default_target
    from specdecode.api import make_proposer

    loaded = default_target("native")
    cfg = GenerationConfig(max_new_tokens=32)
    accepted = []
    for prompt in PROMPTS[:5]:
        ids = chat_ids(loaded, prompt)
        expected = Decoder(loaded.model, None, eos_token_ids=loaded.eos_token_ids).generate(ids, cfg).token_ids
        for tree in (None, TreeConfig(max_nodes=16)):
            proposer = make_proposer("eagle", loaded)
            out = Decoder(loaded.model, proposer, k=4, tree=tree, eos_token_ids=loaded.eos_token_ids).generate(ids, cfg)
            assert out.token_ids == expected, (prompt, tree)
            accepted.append(out.stats["mean_accepted_length"])
    assert sum(accepted) / len(accepted) > 1.5  # a trained head, not a random one


@pytest.mark.slow
def test_cli_generate_with_shipped_eagle(capsys):
    from specdecode.cli import main

    argv = ["generate", "List three uses of copper.", "--method", "eagle", "--max-new-tokens", "16", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["method"] == "eagle" and out["stats"]["new_tokens"] == 16
    assert main(argv[:-1] + ["--tree", "--temperature", "0.8", "--seed", "1"]) == 0


def test_packed_drafting_matches_the_plain_head():
    """The prepacked draft-step kernels against the plain float32 layer they copy."""
    target = tiny_native(vocab=6, seed=5, layers=3)
    if target.weights.linear is torch.nn.functional.linear:
        pytest.skip("this torch build has no oneDNN packing")
    head = random_head(target, gain=3.0)
    head.attach(target)
    feats, embeds, positions = torch.randn(1, 5, head.cfg.hidden), torch.randn(1, 5, head.cfg.hidden), torch.arange(5)
    with torch.no_grad():
        plain = head(feats, embeds, positions), head.logits(feats)
        head.pack_for_drafting(target)
        fast = head(feats, embeds, positions), head.logits(feats)
    for a, b in zip(plain, fast):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    head.train()
    assert head._drafting() is None  # training drops the snapshot
