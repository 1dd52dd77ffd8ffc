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

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import ConfigError, ModelLoadError
from specdecode.models.rope import cos_sin, inv_freq
from specdecode.train.layers import (DraftingSnapshot, LayerParams, LayerShape, decoder_layer, output_rows,
                                     pack_matrix, packed, rows_linear)


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
        return cls(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                   c.rms_norm_eps, target.vocab_size, min(draft_vocab, target.vocab_size))


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
        return F.embedding(ids, self.embed).float()

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


def head_loss(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, scale: float, noise: float = 0.0,
              valid: torch.Tensor | None = None, depth: int = 1, decay: float = 0.8):
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


# -- storage ------------------------------------------------------------------------------------

WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "card.json"


def save_head(head: EagleHead, folder: str | Path, card: dict, dtype: torch.dtype = torch.float16) -> Path:
    """Write the head's own tensors (``dtype``) and its JSON card into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"config": json.dumps(asdict(head.cfg))})
    digest = hashlib.sha256((folder / WEIGHTS_FILE).read_bytes()).hexdigest()
    card = dict(card, config=asdict(head.cfg), weights_sha256=digest, weights_dtype=str(dtype).replace("torch.", ""))
    (folder / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    return folder


def load_head(folder: str | Path, kind: type[nn.Module] | None = None) -> tuple[nn.Module, dict]:
    """The drafter (float32, eval mode) and its card from a folder written by :func:`save_head`.

    ``kind`` is the module class (default :class:`EagleHead`); its ``config_class`` parses the
    stored config.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    kind = kind or EagleHead
    folder = Path(folder)
    path = folder / WEIGHTS_FILE
    if not path.exists():
        raise ModelLoadError(f"no trained {kind.__name__} at {folder} (missing {WEIGHTS_FILE})")
    with safe_open(str(path), "pt") as f:
        cfg = kind.config_class(**json.loads(f.metadata()["config"]))
    head = kind(cfg)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    head.load_state_dict(tensors)
    card_path = folder / CARD_FILE
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    return head.eval(), card
