"""Distilling the draft model: its loss (the network is :mod:`specdecode.networks.draft_model`)."""

from __future__ import annotations

import torch

from specdecode.networks.draft_model import DistilledDraft


def distill_loss(draft: DistilledDraft, feats: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None = None):
    """KL(target || draft) over the draft vocabulary on windows; returns (loss, top-1 agreement).

    ``tokens`` [B, T+1], ``feats`` [B, T+1, hidden] (the target's pre-norm features): the draft
    reads x_0..x_{T-1} and position i is scored against the target's distribution at i (from f_i).
    ``valid`` [B, T] drops positions after a sequence boundary inside the window.
    """
    logits = draft(tokens[:, :-1])
    with torch.no_grad():
        teacher = draft.teacher_logits(feats[:, :-1])
        logp = torch.log_softmax(teacher, dim=-1)
    w = torch.ones(logits.shape[:2]) if valid is None else same_sequence(valid)
    total = w.sum().clamp_min(1.0)
    kl = (logp.exp() * (logp - torch.log_softmax(logits, dim=-1))).sum(-1)
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float()
    return (kl * w).sum() / total, ((agree * w).sum() / total).detach()


def same_sequence(valid: torch.Tensor) -> torch.Tensor:
    """Positions in the window's first sequence ([B, T] float): the draft attends from position 0.

    ``valid[:, i]`` is False when x_{i+1} starts a new sequence; position i of the draft input
    reads x_i, so it is usable while no boundary lies in x_1..x_i.
    """
    starts = torch.cat([torch.zeros_like(valid[:, :1]), ~valid[:, :-1]], dim=1)
    return (torch.cumsum(starts.long(), dim=1) == 0).float()
