"""A draft model's output head cut to its most common tokens: the kept logit columns equal the
full model's (bitwise for float and int8 heads), the other weights are shared, and a draft
speculating over the reduced vocabulary leaves greedy output token-identical."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from specdecode.engine import Decoder, Engine, EngineConfig, GenerationConfig, Speculation
from specdecode.errors import ConfigError
from specdecode.models.loading import LoadedModel
from specdecode.models.native import NativeCausalLM, frequent_ids, restrict_output, with_draft_vocab
from specdecode.models.quant import QuantMatrix, quant_linear, quantize_matrix
from specdecode.proposers import DraftModelProposer

IDS = torch.tensor([0, 1, 2, 5, 17, 40, 95])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_native import make_checkpoint

    folder, _ = make_checkpoint(tmp_path_factory.mktemp("vocab"), "qwen2-qkv-bias")
    return folder


@pytest.mark.parametrize(
    "dtype,quant",
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8"), (torch.bfloat16, "int4")],
)
def test_kept_columns_equal_the_full_models(tiny, dtype, quant):
    full = NativeCausalLM.from_pretrained(tiny, dtype=dtype, quant=quant)
    cut = restrict_output(full, IDS)
    assert cut.vocab_size == full.vocab_size and torch.equal(cut.vocab_ids, IDS)
    assert cut.weights.layers is full.weights.layers and cut.weights.embed is full.weights.embed  # shared
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    want = full.forward(ids, full.new_cache(16))[..., IDS]
    got = cut.forward(ids, cut.new_cache(16))
    assert got.shape == (1, 9, len(IDS)) and torch.equal(got, want)
    rows = cut.forward_rows([ids[0, :4], ids[0, 4:]], [cut.new_cache(8), cut.new_cache(8)])
    alone = [cut.forward(ids[:, :4], cut.new_cache(8)), cut.forward(ids[:, 4:], cut.new_cache(8))]
    assert all(torch.equal(r, a) for r, a in zip(rows, alone))


def test_an_int4_head_is_read_back_into_int8_rows():
    from test_quant import _grid_matrix

    from specdecode.models.native import Weights, _head_rows

    head = quantize_matrix(_grid_matrix(64, 32), "int4")
    assert isinstance(head, QuantMatrix) and head.kind == "int4"
    ids = torch.arange(0, 64, 4)  # 16 rows: int4 packs in sixteens
    w = Weights(embed=torch.zeros(64, 32), layers=[], norm=torch.ones(32), lm_head=head, linear=quant_linear)
    model = SimpleNamespace(weights=w, dtype=torch.bfloat16, config=SimpleNamespace(tie_word_embeddings=False))
    cut = _head_rows(model, ids)
    assert isinstance(cut, QuantMatrix) and cut.kind == "int8" and cut.shape == (16, 32)
    x = torch.randn(3, 32).to(torch.bfloat16)
    want, got = head(x)[:, ids].float(), cut(x).float()
    assert (got - want).norm() / want.norm() < 1e-2


def test_frequent_ids_are_the_lowest_plus_end_of_sequence():
    assert frequent_ids(4, 100, (99, 2)).tolist() == [0, 1, 2, 3, 99]
    for bad in (0, 101, 2.5):
        with pytest.raises(ValueError):
            frequent_ids(bad, 100)


def test_with_draft_vocab_checks_its_input(tiny):
    full = NativeCausalLM.from_pretrained(tiny)
    loaded = LoadedModel(full, None, str(tiny))
    with pytest.raises(ConfigError, match="--draft-vocab must be 1..96"):
        with_draft_vocab(loaded, 0)
    with pytest.raises(ConfigError, match="native backend"):
        with_draft_vocab(LoadedModel(object(), None, "x"), 8)


@pytest.mark.parametrize("dtype,quant", [(torch.float32, None), (torch.bfloat16, "int8"), (torch.bfloat16, "int4")])
def test_a_cut_head_scores_any_other_token_like_the_full_head(tiny, dtype, quant):
    """``head_rows`` + ``column_logits`` give the full model's logit of a token the cut lacks:
    to float rounding for a float head, within the activations' int8 rounding for a quantized one."""
    full = NativeCausalLM.from_pretrained(tiny, dtype=dtype, quant=quant, pack=False)
    cut = restrict_output(full, IDS)
    assert cut.caps.columns and not full.caps.columns
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    logits, hidden = full.forward(ids, full.new_cache(16), return_hidden=True)  # [1, 9, 96], [9, hidden]
    others = torch.tensor([3, 50, 95])
    got = cut.column_logits(hidden, cut.head_rows(others))  # [9, 3]
    want = logits[0][:, others]
    tol = 1e-5 if quant is None else 2e-2
    assert got.shape == (9, 3) and (got - want).abs().max() <= tol * want.abs().max()


def test_a_prepacked_untied_float_head_offers_no_columns(tiny):
    full = NativeCausalLM.from_pretrained(tiny)  # fp32, prepacked for oneDNN where that works
    if full.weights.linear is torch.nn.functional.linear:
        pytest.skip("oneDNN packing unavailable here: the head is readable")
    assert not restrict_output(full, IDS).caps.columns


def _masked_greedy_chain(model, context: list[int], allowed: set[int], k: int) -> list[int]:
    """The greedy chain of ``model`` (full head) restricted to ``allowed`` tokens."""
    mask = torch.full((model.vocab_size,), float("-inf"))
    mask[sorted(allowed)] = 0
    cache, chain, feed = model.new_cache(64), [], list(context)
    for _ in range(k):
        logits = model.forward(torch.tensor([feed]), cache, last_only=True)[0, -1]
        chain.append(int((logits + mask).argmax()))
        feed = chain[-1:]
    return chain


