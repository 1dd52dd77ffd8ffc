"""Exact verification of drafted tokens (Leviathan et al. 2211.17192, Chen et al. 2302.01318).

Every proposer hands over a :class:`Draft`; deterministic proposers leave ``probs`` empty and are
treated as one-hot q, so this one verifier serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.core.sampling import sample

# Residual mass below this is treated as zero: we then sample from p itself (the rejection had
# probability ~0, so any choice keeps the output distribution exact up to that mass).
RESIDUAL_EPS = 1e-9


@dataclass(frozen=True)
class Draft:
    """Candidates from a proposer for one round."""

    tokens: torch.Tensor  # [batch, k] int64
    probs: torch.Tensor | None = None  # [batch, k, vocab] processed draft distributions; None = one-hot
    # [batch, k] a deterministic proposer's own chance that each draft is right given the drafts
    # before it (uncalibrated; the engine learns what it is worth). None: no such estimate.
    scores: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return int(self.tokens.shape[1])

    def prefix(self, k: int) -> "Draft":
        """The first ``k`` drafts (all of them when there are fewer)."""
        if k >= self.k:
            return self
        cut = lambda t: None if t is None else t[:, :k]  # noqa: E731
        return Draft(self.tokens[:, :k], cut(self.probs), cut(self.scores))

    @staticmethod
    def empty(batch: int = 1) -> "Draft":
        return Draft(tokens=torch.zeros(batch, 0, dtype=torch.long))


@dataclass(frozen=True)
class Verification:
    """Outcome of one round: the accepted prefix length and the token the target adds."""

    num_accepted: torch.Tensor  # [batch] int64 in 0..k
    next_token: torch.Tensor  # [batch] int64: replacement at the first rejection, else the bonus

    def committed(self, draft: Draft, row: int = 0) -> list[int]:
        """Tokens this round commits for ``row``: the accepted drafts, then the target's token."""
        n = int(self.num_accepted[row])
        return draft.tokens[row, :n].tolist() + [int(self.next_token[row])]


def draft_probs_or_onehot(draft: Draft, vocab: int) -> torch.Tensor:
    """q for every drafted position: [batch, k, vocab]."""
    if draft.probs is not None:
        return draft.probs.float()
    q = torch.zeros(*draft.tokens.shape, vocab, dtype=torch.float32)
    return q.scatter_(-1, draft.tokens.unsqueeze(-1), 1.0)


def verify_sampling(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None = None) -> Verification:
    """Speculative sampling: accept x_i with prob min(1, p(x_i)/q(x_i)), resample at the first miss.

    ``target_probs``: [batch, k+1, vocab], the target's processed distributions at each drafted
    position plus the one after the last draft. The committed tokens are distributed exactly as
    sampling from the target one token at a time.
    """
    batch, k = draft.tokens.shape
    vocab = target_probs.shape[-1]
    p = target_probs.float()
    if k == 0:  # a plain round: the target's own draw, without the residual's vocab-sized steps
        return Verification(num_accepted=torch.zeros(batch, dtype=torch.long), next_token=sample(p[:, 0], generator))
    q = draft_probs_or_onehot(draft, vocab)  # [batch, k, vocab]
    idx = draft.tokens.unsqueeze(-1)
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)  # [batch, k]
    q_x = q.gather(-1, idx).squeeze(-1)  # [batch, k]
    u = torch.rand(batch, k, generator=generator)
    accepted = u * q_x < p_x  # u < p/q without dividing; q_x > 0 since x was drawn from q
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]

    rows = torch.arange(batch)
    # q is zero after the last draft, so the bonus position's residual is p itself.
    q_pad = torch.cat([q, torch.zeros(batch, 1, vocab)], dim=1)  # [batch, k+1, vocab]
    p_at = p[rows, num_accepted]  # [batch, vocab]
    residual = (p_at - q_pad[rows, num_accepted]).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    final = torch.where(mass > RESIDUAL_EPS, residual / mass.clamp_min(RESIDUAL_EPS), p_at)
    next_token = sample(final, generator)
    return Verification(num_accepted=num_accepted, next_token=next_token)


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> Verification:
    """Greedy: the longest drafted prefix equal to the target's argmax, then the target's token.

    ``target_logits``: [batch, k+1, vocab].
    """
    batch, k = draft.tokens.shape
    best = target_logits.argmax(dim=-1)  # [batch, k+1]
    match = draft.tokens == best[:, :k]
    num_accepted = match.long().cumprod(dim=-1).sum(dim=-1)
    next_token = best[torch.arange(batch), num_accepted]
    return Verification(num_accepted=num_accepted, next_token=next_token)


def reference_output_distribution(p: list, q: list) -> list:
    """Exact law of the token one verification step emits for a single draft x ~ q.

    Pure Python over any field (use ``fractions.Fraction`` for exact checks): accept x with
    probability min(1, p(x)/q(x)); otherwise draw from norm(max(p - q, 0)), falling back to p
    when that mass is zero. Speculative sampling is exact when the result equals ``p``.
    """
    accept = [min(qi, pi) for pi, qi in zip(p, q)]  # q(x) * min(1, p(x)/q(x))
    reject_mass = 1 - sum(accept)
    residual = [max(pi - qi, 0) for pi, qi in zip(p, q)]
    mass = sum(residual)
    resample = [r / mass for r in residual] if mass > 0 else list(p)
    return [a + reject_mass * r for a, r in zip(accept, resample)]
