"""Logit processing: temperature, top-k, top-p, min-p, greedy."""

import pytest
import torch

from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.errors import ConfigError

LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def test_temperature_one_is_softmax():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0))
    assert torch.allclose(probs, torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]), atol=1e-6)


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_k_largest():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]), atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.7))
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, top_p=0.71))
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = logits_to_probs(LOGITS, SamplingConfig(temperature=1.0, min_p=0.25))
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]


def test_low_temperature_sharpens():
    cold = logits_to_probs(LOGITS, SamplingConfig(temperature=0.5))
    assert cold[0, 0] > 0.5 and torch.isclose(cold.sum(), torch.tensor(1.0))


def test_batched_shapes_preserved():
    logits = torch.randn(2, 3, 7)
    assert logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.9)).shape == (2, 3, 7)


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0)]
)
def test_bad_settings_raise_clear_errors(kwargs):
    with pytest.raises(ConfigError):
        SamplingConfig(**kwargs)


def test_extreme_settings_keep_a_valid_distribution():
    """Found by the server's fuzz test: top_p = 5e-324 reads as 0 in float32 and dropped every
    token; a temperature of 1e-300 overflowed the logits. Both must still give a distribution."""
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=5e-324))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]]))
    tiny = SamplingConfig(temperature=1e-300)
    assert tiny.greedy and torch.equal(logits_to_probs(logits, tiny), probs)
