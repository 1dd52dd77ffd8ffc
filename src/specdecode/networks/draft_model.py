"""The distilled draft model: a few of the target's layers, fine-tuned, over a reduced vocabulary.

Initialised by layer pruning (the target's layers ``cfg.layers``, e.g. the first two and the
last, with its final norm), then distilled against the target's next-token distribution. Each
kept layer's matrices are the target's plus a trained low-rank delta ``B @ A`` (rank
``cfg.rank``); its norms and the final norm are trained outright. Only those trained tensors and
the draft vocabulary are stored: base matrices, input embedding and LM-head rows come from the
target at load time, so the file is a few MB although the layers are full size.

Logits cover the draft vocabulary (``vocab_ids``, the most frequent tokens) only. The runtime
model (:class:`ReducedVocabLM`, a native model with the deltas merged) exposes that map, and the
draft-model proposer reports q = 0 outside it, which keeps verification exact while each draft
step skips most of the LM head.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import ConfigError
from specdecode.models.native import LayerWeights, ReducedVocabLM, Weights, output_rows, pack_weights, target_matrix
from specdecode.models.quant import embed_rows
from specdecode.models.rope import cos_sin, inv_freq
from specdecode.networks.layers import LayerParams, LayerShape, decoder_layer
from specdecode.networks.storage import CARD_FILE, WEIGHTS_FILE, load_head, shipped_head_dir

KIND = "draft"  # folder of the shipped draft: drafters/<target>/draft/
MATRICES = ("wqkv", "wo", "wgu", "wd")


@dataclass(frozen=True)
class DraftConfig:
    layers: tuple[int, ...]  # the target's layers the draft is built from, in order
    rank: int  # of the trained delta on every matrix
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab_size: int  # the target's full vocabulary
    draft_vocab: int  # rows of the reduced output head
    target_layers: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))  # JSON gives a list

    @classmethod
    def for_target(cls, target, layers: tuple[int, ...], rank: int, draft_vocab: int) -> "DraftConfig":
        """The config of a draft over ``target``'s ``layers`` (negative indices count from the end)."""
        c = target.config
        n = c.num_layers
        if not layers or any(not -n <= i < n for i in layers):
            raise ConfigError(f"draft layers must be indices of the target's {n} layers, got {list(layers)}")
        if rank < 1:
            raise ConfigError(f"the draft's delta rank must be >= 1, got {rank}")
        chosen = tuple(dict.fromkeys(i % n for i in layers))  # (0, 1, -1) on a 2-layer target: (0, 1)
        return cls(
            chosen,
            rank,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            target.vocab_size,
            min(draft_vocab, target.vocab_size),
            n,
        )

    @property
    def shape(self) -> LayerShape:
        return LayerShape(self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate, self.eps)

    def dims(self, name: str) -> tuple[int, int]:
        """(out, in) of one fused matrix."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return {
            "wqkv": (qkv, self.hidden),
            "wo": (self.hidden, self.heads * self.head_dim),
            "wgu": (2 * self.intermediate, self.hidden),
            "wd": (self.hidden, self.intermediate),
        }[name]

    def macs_per_token(self) -> tuple[int, int]:
        """Multiply-adds of the matrices per token (attention over the context excluded): (draft, target)."""
        layer = sum(o * i for o, i in map(self.dims, MATRICES))
        draft = len(self.layers) * layer + self.draft_vocab * self.hidden
        return draft, self.target_layers * layer + self.vocab_size * self.hidden


class _Delta(nn.Module):
    """One layer's trained tensors: norms and a low-rank delta per fused matrix."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.ln1 = nn.Parameter(torch.ones(cfg.hidden))
        self.ln2 = nn.Parameter(torch.ones(cfg.hidden))
        for name in MATRICES:
            out, inp = cfg.dims(name)
            # B = 0: training starts exactly at the pruned target.
            setattr(self, f"a_{name}", nn.Parameter(torch.randn(cfg.rank, inp) / inp**0.5))
            setattr(self, f"b_{name}", nn.Parameter(torch.zeros(out, cfg.rank)))

    def delta(self, name: str) -> torch.Tensor:
        return getattr(self, f"b_{name}") @ getattr(self, f"a_{name}")


