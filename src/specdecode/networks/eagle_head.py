"""The EAGLE draft head: one Llama decoder layer over (target feature, next token embedding).

At position t the head reads the target's last-layer feature f_t (before the final norm) and the
embedding of token x_{t+1}, and predicts f_{t+1}; the target's frozen final norm and LM head turn
a predicted feature into next-token logits. Drafting feeds the head its own predictions.

Only the head's own tensors are stored (fc, norms, attention, MLP, the draft vocabulary); the
embedding, final norm and LM head are taken from the target at load time. Logits cover a reduced
draft vocabulary (the most frequent tokens) mapped back to full-vocabulary ids: q is zero outside
it, which keeps verification exact and makes each draft step several times cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import ConfigError
from specdecode.models.native import output_rows
from specdecode.models.quant import embed_rows
from specdecode.models.rope import cos_sin, inv_freq
from specdecode.networks.layers import (
    DraftingSnapshot,
    LayerParams,
    LayerShape,
    decoder_layer,
    pack_matrix,
    packed,
    rows_linear,
)


@dataclass(frozen=True)
class HeadConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab_size: int  # the target's full vocabulary
    draft_vocab: int  # rows of the reduced output head

    @classmethod
    def for_target(cls, target, draft_vocab: int) -> "HeadConfig":
        c = target.config
        return cls(
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            target.vocab_size,
            min(draft_vocab, target.vocab_size),
        )


class EagleHead(DraftingSnapshot, nn.Module):
    config_class = HeadConfig

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.feat_norm = nn.Parameter(torch.ones(h))
        self.emb_norm = nn.Parameter(torch.ones(h))
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.ln1 = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, h, bias=False)
        self.ln2 = nn.Parameter(torch.ones(h))
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        # Full-vocabulary ids of the draft vocabulary's rows.
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab, dtype=torch.long))

    # -- frozen pieces taken from the target ---------------------------------------------------
    def attach(self, target) -> None:
        """Bind the target's embedding, final norm, LM head rows and RoPE (not parameters)."""
        w = target.weights
        if target.vocab_size != self.cfg.vocab_size or w.embed.shape[1] != self.cfg.hidden:
            raise ConfigError(
                f"EAGLE head was trained for vocab {self.cfg.vocab_size} / hidden {self.cfg.hidden}; "
                f"target has {target.vocab_size} / {w.embed.shape[1]}"
            )
        self.embed = w.embed
        self.norm_weight = w.norm.float()
        self.out_rows = output_rows(target, self.vocab_ids)
        self.inv_freq = inv_freq(target.config.rope, self.cfg.head_dim)

    def pack_for_drafting(self, target) -> None:
        """Snapshot the head's matrices in the native target's prepacked layout (about 2x faster
        draft steps); used under ``torch.no_grad`` until the head is put back in training mode."""
        layer, lin = packed(target, self._layer())
        if lin is F.linear:
            return
        self._packed = (pack_matrix(self.fc.weight), self.fc.bias.detach(), layer, lin, pack_matrix(self.out_rows))

    def _layer(self) -> LayerParams:
        return LayerParams(self.ln1, self.qkv.weight, self.o.weight, self.ln2, self.gate_up.weight, self.down.weight)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.embed, ids)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of features [..., hidden]."""
        normed = F.rms_norm(feats.float(), (self.cfg.hidden,), self.norm_weight, self.cfg.eps)
        fast = self._drafting()
        if fast is None:
            return F.linear(normed, self.out_rows)
        return rows_linear(fast[3], normed, fast[4], None)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(self.inv_freq, positions.reshape(-1), torch.float32)

    # -- the layer -----------------------------------------------------------------------------
    def forward(
        self,
        feats: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        start: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted next features [B, T, hidden] from feats, embeds [B, T, hidden].

        Training: no cache, causal attention within each row. Drafting (B = 1): ``keys``/``values``
        [1, kv_heads, capacity, head_dim] get the new entries at ``start``; ``mask`` (bool
        [T, start + T], True = may attend) defaults to causal.
        """
        c = self.cfg
        eps, h = c.eps, c.hidden
        x = torch.cat([F.rms_norm(feats, (h,), self.feat_norm, eps), F.rms_norm(embeds, (h,), self.emb_norm, eps)], -1)
        shape = LayerShape(h, c.heads, c.kv_heads, c.head_dim, c.intermediate, eps)
        fast = self._drafting()
        if fast is None:
            return decoder_layer(self.fc(x), self._layer(), shape, self.rope(positions), keys, values, start, mask)
        fc_w, fc_b, layer, lin = fast[:4]
        x = rows_linear(lin, x, fc_w, fc_b)
        return decoder_layer(x, layer, shape, self.rope(positions), keys, values, start, mask, lin)

    def init_from_target(self, target) -> None:
        """Start the layer from the target's last decoder layer (converges much faster)."""
        w = target.weights.layers[-1]
        if target.weights.linear is not F.linear:  # prepacked matrices: keep the random init
            return
        with torch.no_grad():
            self.qkv.weight.copy_(w.wqkv.float())
            self.o.weight.copy_(w.wo.float())
            self.gate_up.weight.copy_(w.wgu.float())
            self.down.weight.copy_(w.wd.float())
            self.ln1.copy_(w.ln1.float())
            self.ln2.copy_(w.ln2.float())
