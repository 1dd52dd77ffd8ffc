"""Verification math: exact identities with Fractions, and the tensor code against them."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

from specdecode.core.verify import (
    RESIDUAL_EPS,
    Draft,
    reference_output_distribution,
    verify_greedy,
    verify_sampling,
)


def random_dist(rng: random.Random, n: int, support: list[int] | None = None) -> list[Fraction]:
    support = list(range(n)) if support is None else support
    weights = [Fraction(rng.randint(1, 50)) if i in support else Fraction(0) for i in range(n)]
    total = sum(weights)
    return [w / total for w in weights]


@pytest.mark.parametrize("seed", range(20))
def test_single_step_output_equals_target_exactly(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    p, q = random_dist(rng, n), random_dist(rng, n)
    assert reference_output_distribution(p, q) == p


def test_identity_when_draft_equals_target():
    p = random_dist(random.Random(1), 6)
    assert reference_output_distribution(p, list(p)) == p  # residual mass is exactly zero


def test_identity_with_disjoint_supports():
    rng = random.Random(2)
    p, q = random_dist(rng, 6, [0, 1, 2]), random_dist(rng, 6, [3, 4, 5])
    assert reference_output_distribution(p, q) == p


def test_identity_with_one_hot_draft():
    p = random_dist(random.Random(3), 5)
    for x in range(5):
        q = [Fraction(int(i == x)) for i in range(5)]
        assert reference_output_distribution(p, q) == p


def _law_of_tensor_verifier(p: torch.Tensor, q: torch.Tensor, n: int = 40_000) -> torch.Tensor:
    """Empirical law of the first emitted token of ``verify_sampling`` with k = 1, batched."""
    vocab = p.shape[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(q.expand(n, vocab), 1, replacement=True, generator=g)  # [n, 1]
    draft = Draft(tokens=tokens, probs=q.expand(n, 1, vocab))
    target = torch.stack([p, torch.full_like(p, 1 / vocab)]).expand(n, 2, vocab)
    out = verify_sampling(draft, target, g)
    first = torch.where(out.num_accepted > 0, tokens[:, 0], out.next_token)
    return torch.bincount(first, minlength=vocab).double() / n


@pytest.mark.parametrize("case", ["random", "equal", "disjoint"])
def test_tensor_verifier_matches_target_law(case):
    """Batched rows of the real verifier: max deviation within 5 standard errors (n = 40,000)."""
    rng = random.Random(7)
    p = random_dist(rng, 6)
    q = {"random": random_dist(rng, 6), "equal": p, "disjoint": random_dist(rng, 6, [0])}[case]
    if case == "disjoint":
        p = random_dist(rng, 6, [1, 2, 3, 4, 5])
    pt, qt = torch.tensor([float(x) for x in p]), torch.tensor([float(x) for x in q])
    law = _law_of_tensor_verifier(pt, qt)
    se = (pt * (1 - pt) / 40_000).sqrt().double() + 1e-12
    assert ((law - pt.double()).abs() <= 5 * se + 1e-9).all(), (law, pt)


def test_zero_residual_falls_back_without_nan():
    p = torch.tensor([0.5, 0.5, 0.0])
    draft = Draft(tokens=torch.tensor([[0]]), probs=p.view(1, 1, 3))
    target = torch.stack([p, p]).unsqueeze(0)
    # Force a rejection (impossible in exact arithmetic) by giving the draft token a tiny edge.
    bumped = Draft(tokens=draft.tokens, probs=torch.tensor([[[0.5 + RESIDUAL_EPS / 10, 0.5, 0.0]]]))
    for d in (draft, bumped):
        out = verify_sampling(d, target, torch.Generator().manual_seed(0))
        assert int(out.next_token) in (0, 1)


def test_bonus_token_when_all_accepted():
    vocab = 4
    target = torch.zeros(1, 3, vocab)
    target[0, 0, 1] = target[0, 1, 2] = target[0, 2, 3] = 1.0  # deterministic target
    out = verify_sampling(Draft(tokens=torch.tensor([[1, 2]])), target)
    assert int(out.num_accepted) == 2 and int(out.next_token) == 3


def test_greedy_longest_matching_prefix_then_target_token():
    logits = torch.zeros(2, 4, 5)
    for row, best in enumerate([[1, 2, 3, 4], [1, 0, 3, 4]]):
        for i, t in enumerate(best):
            logits[row, i, t] = 1.0
    draft = Draft(tokens=torch.tensor([[1, 2, 3], [1, 2, 3]]))
    out = verify_greedy(draft, logits)
    assert out.num_accepted.tolist() == [3, 1]
    assert out.next_token.tolist() == [4, 0]
    assert out.committed(draft, 1) == [1, 0]