class DistilledDraft(nn.Module):
    """The trainable draft; :meth:`attach` binds the target's frozen tensors before use."""

    config_class = DraftConfig

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(_Delta(cfg) for _ in cfg.layers)
        self.norm = nn.Parameter(torch.ones(cfg.hidden))
        self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab, dtype=torch.long))

    def attach(self, target) -> None:
        """Bind the target's layer matrices (and biases), embedding, final norm, LM-head rows, RoPE."""
        c, w = self.cfg, target.weights
        if (target.vocab_size, w.embed.shape[1], target.config.num_layers) != (c.vocab_size, c.hidden, c.target_layers):
            raise ConfigError(
                f"draft was built for vocab {c.vocab_size} / hidden {c.hidden} / {c.target_layers} layers; target has "
                f"{target.vocab_size} / {w.embed.shape[1]} / {target.config.num_layers}"
            )
        self.base = [self._base(target, w.layers[i]) for i in c.layers]
        self.embed = w.embed
        self.teacher_norm = w.norm.float()
        self.out_rows = output_rows(target, self.vocab_ids)
        self.inv_freq = inv_freq(target.config.rope, c.head_dim)

    def _base(self, target, layer: LayerWeights) -> dict[str, torch.Tensor | None]:
        c = self.cfg
        base = {name: target_matrix(target, getattr(layer, name), c.dims(name)[1]) for name in MATRICES}
        for name in ("bqkv", "bo", "bgu", "bd"):
            bias = getattr(layer, name)
            base[name] = None if bias is None else bias.float()
        return base

    def init_from_target(self, target) -> None:
        """Start every norm from the target's (with B = 0 the draft is exactly the pruned target)."""
        w = target.weights
        with torch.no_grad():
            for delta, i in zip(self.layers, self.cfg.layers):
                delta.ln1.copy_(w.layers[i].ln1.float())
                delta.ln2.copy_(w.layers[i].ln2.float())
            self.norm.copy_(w.norm.float())

    def params(self, i: int) -> LayerParams:
        """Layer i's effective tensors: the target's matrices plus the trained deltas."""
        delta, base = self.layers[i], self.base[i]
        merged = {name: base[name] + delta.delta(name) for name in MATRICES}
        return LayerParams(
            ln1=delta.ln1, ln2=delta.ln2, **merged, bqkv=base["bqkv"], bo=base["bo"], bgu=base["bgu"], bd=base["bd"]
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [B, T, draft_vocab] of token windows [B, T] (causal, from position 0)."""
        x = embed_rows(self.embed, tokens)  # [B, T, hidden] float32
        rope = cos_sin(self.inv_freq, torch.arange(tokens.shape[1]), torch.float32)
        for i in range(len(self.layers)):
            x = decoder_layer(x, self.params(i), self.cfg.shape, rope)
        return F.linear(F.rms_norm(x, (self.cfg.hidden,), self.norm, self.cfg.eps), self.out_rows)

    def teacher_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the draft vocabulary from its pre-norm features [..., hidden]."""
        return F.linear(F.rms_norm(feats.float(), (self.cfg.hidden,), self.teacher_norm, self.cfg.eps), self.out_rows)

    @torch.no_grad()
    def to_native(self, target) -> "ReducedVocabLM":
        """The runtime model: deltas merged, the target's dtype, prepacked when the target is."""
        dtype = target.dtype
        layers = []
        for i in range(len(self.layers)):
            p = self.params(i)
            layers.append(
                LayerWeights(
                    ln1=p.ln1.detach().float().clone(),
                    wqkv=p.wqkv.to(dtype),
                    bqkv=_cast(p.bqkv, dtype),
                    wo=p.wo.to(dtype),
                    bo=_cast(p.bo, dtype),
                    ln2=p.ln2.detach().float().clone(),
                    wgu=p.wgu.to(dtype),
                    bgu=_cast(p.bgu, dtype),
                    wd=p.wd.to(dtype),
                    bd=_cast(p.bd, dtype),
                )
            )
        weights = Weights(
            embed=target.weights.embed,
            layers=layers,
            norm=self.norm.detach().float().clone(),
            lm_head=self.out_rows.to(dtype).contiguous(),
        )
        if target.weights.linear is not F.linear:
            pack_weights(weights)
        config = dataclasses.replace(target.config, num_layers=len(layers))
        return ReducedVocabLM(config, weights, self.vocab_ids.clone(), dtype)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


# -- storage ------------------------------------------------------------------------------------


def shipped_draft_dir(source: str | os.PathLike) -> Path:
    return shipped_head_dir(source, KIND)


def is_distilled(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder written by ``specdecode train draft-model``."""
    card = Path(path) / CARD_FILE
    return card.is_file() and json.loads(card.read_text()).get("method") == "draft-model"


def load_distilled(target, path: str | os.PathLike) -> tuple[ReducedVocabLM, dict]:
    """The runtime draft (over the native ``target``) and its card from a trained folder."""
    if getattr(target, "backend", None) != "native":
        raise ConfigError("the distilled draft needs the native backend (it borrows the target's layers)")
    draft, card = load_head(path, DistilledDraft)
    draft.attach(target)
    return draft.to_native(target), card


def shipped_draft(target, source: str | os.PathLike) -> ReducedVocabLM:
    """The distilled draft shipped for the target loaded from ``source``; ConfigError when none ships."""
    folder = shipped_draft_dir(source)
    if not (folder / WEIGHTS_FILE).exists():
        raise ConfigError(
            f"method 'draft' needs a draft model: none ships for this target (missing {folder / WEIGHTS_FILE}); pass "
            "--draft PATH (a model sharing its tokenizer) or train one with: specdecode train draft-model --out DIR"
        )
    return load_distilled(target, folder)[0]
