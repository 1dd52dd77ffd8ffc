"""Shadow mode: decode plainly while the proposer drafts, and record the acceptance it would get.

One draft is pending at a time and is scored against the tokens plain decoding then commits, so
under greedy the recorded rounds are exactly those speculative decoding would have run. Under
sampling each drafted token scores its acceptance probability min(1, p(x)/q(x)) while the plain
path follows the draft; the expected accepted length sums the running products (a lower bound,
since positions after the path leaves the draft are not scored).
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.proposers.base import Proposer


class ShadowTracker:
    def __init__(self, proposer: Proposer, k: int, sampling: SamplingConfig) -> None:
        self.proposer, self.k, self.sampling = proposer, k, sampling
        self.pending: Draft | None = None
        self.alphas: list[float] = []
        self.rounds = 0
        # Conditional acceptance (given the path followed the draft so far), summed per position.
        self.alpha_sum: list[float] = []
        self.alpha_count: list[int] = []

    def before_round(self, context: list[int], generator: torch.Generator | None) -> None:
        if self.pending is None:
            draft = self.proposer.propose(context, self.k, self.sampling, generator)
            self.pending = draft if draft.k else None
            self.alphas = []

    def after_round(self, target_probs: torch.Tensor, token: int) -> None:
        """``target_probs`` [vocab]: the target's processed distribution where ``token`` was emitted."""
        if self.pending is None:
            return
        j = len(self.alphas)
        x = int(self.pending.tokens[0, j])
        if self.sampling.greedy:
            alpha = float(token == x)
        else:
            q_x = 1.0 if self.pending.probs is None else float(self.pending.probs[0, j, x])
            alpha = min(1.0, float(target_probs[x]) / q_x)
        self.alphas.append(alpha)
        if token != x or len(self.alphas) == self.pending.k:
            self._close(matched=len(self.alphas) - int(token != x))

    def _close(self, matched: int) -> None:
        for j, alpha in enumerate(self.alphas):
            if j == len(self.alpha_sum):
                self.alpha_sum.append(0.0)
                self.alpha_count.append(0)
            self.alpha_sum[j] += alpha
            self.alpha_count[j] += 1
        self.rounds += 1
        self.proposer.observe(matched)
        self.pending = None

    def accept_by_position(self) -> list[float]:
        """P(drafts 0..i all accepted): products of the mean conditional acceptance per position."""
        cum, run = [], 1.0
        for total, count in zip(self.alpha_sum[: self.k], self.alpha_count):
            run *= total / count
            cum.append(run)
        return cum

    def stats(self) -> dict:
        cum = self.accept_by_position()
        return {
            "shadow_rounds": self.rounds,
            "shadow_acceptance_rate": sum(cum) / self.k if cum else 0.0,
            "shadow_mean_accepted_length": 1 + sum(cum) if cum else 0.0,
            "shadow_per_position_acceptance": cum,
        }
