"""A draft model's output head cut to its most common tokens: the kept logit columns equal the
full model's (bitwise for float and int8 heads), the other weights are shared, and a draft
speculating over the reduced vocabulary leaves greedy output token-identical."""

from __future__ import annotations

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


def test_a_reduced_vocabulary_draft_is_greedy_identical_alone_and_in_a_batch(tiny):
    target = NativeCausalLM.from_pretrained(tiny)
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
