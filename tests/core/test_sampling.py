"""Logit processing: temperature, top-k, top-p, min-p, greedy."""

from collections import Counter

import pytest
import torch

from specdecode.core import sampling
from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
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


# -- sample: inverse-CDF draws -------------------------------------------------------------------

ALPHA = 1e-3  # significance level of the chi-square tests below
LAWS = torch.tensor(
    [
        [0.0, 0.2, 0.0, 0.5, 0.3, 0.0],  # zeros inside and at both ends
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
        [0.6, 0.4, 0.8, 0.0, 0.2, 0.0],  # not normalised (mass 2)
    ]
)


def _inverse_cdf_without_scaling(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A deliberately broken sampler: u ~ U[0, 1) not scaled by the row's mass."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def _pvalues(sampler, n: int = 6000) -> list[float]:
    from specdecode.testing import chi_square_pvalue

    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sampler(LAWS, g) for _ in range(n)])  # [n, rows]
    pvalues = []
    for row, law in enumerate(LAWS / LAWS.sum(-1, keepdim=True)):
        counts = Counter((int(x),) for x in draws[:, row])
        pvalues.append(chi_square_pvalue(counts, {(i,): float(p) for i, p in enumerate(law) if p > 0}))
    return pvalues


def test_sample_draws_each_row_from_its_law_and_never_a_token_without_mass():
    """Chi-square per row at ALPHA (6,000 draws); a draw of a zero-mass token gives p = 0."""
    assert min(_pvalues(sample)) > ALPHA


def test_a_sampler_that_ignores_a_rows_mass_is_caught():
    assert min(_pvalues(_inverse_cdf_without_scaling)) < ALPHA


def test_a_draw_at_the_top_of_the_range_keeps_to_the_last_token_with_mass(monkeypatch):
    """u * mass rounding up to the mass itself must not fall on the trailing zero-mass tokens."""
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.ones(*a[0], dtype=torch.float64))
    assert sample(LAWS).tolist() == [4, 5, 4]


def test_sample_is_reproducible_with_a_seeded_generator():
    draws = [sample(LAWS, torch.Generator().manual_seed(3)).tolist() for _ in range(2)]
    assert draws[0] == draws[1]


@pytest.mark.parametrize("bad", [torch.zeros(1, 4), torch.tensor([[0.5, float("nan"), 0.5]])])
def test_sample_refuses_a_row_without_mass(bad):
    with pytest.raises(ValueError, match="positive, finite probability mass"):
        sample(bad)


# -- top-p over the top candidates, against the full sort -----------------------------------------


@pytest.mark.parametrize("candidates", [(4, 16), (256, 4096)])
def test_top_p_over_candidates_equals_the_full_sort(monkeypatch, candidates):
    """Every path (nucleus within the first candidates, within the second, wider than both) keeps
    exactly the tokens the full sort keeps: peaked and flat rows, -inf entries, tiny top_p."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows, vocab = 1 + trial % 4, (50, 1000, 5000)[trial % 3]
        x = torch.randn(rows, vocab, generator=g) * (0.05, 0.5, 2.0, 8.0)[trial % 4]
        if trial % 5 == 0:
            x[:, ::7] = float("-inf")
        top_p = (1e-300, 0.1, 0.5, 0.9, 0.95, 0.999)[trial % 6]
        assert torch.equal(sampling.top_p_filter(x, top_p), sampling.top_p_filter_sorted(x, top_p)), trial


def test_top_p_keeps_the_shape_of_batched_logits():
    x = torch.randn(2, 3, 40)
    out = sampling.top_p_filter(x, 0.8)
    assert out.shape == x.shape
    assert torch.equal(out.isfinite(), sampling.top_p_filter_sorted(x.view(6, 40), 0.8).view(2, 3, 40).isfinite())
