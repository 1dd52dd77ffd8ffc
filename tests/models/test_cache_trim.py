"""Every cache honours the trim contract: trim-and-continue equals a fresh prefill."""

import pytest
import torch

from helpers import MarkovLM, tiny_llama


def _check_trim_then_continue(model, atol=1e-5):
    seq = torch.tensor([[1, 2, 3, 4, 0, 1, 2, 5, 3, 1]])
    fresh = model.forward(seq, model.new_cache(32))
    cache = model.new_cache(32)
    model.forward(seq[:, :6], cache)
    model.forward(torch.tensor([[4, 4, 4]]), cache)  # a "rejected" suffix
    cache.trim(6)
    assert cache.length == 6
    again = model.forward(seq[:, 6:], cache)
    assert torch.allclose(again, fresh[:, 6:], atol=atol)


@pytest.mark.parametrize("make", [lambda: tiny_llama(vocab=6, seed=0), lambda: MarkovLM(6, seed=0)])
def test_trim_then_continue_matches_fresh_prefill(make):
    _check_trim_then_continue(make())


def test_trim_rejects_growing_or_negative():
    model = tiny_llama(vocab=6)
    cache = model.new_cache(8)
    model.forward(torch.tensor([[1, 2, 3]]), cache)
    for bad in (4, -1):
        with pytest.raises(ValueError):
            cache.trim(bad)


def test_cache_that_cannot_trim_is_refused_up_front():
    from transformers import MistralConfig, MistralForCausalLM

    from specdecode.errors import ModelLoadError
    from specdecode.models.hf import HFCausalLM

    config = MistralConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
    )
    model = HFCausalLM(MistralForCausalLM(config))
    with pytest.raises(ModelLoadError, match="cannot be trimmed"):
        model.new_cache(16)
