"""EAGLE head training: the unrolled draft-depth predictions and the self-distillation loss.

The head itself (:class:`~specdecode.networks.eagle_head.EagleHead`) lives in
:mod:`specdecode.networks`, which inference imports; only what training needs is here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.networks.eagle_head import EagleHead


def unrolled_predictions(head: EagleHead, inputs: torch.Tensor, embeds: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Predicted features [B, T, hidden] at draft depths 1..``depth``, attended as drafting does.

    Depth 1 is the plain causal pass over true features. Depth d at position i reads the depth
    d-1 prediction of f_i and attends to what the drafting cache holds at that point: the true
    entries j <= i-d+1, then one entry of each depth 2..d at positions i-d+2..i. Training on
    these (EAGLE-3's "training-time test") teaches the head to draft on from its own drift.
    """
    t = inputs.shape[1]
    positions = torch.arange(t)
    if depth == 1:
        return [head(inputs, embeds, positions)]
    c = head.cfg
    empty = inputs.new_zeros(inputs.shape[0], c.kv_heads, t, c.head_dim)
    keys, values = empty[:, :, :0], empty[:, :, :0]
    preds, x = [], inputs
    for d in range(depth):
        # A fresh buffer per depth: autograd keeps the earlier ones as they were read.
        keys, values = torch.cat([keys, empty], 2), torch.cat([values, empty], 2)
        mask = torch.zeros(t, (d + 1) * t, dtype=torch.bool)
        mask[:, :t] = positions[None, :] <= positions[:, None] - d  # true entries
        for e in range(1, d + 1):  # the depth e+1 entry at position i - d + e
            rows = positions[positions >= d - e]
            mask[rows, e * t + rows - d + e] = True
        out = head(x, embeds, positions, keys, values, d * t, mask)
        preds.append(out)
        x = torch.cat([inputs[:, :1], out[:, :-1]], dim=1)  # position i reads the predicted f_i
    return preds


def head_loss(
    head: EagleHead,
    feats: torch.Tensor,
    tokens: torch.Tensor,
    scale: float,
    noise: float = 0.0,
    valid: torch.Tensor | None = None,
    depth: int = 1,
    decay: float = 0.8,
):
    """EAGLE's loss on windows: feats [B, T+1, hidden] (f_0..f_T), tokens [B, T+1] (x_0..x_T).

    Pair i = (f_i, x_{i+1}) predicts f_{i+1}: smooth-L1 on features (divided by ``scale``, the
    features' RMS) plus cross-entropy against the target's own next-token distribution (its final
    norm and head applied to the true f_{i+1}) over the draft vocabulary. With ``depth`` > 1 the
    head also predicts from its own earlier predictions (:func:`unrolled_predictions`), depth d
    weighted ``decay``^(d-1). Returns (loss, regression, cross-entropy, top-1 agreement with the
    target's argmax), the last three at depth 1. ``valid`` [B, T] (bool) drops pairs that
    straddle two sequences.
    """
    inputs = feats[:, :-1].float()
    if noise > 0:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * (2 * noise * scale)
    truth = feats[:, 1:].float()
    with torch.no_grad():
        target_logits = head.logits(truth)
        p = torch.softmax(target_logits, dim=-1)
    preds = unrolled_predictions(head, inputs, head.embed_tokens(tokens[:, 1:]), depth)
    ok = torch.ones(truth.shape[:2], dtype=torch.bool) if valid is None else valid.bool()
    loss, weight, first = 0.0, 0.0, None
    for d, pred in enumerate(preds):
        if d:  # depth d+1 at position i chains pairs i-d..i: all must lie in one sequence, i >= d
            ok = ok & F.pad(ok, (1, 0), value=False)[:, :-1]
        w = ok.float()
        total = w.sum().clamp_min(1.0)
        reg = (F.smooth_l1_loss(pred / scale, truth / scale, reduction="none").mean(-1) * w).sum() / total
        logits = head.logits(pred)
        ce = (-(p * torch.log_softmax(logits, dim=-1)).sum(-1) * w).sum() / total
        loss = loss + decay**d * (reg + 0.1 * ce)
        weight += decay**d
        if first is None:
            agree = ((logits.argmax(-1) == target_logits.argmax(-1)).float() * w).sum() / total
            first = (reg.detach(), ce.detach(), agree.detach())
    return (loss / weight, *first)