@pytest.mark.parametrize("context_vocab", [True, False])
def test_a_cut_draft_drafts_its_contexts_own_tokens(tiny, context_vocab):
    """With ``context_vocab`` a cut draft drafts over its kept ids plus every token of its own
    context (here ids above the cut that the prompt repeats), alone and in a batch; without,
    over the kept ids only."""
    from specdecode.core.sampling import SamplingConfig

    full = NativeCausalLM.from_pretrained(tiny, pack=False)
    cut = restrict_output(full, torch.arange(0, 48))
    prompts = [[60, 70, 80, 60, 70, 80, 60, 70], [90, 91, 3, 90, 91, 3, 90]]
    greedy = SamplingConfig()
    template = DraftModelProposer(cut, context_vocab=context_vocab)
    states = []
    for p in prompts:
        allowed = set(range(48)) | (set(p) if context_vocab else set())
        state = template.start(p)
        assert state.propose(p, 4, greedy, None).tokens[0].tolist() == _masked_greedy_chain(full, p, allowed, 4)
        states.append(template.start(p))
    batch = template.propose_batch(states, prompts, [4, 4], [greedy, greedy], [None, None])
    alone = [template.start(p).propose(p, 4, greedy, None).tokens[0].tolist() for p in prompts]
    assert [d.tokens[0].tolist() for d in batch] == alone
    assert template.extra is None  # the columns are the request's, never the shared proposer's
    assert sorted(states[0].extra.ids if context_vocab else []) == ([60, 70, 80] if context_vocab else [])


def test_the_vocab_option_cuts_a_loaded_drafts_head_once(tiny):
    """``draft:vocab=N`` (and a hybrid's drafter) builds the cut model once, shared by every
    request; a bad count or a distilled draft is a ConfigError naming the option."""
    from helpers import byte_tokenizer
    from specdecode.api import make_proposer

    tok = byte_tokenizer()
    target = LoadedModel(NativeCausalLM.from_pretrained(tiny), tok, str(tiny))
    draft = LoadedModel(NativeCausalLM.from_pretrained(tiny, pack=False), tok, str(tiny))
    proposer = make_proposer("draft", target, draft, vocab=48)
    assert torch.equal(proposer.model.vocab_ids, torch.arange(48)) and proposer.model.caps.columns
    assert proposer.start([1, 2, 3]).model is proposer.model
    hybrid = make_proposer("hybrid", target, draft, vocab=48, context_vocab=False)
    assert hybrid.drafter.model.vocab_size == 96 and hybrid.drafter._outside is None
    for bad in (True, 97, "8"):
        with pytest.raises(ConfigError, match="vocab must be 1..96"):
            make_proposer("draft", target, draft, vocab=bad)


def test_a_draft_over_twice_the_default_cut_gets_it_by_default(tiny):
    """The default cut needs many ids and a head readable by rows (for the context's columns):
    never for a small vocabulary, a model already cut, or a prepacked untied float head."""
    from specdecode.models import native

    small = NativeCausalLM.from_pretrained(tiny, pack=False)
    assert native.default_draft_vocab(small) == 0  # 96 ids
    big = dataclasses.replace(small.config, vocab_size=2 * native.DEFAULT_DRAFT_VOCAB + 1)
    model = NativeCausalLM.__new__(NativeCausalLM)  # a big model's shape, on the tiny one's weights
    model.vocab_size, model.config, model.weights = big.vocab_size, big, small.weights
    assert native.default_draft_vocab(model) == native.DEFAULT_DRAFT_VOCAB
    packed = NativeCausalLM.from_pretrained(tiny)
    if packed.weights.linear is not torch.nn.functional.linear:  # untied and prepacked: no columns
        model.weights = packed.weights
        assert native.default_draft_vocab(model) == 0
    assert native.default_draft_vocab(restrict_output(small, IDS)) == 0


def test_context_vocab_must_be_a_bool(tiny):
    cut = restrict_output(NativeCausalLM.from_pretrained(tiny, pack=False), IDS)
    with pytest.raises(ConfigError, match="context_vocab must be true or false"):
        DraftModelProposer(cut, context_vocab="yes")


def test_a_reduced_vocabulary_draft_is_greedy_identical_alone_and_in_a_batch(tiny):
    target = NativeCausalLM.from_pretrained(tiny, pack=False)  # readable head: context columns on
    draft = restrict_output(target, torch.arange(0, 48))  # the target itself, cut to half its tokens
    prompts = [[3, 9, 27, 81, 3, 9], [5, 5, 5, 7], [1, 2, 3, 4, 1, 2, 3]]
    cfg = GenerationConfig(max_new_tokens=16)
    expected = [Decoder(target, None).generate(p, cfg).token_ids for p in prompts]
    spec = Speculation(DraftModelProposer(draft), k=3)
    assert [Decoder(target, DraftModelProposer(draft), k=3).generate(p, cfg).token_ids for p in prompts] == expected
    engine = Engine(target, config=EngineConfig(max_batch=3))
    got = [engine.submit(p, cfg, spec) for p in prompts]
    engine.run()
    assert [r.result.token_ids for r in got] == expected
    drafted = sum(int(r.result.stats.get("drafted_tokens") or 0) for r in got)
    accepted = sum(int(r.result.stats.get("accepted_tokens") or 0) for r in got)
    assert drafted > 0 and accepted > 0  # it did speculate, and was right where it could be
