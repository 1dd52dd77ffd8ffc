"""Medusa-1 training: the heads' loss (the heads themselves are in :mod:`specdecode.networks.medusa_heads`)."""

from __future__ import annotations

import torch

from specdecode.networks.medusa_heads import MedusaHeads

# Medusa-1's per-head loss weights decay as LOSS_DECAY ** i: far heads are less predictable.
LOSS_DECAY = 0.8


def medusa_loss(heads: MedusaHeads, feats: torch.Tensor, valid: torch.Tensor | None = None):
    """Medusa-1's loss on windows: feats [B, T+1, hidden], the target's pre-norm f_0..f_T.

    Head i at position t is trained against the target's own next-token distribution at
    position t+1+i (its final norm and head on the true f_{t+1+i}, over the draft vocabulary),
    i.e. the law of x_{t+2+i}; head losses are weighted LOSS_DECAY ** i. ``valid`` [B, T] (bool,
    position j+1 continues position j's sequence) drops pairs that straddle two sequences.
    Returns (loss, per-head cross-entropy [H], per-head top-1 agreement with the target's argmax
    [H], per-head scored positions [H]).
    """
    t = feats.shape[1] - 1
    n_heads = min(heads.cfg.num_heads, t)
    with torch.no_grad():
        truth = heads.target_logits(feats[:, 1:])  # [B, T, V]: law of x_{s+2} at s = 0..T-1
        p = torch.softmax(truth, dim=-1)
    logits = heads(feats[:, :t], n_heads)  # [B, T, H, V]
    ok = torch.ones(feats.shape[0], t, dtype=torch.bool) if valid is None else valid.bool()
    loss, ces, agrees, counts = feats.new_zeros(()), [], [], []
    for i in range(n_heads):
        n = t - i  # positions whose label lies inside the window
        if i:
            ok = ok[:, :n] & valid[:, i : i + n] if valid is not None else ok[:, :n]
        w = ok.float()
        total = w.sum().clamp_min(1.0)
        pred = logits[:, :n, i]
        ce = (-(p[:, i : i + n] * torch.log_softmax(pred, dim=-1)).sum(-1) * w).sum() / total
        agree = ((pred.argmax(-1) == truth[:, i : i + n].argmax(-1)).float() * w).sum() / total
        loss = loss + LOSS_DECAY**i * ce
        ces.append(ce.detach())
        agrees.append(agree.detach())
        counts.append(int(w.sum()))
    return loss, torch.stack(ces), torch.stack(agrees), counts
