"""Medusa heads (Medusa-1, Cai et al. 2401.10774): extra decoding heads on the target's last state.

Head i reads h_t, the target's last-layer feature at position t after the target's frozen final
norm, and predicts token x_{t+2+i}: a residual block h + SiLU(W_i h + b_i) followed by the
target's frozen LM head (the target's own head on h_t itself gives x_{t+1}). The heads never see
each other's tokens, so all of them run in one batched matmul from one feature.

Only the heads' own tensors are stored (W, b and the draft vocabulary); the final norm and LM
head rows are taken from the target at load time. Logits cover a reduced draft vocabulary (the
most frequent tokens) mapped back to full-vocabulary ids: q is zero outside it, which keeps
verification exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import ConfigError
from specdecode.models.native import output_rows
from specdecode.networks.layers import DraftingSnapshot, pack_matrix, rows_linear


@dataclass(frozen=True)
class MedusaConfig:
    hidden: int
    num_heads: int
    eps: float
    vocab_size: int  # the target's full vocabulary
    draft_vocab: int  # rows of the reduced output head

    @classmethod
    def for_target(cls, target, num_heads: int = 4, draft_vocab: int = 8192) -> "MedusaConfig":
        c = target.config
        return cls(c.hidden_size, num_heads, c.rms_norm_eps, target.vocab_size, min(draft_vocab, target.vocab_size))


class MedusaHeads(DraftingSnapshot, nn.Module):
    config_class = MedusaConfig

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        if cfg.num_heads < 1:
            raise ConfigError(f"Medusa needs at least one head, got {cfg.num_heads}")
        self.cfg = cfg
        h = cfg.hidden
        # Zero blocks: every head starts as the target's own head (Medusa's initialisation).
        self.weight = nn.Parameter(torch.zeros(cfg.num_heads, h, h))
        self.bias = nn.Parameter(torch.zeros(cfg.num_heads, h))
        # Full-vocabulary ids of the draft vocabulary's rows.
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab, dtype=torch.long))

    def attach(self, target) -> None:
        """Bind the target's final norm and LM head rows (frozen, not parameters)."""
        if target.vocab_size != self.cfg.vocab_size or target.config.hidden_size != self.cfg.hidden:
            raise ConfigError(
                f"Medusa heads were trained for vocab {self.cfg.vocab_size} / hidden {self.cfg.hidden}; "
                f"target has {target.vocab_size} / {target.config.hidden_size}"
            )
        self.norm_weight = target.weights.norm.float()
        self.out_rows = output_rows(target, self.vocab_ids)

    def pack_for_drafting(self, target) -> None:
        """Snapshot the blocks (stacked into one matrix) and the head rows in the native target's
        prepacked layout; used under ``torch.no_grad`` until the heads are put back in training mode."""
        if not target.weights.prepacked:
            return
        lin = target.weights.linear
        h = self.cfg.hidden
        stacked = self.weight.detach().reshape(self.cfg.num_heads * h, h)
        self._packed = (lin, pack_matrix(stacked), self.bias.detach().reshape(-1), pack_matrix(self.out_rows))

    def normed(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's final norm of pre-norm features [..., hidden]."""
        return F.rms_norm(feats.float(), (self.cfg.hidden,), self.norm_weight, self.cfg.eps)

    def target_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's own next-token logits over the draft vocabulary [..., draft_vocab]."""
        return F.linear(self.normed(feats), self.out_rows)

    def forward(self, feats: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """Logits [..., heads, draft_vocab] of the first ``heads`` heads from pre-norm features [..., hidden]."""
        n = self.cfg.num_heads if heads is None else heads
        h = self.normed(feats)
        fast = self._drafting()
        if fast is not None:
            lin, w, b, out = fast
            blocks = rows_linear(lin, h, w, b).unflatten(-1, (self.cfg.num_heads, -1))[..., :n, :]
            return rows_linear(lin, h.unsqueeze(-2) + F.silu(blocks), out, None)
        blocks = torch.einsum("...d,hed->...he", h, self.weight[:n]) + self.bias[:n]
        return F.linear(h.unsqueeze(-2) + F.silu(blocks), self.out_rows)
