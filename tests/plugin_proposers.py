"""Plugin proposers for the registry and conformance tests (importable as ``plugin_proposers``).

``FixedQProposer`` drafts every token from its own fixed distribution q (peaked on one token) and
reports that q: exact. ``WrongQProposer`` samples the same peaked q but claims a uniform one: its
output law is not the target's, and certification must say so. ``NextTokenProposer`` is a
deterministic plugin (one-hot q) that also drafts trees.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.methods import MethodSpec
from specdecode.proposers.base import PerRequest, ProposerCaps


class FixedQProposer(PerRequest):
    name = "fixed-q"
    caps = ProposerCaps()

    def __init__(self, vocab: int = 5, peak: float = 0.8, token: int = 0) -> None:
        self.q = torch.full((vocab,), (1.0 - peak) / (vocab - 1))
        self.q[token] = peak

    def reported_q(self) -> torch.Tensor:
        return self.q

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        tokens = torch.multinomial(self.q, k, replacement=True, generator=generator).view(1, k)
        return Draft(tokens, self.reported_q().expand(1, k, -1).clone())

    def observe(self, num_accepted: int) -> None:
        pass


class WrongQProposer(FixedQProposer):
    """Samples from the peaked q, reports a uniform q: a broken plugin."""

    name = "wrong-q"

    def reported_q(self) -> torch.Tensor:
        return torch.full_like(self.q, 1.0 / self.q.numel())


class NextTokenProposer(PerRequest):
    """Deterministic: drafts ``last + 1, last + 2, ...`` (mod vocab); trees add ``last + 2, ...``."""

    name = "next-token"
    caps = ProposerCaps(trees=True)

    def __init__(self, vocab: int = 5) -> None:
        self.vocab = vocab

    def _chain(self, start: int, k: int) -> list[int]:
        return [(start + i) % self.vocab for i in range(k)]

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        return Draft(torch.tensor([self._chain(context[-1] + 1, k)], dtype=torch.long))

    def propose_tree(self, context: list[int], k: int, max_nodes: int) -> list[list[int]]:
        paths = [self._chain(context[-1] + 1, k), self._chain(context[-1] + 2, max(1, k - 1))]
        return paths if sum(map(len, paths)) <= max_nodes else paths[:1]

    def observe(self, num_accepted: int) -> None:
        pass


def build_fixed_q(target, draft=None, peak: float = 0.8):
    """A registry builder: the fixed-q plugin over the target's vocabulary."""
    return FixedQProposer(target.model.vocab_size, peak=peak)


def build_wrong_q(target, draft=None, peak: float = 0.8):
    return WrongQProposer(target.model.vocab_size, peak=peak)


def build_next_token(target, draft=None):
    return NextTokenProposer(target.model.vocab_size)


def next_token_factory(target):
    """A ``--plugin`` factory: given the tiny target model, return a proposer."""
    return NextTokenProposer(target.vocab_size)


FIXED_Q = MethodSpec(
    "plugin-fixed-q",
    "plugin_proposers:build_fixed_q",
    {"peak"},
    description="drafts from a fixed peaked q and reports it (exact)",
)
WRONG_Q = MethodSpec(
    "plugin-wrong-q",
    "plugin_proposers:build_wrong_q",
    {"peak"},
    description="drafts from a peaked q, reports a uniform q (broken)",
)
