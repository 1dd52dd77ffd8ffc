"""Distilled draft model: exact sampling over a reduced vocabulary (chi-square), greedy identity, shipped draft."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from helpers import ALPHA, proposer_pvalue, tiny_native
from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.engine import Decoder, GenerationConfig, TreeConfig
from specdecode.errors import ConfigError
from specdecode.models.loading import LoadedModel
from specdecode.networks.draft_model import MATRICES, DistilledDraft, DraftConfig, ReducedVocabLM, load_distilled
from specdecode.networks.storage import DRAFTERS_DIR, load_head
from specdecode.proposers import DraftModelProposer

N_SAMPLES = 3_000  # the broken variant below fails outright (p = 0); kept small for speed
PROMPT = [1, 2, 3, 1, 2, 0, 1]
VOCAB_IDS = (0, 2, 3, 5)  # the draft never proposes 1 or 4: the target must still produce them
SHIPPED = DRAFTERS_DIR / "smollm2-135m-instruct" / "draft"

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread is fastest


def tiny_draft(target, layers=(0,), vocab_ids=VOCAB_IDS, seed: int = 0, gain: float = 0.5) -> ReducedVocabLM:
    """A distilled draft over ``target`` with random deltas (so it disagrees with the target)."""
    torch.manual_seed(seed)
    draft = DistilledDraft(DraftConfig.for_target(target, layers, rank=4, draft_vocab=len(vocab_ids)))
    with torch.no_grad():
        draft.vocab_ids.copy_(torch.tensor(vocab_ids))
        for delta in draft.layers:
            for name in MATRICES:
                getattr(delta, f"b_{name}").normal_(0.0, gain)
    draft.attach(target)
    return draft.to_native(target)


class UnmappedQ(DraftModelProposer):
    """Samples within the output map but reports q as if column j were token j (map ignored)."""

    def _reported(self, q):
        full = torch.zeros(1, self.model.vocab_size)
        full[:, : q.shape[-1]] = q
        return full


def test_reported_q_is_the_drawn_distribution_mapped_to_token_ids():
    target = tiny_native(vocab=6, seed=0)
    model = tiny_draft(target)
    sampling = SamplingConfig(temperature=0.7, top_k=3)
    draft = DraftModelProposer(model)
    draft.reset(PROMPT)
    out = draft.propose(PROMPT, 1, sampling, torch.Generator().manual_seed(0))
    logits = model.forward(torch.tensor([PROMPT]), model.new_cache(16))[:, -1]
    expected = torch.zeros(1, 6)
    expected[:, list(VOCAB_IDS)] = logits_to_probs(logits, sampling)
    torch.testing.assert_close(out.probs[:, 0], expected)
    assert int(out.tokens[0, 0]) in VOCAB_IDS


def test_sampling_is_exact():
    target = tiny_native(vocab=5, seed=0)
    proposer = DraftModelProposer(tiny_draft(target, vocab_ids=(0, 2, 3), gain=1.0))
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES, n_new=2) > ALPHA


def test_unmapped_q_is_caught():
    target = tiny_native(vocab=5, seed=0)
    proposer = UnmappedQ(tiny_draft(target, vocab_ids=(0, 2, 3), gain=1.0))
    assert proposer_pvalue(target, proposer, SamplingConfig(temperature=1.0, top_k=4), N_SAMPLES, n_new=2) < ALPHA


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identity_chain_tree_and_confidence(k):
    target = tiny_native(vocab=6, seed=5, layers=3)
    cfg = GenerationConfig(max_new_tokens=30)
    prompt = [1, 2, 3, 4, 1, 2, 3, 0, 1, 2]
    expected = Decoder(target, None).generate(prompt, cfg).token_ids
    assert set(expected) - set(VOCAB_IDS)  # the target says what the draft cannot
    model = tiny_draft(target, layers=(0, -1), seed=k)
    for tree, threshold in ((None, 0.0), (None, 0.4), (TreeConfig(max_nodes=3 * k), 0.0)):
        proposer = DraftModelProposer(model, confidence_threshold=threshold, branch=2)
        assert Decoder(target, proposer, k=k, tree=tree).generate(prompt, cfg).token_ids == expected


def test_missing_shipped_draft_names_what_is_missing():
    from specdecode.api import make_proposer

    target = LoadedModel(model=tiny_native(vocab=6), tokenizer=None, source="/nowhere/tiny-model")
    with pytest.raises(ConfigError, match=r"tiny-model/draft/model\.safetensors"):
        make_proposer("draft", target)


# -- the shipped draft ---------------------------------------------------------------------------


def test_shipped_draft_loads_and_matches_card():
    assert SHIPPED.is_dir(), "the default model's distilled draft must ship with the package"
    draft, card = load_head(SHIPPED, DistilledDraft)
    weights = SHIPPED / "model.safetensors"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == card["weights_sha256"]
    assert card["config"] == json.loads(json.dumps(draft.cfg.__dict__))
    assert card["method"] == "draft-model" and card["steps"] > 0
    assert card["heldout"]["mean_accepted_length"] >= 1.0
    assert card["cost"]["macs_ratio"] >= 8.0
    assert card["reproduce"].startswith("specdecode train draft-model")
    assert weights.stat().st_size <= 10 * 1024 * 1024
    total = sum(f.stat().st_size for f in DRAFTERS_DIR.rglob("*") if f.is_file())
    assert total <= 25 * 1024 * 1024


@pytest.mark.slow
def test_shipped_draft_greedy_identity_on_real_model():
    from real_model import PROMPTS, chat_ids, default_target
    from specdecode.api import make_proposer

    loaded = default_target("native")
    cfg = GenerationConfig(max_new_tokens=32)
    accepted = []
    for prompt in PROMPTS[:2]:
        ids = chat_ids(loaded, prompt)
        expected = Decoder(loaded.model, None, eos_token_ids=loaded.eos_token_ids).generate(ids, cfg).token_ids
        for tree in (None, TreeConfig(max_nodes=16)):
            proposer = make_proposer("draft", loaded)
            out = Decoder(loaded.model, proposer, k=4, tree=tree, eos_token_ids=loaded.eos_token_ids).generate(ids, cfg)
            assert out.token_ids == expected, (prompt, tree)
            accepted.append(out.stats["mean_accepted_length"])
    assert sum(accepted) / len(accepted) > 1.2  # a trained draft, not the pruned target


def test_load_distilled_needs_the_native_backend():
    from helpers import tiny_llama

    with pytest.raises(ConfigError, match="native"):
        load_distilled(tiny_llama(vocab=6), SHIPPED)
