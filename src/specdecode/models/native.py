"""Native PyTorch Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) with a static KV cache.

Built for small-batch CPU decoding: fused QKV and gate/up weights, one preallocated cache whose
trim is O(1), and a forward that takes any number of new tokens with optional explicit positions
and attention mask (for tree verification).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specdecode.errors import ConfigError, ModelLoadError
from specdecode.models import hugepages, int8dot, quant_store
from specdecode.models.base import ModelCaps
from specdecode.models.gguf_source import GGUFTensors
from specdecode.models.loading import LoadedModel, gguf_source
from specdecode.models.quant import (
    ACT,
    DOT_KINDS,
    QuantMatrix,
    _w4a8,
    act_dtype,
    attach_prompt_copy,
    can_embed,
    embed_rows,
    plan_rows,
    quant_linear,
    quantize_matrix,
    select_rows,
)
from specdecode.models.rope import SUPPORTED_ROPE_TYPES, RopeConfig, cos_sin, inv_freq
from specdecode.models.static_cache import StaticKVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class NativeConfig:
    """The parts of a transformers config.json the native decoder uses."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    sliding_window: int | None  # window of the sliding layers; None when every layer attends fully
    eos_token_id: int | tuple[int, ...] | None = None  # read by loading.eos_token_ids

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "NativeConfig":
        """Parse a config.json dict; call :func:`unsupported_reason` first to refuse what this can't run."""
        heads = int(cfg["num_attention_heads"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        return cls(
            model_type=cfg["model_type"],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_config(cfg, max_pos),
            sliding_window=_active_window(cfg),
            eos_token_id=tuple(eos) if isinstance(eos := cfg.get("eos_token_id"), list) else eos,
        )

    @property
    def max_length(self) -> int:
        """Longest sequence served exactly: within a sliding window, sliding and full attention agree."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)


def _active_window(cfg: dict[str, Any]) -> int | None:
    """The sliding window some layer really uses (Mistral, Qwen2 with use_sliding_window), else None."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if cfg.get("model_type") == "qwen2":
        layer_types = cfg.get("layer_types")
        if layer_types is not None:
            return int(window) if "sliding_attention" in layer_types else None
        active = cfg.get("use_sliding_window", False) and cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"]
        return int(window) if active else None
    return int(window)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a transformers folder as a dict; ModelLoadError when missing or unreadable."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def unsupported_reason(cfg: dict[str, Any], model_dir: Path | None = None) -> str | None:
    """Why the native path cannot run this config (and folder), or None when it can."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"activation {cfg['hidden_act']!r} (only silu)"
    if cfg.get("quantization_config"):
        return "quantized checkpoints are not supported"
    layer_types = set(cfg.get("layer_types") or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layer_types)}"
    rope = RopeConfig.from_config(cfg, int(cfg.get("max_position_embeddings", 2048)))
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        return f"rope type {rope.rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    if rope.partial_rotary_factor != 1.0:
        return "partial rotary embeddings"
    if model_dir is not None and not _safetensors_files(model_dir) and gguf_source(model_dir) is None:
        return "no safetensors weights in the folder"
    return None


def supports(model_dir: str | Path) -> bool:
    """True when the native path can load this transformers folder."""
    try:
        return unsupported_reason(read_config(model_dir), Path(model_dir)) is None
    except ModelLoadError:
        return False


# -- weights ----------------------------------------------------------------------------------


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused into single matrices (fewer, larger matmuls)."""

    ln1: torch.Tensor
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    wgu: torch.Tensor  # [2 * intermediate, hidden]: gate rows then up rows
    bgu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None


@dataclass
class Weights:
    """All tensors of the model; ``linear`` is how matrices are applied (plain or prepacked)."""

    # [vocab, hidden], read through quant.embed_rows: quantized like the matrices where its rows
    # read back (the Qwen 1.5B's Q4_K table: 146 MB, not 467 MB in bf16); a tied model's head itself
    embed: torch.Tensor | QuantMatrix
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor | QuantMatrix  # [vocab, hidden]; the same object as ``embed`` when tied, unless packed
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear

    @property
    def prepacked(self) -> bool:
        """Whether ``linear`` takes matrices in oneDNN's blocked layout (:func:`pack_weights`), so
        a drafter's float matrices must be reordered the same way to go through it. A quantized
        model's ``linear`` is not: it takes plain float matrices as they are."""
        return self.linear is _mkldnn_linear


def _safetensors_files(model_dir: str | Path) -> list[Path]:
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(model_dir):
        tensors.update(load_file(str(f)))
    return tensors


def _tensor_source(model_dir: Path, config: NativeConfig) -> GGUFTensors | dict[str, torch.Tensor]:
    """Where the weights come from: the GGUF a cache folder was made from (dequantized one tensor at
    a time), else the folder's safetensors."""
    gguf = gguf_source(model_dir)
    if gguf is not None:
        return GGUFTensors(gguf, config.num_heads, config.num_kv_heads)
    return _read_tensors(model_dir)


def load_weights(model_dir: Path, config: NativeConfig, dtype: torch.dtype, quant: str | None = None) -> Weights:
    """Read, fuse and cast the checkpoint's tensors; ModelLoadError naming any missing tensor.

    ``quant`` ("int8", "int4", "w8a8" or "w4a8") quantizes every matrix, layer by layer as it is read,
    and the embedding table too where its rows read back (a tied model looks them up in its
    quantized head; torch's opaque int4 keeps a bf16 table), and stores the result once beside a GGUF's config
    (:mod:`quant_store`); ``dtype`` is then the activations' dtype.
    """
    store = quant_store.store_path(model_dir, quant) if quant and gguf_source(model_dir) is not None else None
    if store is not None and (slots := quant_store.load(store)) is not None:
        return _from_slots(slots, config)
    raw = _tensor_source(model_dir, config)
    matrix_dtype = torch.float32 if quant else dtype  # quantized from float32, one layer at a time

    def take(name: str, optional: bool = False, as_dtype: torch.dtype = matrix_dtype) -> torch.Tensor | None:
        t = raw.pop(name, None)
        if t is None and not optional:
            raise ModelLoadError(f"{model_dir}: checkpoint has no tensor {name!r}")
        return None if t is None else t.to(as_dtype).contiguous()

    head_kind = _kind(raw, quant, ["lm_head.weight"] if "lm_head.weight" in raw else ["model.embed_tokens.weight"])
    embed_kind = _kind(raw, quant, ["model.embed_tokens.weight"])
    embed = take("model.embed_tokens.weight", optional=True)
    head = take("lm_head.weight", optional=True)
    if config.tie_word_embeddings or head is None:
        # Tied checkpoints may store either name (safetensors keeps one copy of shared tensors).
        embed = head = embed if embed is not None else head
    if embed is None or head is None:
        raise ModelLoadError(f"{model_dir}: checkpoint has no embedding or output matrix")
    if quant:
        tied = embed is head
        head = quantize_matrix(head, head_kind)
        if tied:  # the head's own quantized rows, else (torch's opaque int4) the same bf16 table as before
            embed = head if can_embed(head) else embed.to(ACT)
        else:
            embed = _embedding(embed, embed_kind)
    layers = []
    for i in range(config.num_layers):
        kinds = {m: _kind(raw, quant, names) for m, names in _layer_sources(f"model.layers.{i}.").items()}
        layer = _layer(take, f"model.layers.{i}.")
        layers.append(_quantize_layer(layer, kinds) if quant else layer)
    norm = take("model.norm.weight", as_dtype=torch.float32)
    weights = Weights(embed=embed, layers=layers, norm=norm, lm_head=head)
    if quant:
        weights.linear = quant_linear
    if store is not None:  # before the arena: torch.save refuses one storage viewed as several dtypes
        quant_store.save(_to_slots(weights), store)
    if quant:
        into_huge_pages(weights)  # a store read back is placed as it loads
    return weights


_LAYER_FIELDS = [f.name for f in dataclasses.fields(LayerWeights)]


def _to_slots(w: Weights) -> dict[str, Any]:
    slots: dict[str, Any] = {"embed": w.embed, "norm": w.norm}
    slots["lm_head"] = None if w.lm_head is w.embed else w.lm_head
    for i, layer in enumerate(w.layers):
        slots.update({f"layers.{i}.{n}": getattr(layer, n) for n in _LAYER_FIELDS})
    return slots


def _from_slots(slots: dict[str, Any], config: NativeConfig) -> Weights:
    layers = [
        LayerWeights(**{n: slots.get(f"layers.{i}.{n}") for n in _LAYER_FIELDS}) for i in range(config.num_layers)
    ]
    embed = slots["embed"]
    head = slots.get("lm_head", embed)
    return Weights(embed=embed, layers=layers, norm=slots["norm"], lm_head=head, linear=quant_linear)


def _layer_sources(p: str) -> dict[str, list[str]]:
    """The checkpoint tensors each fused layer matrix is made of."""
    a, m = p + "self_attn.", p + "mlp."
    return {
        "wqkv": [f"{a}{x}_proj.weight" for x in "qkv"],
        "wo": [a + "o_proj.weight"],
        "wgu": [m + "gate_proj.weight", m + "up_proj.weight"],
        "wd": [m + "down_proj.weight"],
    }


_EIGHT_BIT = {"int4": "int8", "w4a8": "w8a8g"}  # where a 4-bit kind keeps 5- to 8-bit sources


def _kind(raw: Any, quant: str | None, names: list[str]) -> str | None:
    """A 4-bit kind only where every source tensor is 4-bit in the GGUF (a 5- to 8-bit one goes
    to 8 bits without the 4-bit attempt, which costs seconds a matrix); unknown sources try 4 bits."""
    if quant not in _EIGHT_BIT or not isinstance(raw, GGUFTensors):
        return quant
    bits = [b for b in map(raw.low_bit, names) if b is not None]
    return quant if bits and all(bits) else _EIGHT_BIT[quant]


def _embedding(embed: torch.Tensor, kind: str) -> QuantMatrix | torch.Tensor:
    """An embedding table quantized like a matrix of ``kind`` where its rows read back (a 4-bit
    GGUF table keeps its grid: 0.6 bytes a weight, not bf16's 2), else bf16."""
    table = quantize_matrix(embed, kind)
    return table if isinstance(table, QuantMatrix) and table.has_rows else embed.to(ACT)


def _quantize_layer(w: LayerWeights, kinds: dict[str, str]) -> LayerWeights:
    bias = lambda b: None if b is None else b.to(ACT)  # noqa: E731
    return dataclasses.replace(
        w,
        wqkv=quantize_matrix(w.wqkv, kinds["wqkv"]),
        wo=quantize_matrix(w.wo, kinds["wo"]),
        wgu=quantize_matrix(w.wgu, kinds["wgu"]),
        wd=quantize_matrix(w.wd, kinds["wd"]),
        bqkv=bias(w.bqkv),
        bo=bias(w.bo),
        bgu=bias(w.bgu),
        bd=bias(w.bd),
    )


def into_huge_pages(w: Weights) -> None:
    """Move ``w``'s dense and quantized tensors into one huge-page arena in place (:mod:`hugepages`),
    each swapped as it is copied so the originals are freed one by one; oneDNN-packed matrices stay.
    A tied head stays the same object as the embedding."""
    slots = [("embed", w), ("norm", w), ("lm_head", w)] + [(n, layer) for layer in w.layers for n in _LAYER_FIELDS]
    values = {id(v): v for v in (getattr(owner, name) for name, owner in slots)}  # a tied table once
    arena = hugepages.Arena.sized_for(t for v in values.values() for t in _tensors(v))
    del values
    if arena is None:
        return
    moved: dict[int, Any] = {}  # id of an original -> its copy
    for name, owner in slots:
        v = getattr(owner, name)
        if id(v) not in moved:
            is_quant = isinstance(v, QuantMatrix)
            moved[id(v)] = (
                dataclasses.replace(v, tensors=tuple(map(arena.take, v.tensors))) if is_quant else arena.take(v)
            )
        setattr(owner, name, moved[id(v)])
    hugepages.release_freed()


def _tensors(v: Any) -> tuple[Any, ...]:
    return v.tensors if isinstance(v, QuantMatrix) else (v,)


def matrices(weights: Weights) -> list[Any]:
    """Every matrix a decode step reads: each layer's four, then the output head."""
    return [m for w in weights.layers for m in (w.wqkv, w.wo, w.wgu, w.wd)] + [weights.lm_head]


def quant_matrices(weights: Weights) -> list[QuantMatrix]:
    """Every quantized matrix of the model (none for float weights)."""
    return [m for m in matrices(weights) if isinstance(m, QuantMatrix)]


def _layer(take: Callable[..., torch.Tensor | None], p: str) -> LayerWeights:
    src = _layer_sources(p)

    def fused(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The matrix ``name`` (its sources stacked) and its bias, None unless every source has one."""
        parts = [take(n) for n in src[name]]
        biases = [take(n.removesuffix("weight") + "bias", optional=True) for n in src[name]]
        bias = (biases[0] if len(biases) == 1 else torch.cat(biases)) if all(b is not None for b in biases) else None
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), bias

    (wqkv, bqkv), (wo, bo), (wgu, bgu), (wd, bd) = (fused(n) for n in ("wqkv", "wo", "wgu", "wd"))
    return LayerWeights(
        ln1=take(p + "input_layernorm.weight", as_dtype=torch.float32),
        wqkv=wqkv,
        bqkv=bqkv,
        wo=wo,
        bo=bo,
        ln2=take(p + "post_attention_layernorm.weight", as_dtype=torch.float32),
        wgu=wgu,
        bgu=bgu,
        wd=wd,
        bd=bd,
    )


# -- forward ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dims:
    """Integers the layer loop needs, precomputed once."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    dtype: torch.dtype  # of the matrices; activations between them stay float32
    row_exact: bool = False  # attention row by row: k-token verify bitwise equal to 1-token decode
    fused: bool = False  # row_exact attention (and RoPE, cache write) in one int8dot.attend_rows call


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _norm(x: torch.Tensor, weight: torch.Tensor, d: _Dims) -> torch.Tensor:
    """RMSNorm of the float32 stream, handed to the next matmul in the matrices' dtype."""
    y = int8dot.rms_norm(x.contiguous(), weight, d.eps) if d.fused else F.rms_norm(x, (d.hidden,), weight, d.eps)
    return y if y.dtype == d.dtype else y.to(d.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' rotate-half convention: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class _Seq:
    """One sequence's share of a forward: rows ``[lo, hi)`` of the input, written to its cache at ``start``."""

    keys: torch.Tensor  # [layers, 1, kv_heads, capacity, head_dim]
    values: torch.Tensor  # [layers, 1, kv_heads, capacity, head_dim]
    start: int
    lo: int
    hi: int
    mask: torch.Tensor | None  # [1, 1, hi - lo, start + hi - lo]; None: one token that sees everything


def _attention(
    x: torch.Tensor,
    w: LayerWeights,
    lin: Linear,
    layer: int,
    seqs: list[_Seq],
    rope: tuple[torch.Tensor, torch.Tensor],
    d: _Dims,
) -> torch.Tensor:
    """Self-attention of ``x`` [n, hidden] (the rows of every sequence) over each sequence's cache.

    The projections run once over all rows (one read of the weights for the whole batch); the
    attention itself runs per sequence, over that sequence's cache only.
    """
    n, hq, hkv, hd = x.shape[0], d.heads, d.kv_heads, d.head_dim
    qkv = lin(_norm(x, w.ln1, d), w.wqkv, w.bqkv)
    qkv = qkv if qkv.dtype == torch.float32 else qkv.float()
    if d.fused:
        out = _attend_fused(qkv, layer, seqs, rope, d)  # float32
        return lin(out if out.dtype == d.dtype else out.to(d.dtype), w.wo, w.bo)
    # q and k rotate together: one set of elementwise ops instead of two.
    qk = _rotate(qkv[:, : (hq + hkv) * hd].view(n, hq + hkv, hd), rope[0], rope[1])
    v = qkv[:, (hq + hkv) * hd :].view(n, hkv, hd)
    outs = [_attend(qk[s.lo : s.hi], v[s.lo : s.hi], s.keys[layer], s.values[layer], s.start, s.mask, d) for s in seqs]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return lin(out.to(d.dtype), w.wo, w.bo)


def _attend_fused(
    qkv: torch.Tensor, layer: int, seqs: list[_Seq], rope: tuple[torch.Tensor, torch.Tensor], d: _Dims
) -> torch.Tensor:
    """Every sequence's rows through the C++ kernel (same contract as the row-by-row path: each
    row as its own 1-token decode would compute it); float32 [n, heads * head_dim]."""
    cos, sin = rope[0][:, 0], rope[1][:, 0]  # [n, head_dim]
    outs = [
        int8dot.attend_rows(
            qkv[s.lo : s.hi],
            cos[s.lo : s.hi],
            sin[s.lo : s.hi],
            s.keys[layer, 0],
            s.values[layer, 0],
            s.start,
            None if s.mask is None else s.mask[0, 0].contiguous(),
            d.heads,
            d.kv_heads,
        )
        for s in seqs
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend(
    qk: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
    d: _Dims,
) -> torch.Tensor:
    """One sequence: store its new keys/values at ``start``, attend; [n, heads * head_dim] float32.

    RoPE, the cache and attention run in float32 even for bf16 matrices: on CPU, SDPA over a
    bf16 cache measured ~7x slower for one query (140 vs 19 us per layer), and it is more exact.
    """
    n, hq, hkv = qk.shape[0], d.heads, d.kv_heads
    end = start + n
    keys[0, :, start:end] = qk[:, hq:].transpose(0, 1)
    values[0, :, start:end] = v.transpose(0, 1)
    q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
    if d.row_exact and n > 1:
        out = _attention_by_row(q, keys[:, :, :end], values[:, :, :end], mask, hkv != hq)
    else:
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=hkv != hq
        )
    return out[0].transpose(0, 1).reshape(n, hq * d.head_dim)


def _attention_by_row(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gqa: bool
) -> torch.Tensor:
    """Each query row alone over exactly the keys it may see, as a 1-token decode would run it.

    SDPA's multi-row kernel can differ from its one-row kernel in the last bit; in bf16 that is
    enough to flip greedy ties, so plain and speculative decoding would part ways.
    """
    n = q.shape[2]
    rows = []
    for i in range(n):
        allowed = mask[0, 0, i]
        seen = int(allowed.sum())
        if bool(allowed[:seen].all()):  # a prefix (chains): slice, no copy
            k_i, v_i = keys[:, :, :seen], values[:, :, :seen]
        else:  # a tree row: gather its ancestors
            idx = allowed.nonzero().squeeze(-1)
            k_i, v_i = keys[:, :, idx], values[:, :, idx]
        rows.append(F.scaled_dot_product_attention(q[:, :, i : i + 1], k_i, v_i, enable_gqa=gqa))
    return torch.cat(rows, dim=2)


def _mlp(x: torch.Tensor, w: LayerWeights, lin: Linear, d: _Dims) -> torch.Tensor:
    gate_up = lin(_norm(x, w.ln2, d), w.wgu, w.bgu)
    if d.fused and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
        return lin(int8dot.silu_mul(gate_up), w.wd, w.bd)  # one call for split, silu and mul
    gate, up = gate_up.split(d.intermediate, dim=-1)
    return lin(F.silu(gate) * up, w.wd, w.bd)


def _decoder(
    x: torch.Tensor,
    weights: Weights,
    seqs: list[_Seq],
    rope: tuple[torch.Tensor, torch.Tensor],
    d: _Dims,
    last_rows: list[int] | None = None,
    hidden: list | None = None,
    lin: Linear | None = None,
) -> torch.Tensor:
    """All layers, final norm and output head: float32 ``x`` [n, hidden] -> logits [n, vocab].

    ``last_rows`` applies the head to those rows only (prefill: the other rows are unused).
    ``hidden``, when given, receives the last layer's output (before the final norm, all rows).

    The residual stream stays float32 whatever the matrices' dtype (cheap next to the matmuls,
    and bf16 text then tracks fp32 text more closely).
    """
    lin = lin or weights.linear
    for i, w in enumerate(weights.layers):
        x = x + _attention(x, w, lin, i, seqs, rope, d)
        x = x + _mlp(x, w, lin, d)
    return _head(x, weights, d, last_rows, hidden, lin)


def _head(
    x: torch.Tensor,
    weights: Weights,
    d: _Dims,
    last_rows: list[int] | None,
    hidden: list | None,
    lin: Linear,
) -> torch.Tensor:
    """The last layer's output ``x`` [n, hidden] -> logits [rows, vocab] (:func:`_decoder`'s end)."""
    if hidden is not None:
        hidden.append(x)
    if last_rows is not None:
        if not last_rows:  # no row needs logits (a prefill chunk): skip the output head
            return x.new_zeros(0, weights.embed.shape[0])
        x = x[last_rows]
    return lin(_norm(x, weights.norm, d), weights.lm_head, None)


# -- every layer in one C++ call ------------------------------------------------------------------
# The Python loop above costs ~8 calls a layer through several frames each: ~2.6 ms of a 27 ms
# 1-token forward of the Qwen 1.5B on a Zen 4, ~4 ms of a 9-token one. A quantized model whose
# every matrix runs on int8dot makes the same kernel calls from C++ instead (csrc/layers.cpp),
# bitwise the same output; any other model keeps the loop.


LAYER_STACK_ENV = "SPECDECODE_LAYER_STACK"  # 0: keep the Python loop (to compare)


def layer_stack(weights: Weights, d: _Dims) -> Any | None:
    """``weights``' layers as an int8dot ``LayerStack``, or None where it would not compute
    exactly what :func:`_decoder`'s loop does: attention must be the fused kernel, activations
    float32, matrices applied by :func:`quant_linear`, and every matrix an int8dot kind with no
    padded columns (the loop would slice those) or split calls. A bias is added as the loop adds it."""
    if os.environ.get(LAYER_STACK_ENV) == "0":
        return None
    if not (d.fused and d.dtype == torch.float32 and weights.linear is quant_linear and weights.layers):
        return None
    layers = []
    for w in weights.layers:
        mats = {"qkv": (w.wqkv, w.bqkv), "o": (w.wo, w.bo), "gu": (w.wgu, w.bgu), "down": (w.wd, w.bd)}
        if not all(_stackable(m, b) for m, b in mats.values()) or w.wgu.shape[0] != 2 * d.intermediate:
            return None
        layer = {name: _stack_matrix(m, b) for name, (m, b) in mats.items()}
        layers.append({**layer, "ln1": w.ln1, "ln2": w.ln2})
    if any(t.dtype != torch.float32 for w in weights.layers for t in (w.ln1, w.ln2)):
        return None
    return int8dot.layer_stack(layers, d.heads, d.kv_heads, d.eps)


def _stackable(m: Any, bias: torch.Tensor | None) -> bool:
    if not isinstance(m, QuantMatrix) or m.kind not in DOT_KINDS or m.plan.costs:  # a plan: split calls
        return False
    tile = int8dot.U4_TILE if m.kind == "w4a8" else int8dot.TILE
    return m.shape[0] % tile == 0


def _stack_matrix(m: QuantMatrix, bias: torch.Tensor | None) -> dict[str, Any]:
    scale = m.tensors[1] if m.kind == "w8a8g" else None
    return {"kind": m.kind, "packed": m.tensors[0], "scale": scale, "bias": bias, "out": m.shape[0], "in": m.shape[1]}


def _stacked(stack: Any, x: torch.Tensor, seqs: list[_Seq], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every layer through ``stack``: float32 ``x`` [n, hidden] -> the last layer's output."""
    masks = [int8dot.CAUSAL if s.mask is None else s.mask[0, 0].contiguous() for s in seqs]
    return stack.forward(
        x,
        cos,
        sin,
        [s.keys for s in seqs],
        [s.values for s in seqs],
        [s.start for s in seqs],
        [s.lo for s in seqs],
        [s.hi for s in seqs],
        masks,
        int8dot.row_block(),
    )


# -- prompt chunks on bf16 copies ------------------------------------------------------------------
# A prompt chunk of many rows makes the int8dot kernels compute-bound (~0.7 int8 TOPS on 2 Xeon
# cores), where oneDNN's bf16 matmul over a packed copy of the same matrix runs ~3x faster (AMX).
# Exactness needs only that a chunk's rows come out the same alone and in any batch: the copy
# multiplies each chunk in its own call, whose result depends on the chunk alone (its length is
# fixed by the prompt and the chunk size), and every other row goes to the int8dot kernels as before.

# Row blocks of the matmuls: a row's result depends on its offset in the forward modulo this
# (fp32 sgemm blocks rows by 16; the int8dot and bf16 paths are row-exact), so a prompt split at
# a multiple of it is computed bitwise as one forward (tests/engine/test_prefix_cache.py).
PREFIX_ALIGN = 16
PROMPT_ROWS_MIN = 32  # shorter chunks stay on int8dot (measured crossover ~16 rows on the Xeon)
PROMPT_COPIES_ENV = "SPECDECODE_PROMPT_COPIES"  # 0: never make them, 1: always (else measured)


class _PromptRows:
    """``Weights.linear`` for one forward whose rows ``spans`` ([lo, hi) each) are prompt chunks."""

    def __init__(self, base: Linear, spans: list[tuple[int, int]], n: int) -> None:
        self.base, self.spans, self.n = base, spans, n
        covered = torch.zeros(n, dtype=torch.bool)
        for lo, hi in spans:
            covered[lo:hi] = True
        self.rest = (~covered).nonzero().squeeze(-1)  # [rows not in a chunk]

    def __call__(self, x: torch.Tensor, w: Any, b: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(w, QuantMatrix) or w.prompt_copy is None or x.shape[0] != self.n:
            return self.base(x, w, b)  # the output head (last rows only) and matrices without a copy
        if len(self.spans) == 1 and self.rest.numel() == 0:
            y = _on_copy(x, w)
        else:
            y = x.new_empty(self.n, w.shape[0], dtype=torch.float32)  # [n, out]
            if self.rest.numel():
                y[self.rest] = self.base(x[self.rest], w, None).float()
            for lo, hi in self.spans:
                y[lo:hi] = _on_copy(x[lo:hi], w)
        return y if b is None else y + b


def _on_copy(x: torch.Tensor, w: QuantMatrix) -> torch.Tensor:
    """``x`` [n, in] by ``w``'s prompt copy -> float32 [n, out]: a row's bits depend on ``x`` and n only."""
    return _mkldnn_linear(x.to(torch.bfloat16), w.prompt_copy, None).float()


def prompt_copies_pay() -> bool:
    """Whether bf16 prompt copies beat the int8dot kernels on this machine's prompt chunks:
    ``SPECDECODE_PROMPT_COPIES`` if set, else measured once (64 rows by a gate/up-sized matrix)
    and cached (:func:`~specdecode.models.kernels.choose`); never without oneDNN's bf16 packing."""
    import os

    forced = os.environ.get(PROMPT_COPIES_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    if not int8dot.available() or not _packing_works(torch.randn(64, 64).bfloat16()):
        return False
    from specdecode.models.kernels import choose

    def make() -> Callable[[str], None]:
        n_out, n_in = 17920, 1536  # 4-bit levels on their grid: random floats would make 8-bit tiles
        q = torch.randint(0, 16, (n_out, n_in), dtype=torch.uint8)
        scale = torch.rand(n_out, n_in // int8dot.GROUP) * 0.01
        m = _w4a8((n_out, n_in), q, scale, scale)
        attach_prompt_copy(m)
        x = torch.randn(64, n_in)
        return lambda option: _on_copy(x, m) if option == "bf16" else m(x)

    return choose("prompt-rows-u4", ("int8dot", "bf16"), make) == "bf16"


def attach_prompt_copies(weights: Weights) -> None:
    """Give every layer matrix on the int8dot kernels its bf16 prompt copy."""
    todo = [
        m
        for layer in weights.layers
        for m in (layer.wqkv, layer.wo, layer.wgu, layer.wd)
        if isinstance(m, QuantMatrix) and m.kind in DOT_KINDS and m.prompt_copy is None
    ]
    if not todo:
        return
    staging = torch.empty(max(m.shape[0] * m.shape[1] for m in todo), dtype=torch.bfloat16)
    for m in todo:
        attach_prompt_copy(m, staging)


# -- prepacked matrices -------------------------------------------------------------------------


def _mkldnn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] == 1:
        # oneDNN takes a different kernel for one row, whose sums can differ in the last bit from
        # the multi-row kernel's; two rows keep 1-token decode bitwise equal to k-token verify
        # (greedy bf16 speculation then matches plain decoding) at the same weight traffic.
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), w, b, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def pack_weights(weights: Weights) -> bool:
    """Reorder every matrix into oneDNN's blocked layout in place; False (unchanged) if unavailable.

    Measured on the 2-core AVX-512 dev box (BENCHMARKS.md): about 2x faster than ``F.linear`` for
    1-8 rows in both fp32 and bf16, and a row's result does not depend on how many rows share the
    call, so 1-token decode and k-token verify agree.
    """
    if not _packing_works(weights.layers[0].wqkv):
        return False
    pack = torch.ops.mkldnn._reorder_linear_weight
    for w in weights.layers:
        w.wqkv, w.wo, w.wgu, w.wd = pack(w.wqkv), pack(w.wo), pack(w.wgu), pack(w.wd)
    weights.lm_head = pack(weights.lm_head)
    weights.linear = _mkldnn_linear
    return True


def _packing_works(sample: torch.Tensor) -> bool:
    """Whether this build has the oneDNN ops and they agree with ``F.linear`` on ``sample``."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        x = torch.randn(3, sample.shape[1], dtype=sample.dtype)
        packed = _mkldnn_linear(x, torch.ops.mkldnn._reorder_linear_weight(sample), None).float()
        plain = F.linear(x, sample).float()
        return bool((packed - plain).abs().max() <= 1e-2 * plain.abs().max())
    except RuntimeError:
        return False


def head_share(config: NativeConfig) -> float:
    """The output head's share of one row's matrix multiply-adds (``ModelCaps.head_share``)."""
    c = config
    head = c.vocab_size * c.hidden_size
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # q, k, v, o
    mlp = 3 * c.hidden_size * c.intermediate_size  # gate, up, down
    return head / (head + c.num_layers * (attention + mlp))


class NativeCausalLM:
    """``CausalLM`` running a Llama-family checkpoint with plain PyTorch ops and a static cache."""

    backend = "native"
    caps = ModelCaps(trees=True, rows=True, hidden=True, prefix_align=PREFIX_ALIGN)

    def __init__(
        self,
        config: NativeConfig,
        weights: Weights,
        dtype: torch.dtype = torch.float32,
        row_exact: bool | None = None,
        quant: str | None = None,
    ) -> None:
        """``row_exact`` (default: on for bf16) runs verify attention row by row so that greedy
        speculation is bitwise identical to plain decoding; fp32 keeps the faster batched kernel
        (its last-bit differences are far below fp32 greedy ties; see BENCHMARKS.md)."""
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.quant = quant  # "int8" / "int4" / "w8a8" / "w4a8" when quantized (dtype: their activations)
        self.vocab_size = int(weights.embed.shape[0])
        self.max_length = config.max_length
        if row_exact is None:
            row_exact = dtype == torch.bfloat16 or quant is not None
        self._dims = _Dims(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            dtype,
            row_exact,
            fused=row_exact and config.head_dim % 16 == 0 and int8dot.available(),
        )
        self._inv_freq = inv_freq(config.rope, config.head_dim)
        self._decoder: Callable[..., torch.Tensor] = _decoder
        self._prompt_copies = any(m.prompt_copy is not None for m in quant_matrices(weights))
        # Chunks of PROMPT_ROWS_MIN+ rows run on the copies, shorter ones and decode rows not.
        rest = PROMPT_ROWS_MIN if self._prompt_copies else 1
        self.caps = dataclasses.replace(
            self.caps, prefix_rest=rest, row_exact=row_exact and not self._prompt_copies, head_share=head_share(config)
        )
        self._stack: Any = None  # layer_stack(weights), built at the first forward: weights are final by then
        self._stack_built = False

    def _layer_stack(self) -> Any | None:
        """The model's :func:`layer_stack` (None where the Python loop must run), built once."""
        if not self._stack_built:
            self._stack, self._stack_built = layer_stack(self.weights, self._dims), True
        return self._stack if self.weights.linear is quant_linear else None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        compile: bool = False,
        pack: bool = True,
        quant: str | None = None,
        prompt_copies: bool | None = None,
    ) -> "NativeCausalLM":
        """Load a transformers folder (config.json + safetensors); ModelLoadError if unsupported.

        ``pack`` prepacks matrices for oneDNN when this torch build allows (see :func:`pack_weights`);
        ``compile`` uses ``torch.compile`` on plain matrices instead (slower on the 2-core dev box,
        see BENCHMARKS.md) and falls back to eager if compilation fails. ``quant`` ("int8" or
        "int4", "w8a8", "w4a8") runs quantized matrices (``dtype`` must then be their activations'
        dtype, :func:`~specdecode.models.quant.act_dtype`: bfloat16, float32 for w4a8), each
        splitting its rows as measured fastest on this machine (:mod:`specdecode.models.kernels`).
        ``prompt_copies`` (int8dot kinds; default: where :func:`prompt_copies_pay`) keeps a bf16
        copy of every layer matrix for prompt chunks of :data:`PROMPT_ROWS_MIN`+ rows, 2 bytes a
        weight (a draft model's too: its ``catch_up`` reads the prompt as a chunk).
        """
        model_dir = Path(model_dir)
        cfg = read_config(model_dir)
        reason = unsupported_reason(cfg, model_dir)
        if reason is not None:
            raise ModelLoadError(f"the native backend cannot run {model_dir}: {reason}")
        config = NativeConfig.from_dict(cfg)
        if quant is not None and dtype != act_dtype(quant):
            raise ModelLoadError(f"{quant} matrices take {act_dtype(quant)} activations, not {dtype}")
        weights = load_weights(model_dir, config, dtype, quant)
        if quant is not None:
            plan_rows(quant_matrices(weights))
            if prompt_copies if prompt_copies is not None else prompt_copies_pay():
                if not _packing_works(torch.randn(8, 8).bfloat16()):  # only when forced: measuring says no
                    raise ModelLoadError(
                        "bf16 prompt copies need oneDNN's packed bf16 matmul, which this CPU lacks "
                        f"(asked for by prompt_copies=True or {PROMPT_COPIES_ENV}=1)"
                    )
                attach_prompt_copies(weights)
        else:
            if pack and not compile:  # dynamo cannot trace oneDNN's opaque packed tensors
                pack_weights(weights)
            into_huge_pages(weights)  # what stays dense (a quantized model's are placed as loaded)
        model = cls(config, weights, dtype, quant=quant)
        if compile:
            model.enable_compile()
        return model

    def kernels(self, rows: tuple[int, ...] = (1, 5, 9)) -> dict[str, str]:
        """The matmul kernel behind each matrix shape and how ``rows`` rows are split into calls."""
        w = self.weights
        if self.quant is None:
            kind = "oneDNN packed" if w.linear is _mkldnn_linear else "F.linear"
            return {"matrices": f"{kind} {str(self.dtype).removeprefix('torch.')}"}
        out: dict[str, str] = {}
        for m in quant_matrices(w):
            name = f"{m.kind} {m.shape[0]}x{m.shape[1]}"
            out[name] = ", ".join(f"{n} rows as {'+'.join(map(str, m.plan.split(n)))}" for n in rows)
        if any(not isinstance(m, QuantMatrix) for m in matrices(w)):
            out["bf16 fallback"] = "F.linear (int kernel unavailable or shape unsupported)"
        if any(m.kind in DOT_KINDS for m in quant_matrices(w)):
            out["int8dot"] = f"{int8dot.row_block()} rows per pass over a tile (measured)"
        out["layers"] = "one int8dot LayerStack call" if self._layer_stack() is not None else "Python loop"
        huge = hugepages.resident_huge_bytes(w.norm)
        out["huge pages"] = f"{huge / 1e6:.0f} MB of weights" if huge else "none (4 KiB pages)"
        copies = sum(2 * m.shape[0] * m.shape[1] for m in quant_matrices(w) if m.prompt_copy is not None)
        out["prompt chunks"] = (
            f"{PROMPT_ROWS_MIN}+ rows on bf16 oneDNN copies ({copies / 1e6:.0f} MB)" if copies else "int8dot"
        )
        return out

    def enable_compile(self) -> bool:
        """Route forwards through ``torch.compile``; False (and eager kept) if compilation fails."""
        from specdecode.models.native_compile import compiled_decoder

        compiled = compiled_decoder(self)
        if compiled is None:
            return False
        self._decoder = compiled
        return True

    def new_cache(self, max_length: int) -> StaticKVCache:
        """A cache holding up to ``max_length`` positions (prompt + generated + one round of drafts)."""
        c = self.config
        # float32 whatever the weights: see _attention for why.
        return StaticKVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_length, torch.float32)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: StaticKVCache,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``input_ids`` [1, n] to ``cache``; return float32 logits [1, n, vocab].

        ``positions`` [1, n] (int64) defaults to the next n positions. ``attn_mask`` (bool,
        [1, n, cache.length + n] or [n, cache.length + n], True = may attend) defaults to causal
        over cache + new tokens; pass both for tree verification. ``last_only`` returns the last
        row's logits only ([1, 1, vocab]). ``return_hidden`` also returns the last layer's
        pre-norm features of every row ([n, hidden], float32): ``(logits, hidden)``.
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, n], got {tuple(input_ids.shape)}")
        rows = [input_ids[0]]
        out = self.forward_rows(
            rows,
            [cache],
            None if positions is None else [positions.reshape(-1)],
            None if attn_mask is None else [attn_mask],
            last_only=last_only,
            return_hidden=return_hidden,
        )
        return (out[0][0], out[1][0]) if return_hidden else out[0]

    @torch.inference_mode()
    def forward_rows(
        self,
        rows: list[torch.Tensor],
        caches: list[StaticKVCache],
        positions: list[torch.Tensor | None] | None = None,
        masks: list[torch.Tensor | None] | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
        keep: list[int] | None = None,
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Several sequences in one forward: append ``rows[r]`` ([n_r] ids, n_r >= 1) to ``caches[r]``.

        Each cache keeps its own length, so rows of different lengths over caches of different
        lengths (prefills, 1-token decodes, k-token verifies, tree verifies with their own
        ``positions[r]`` [n_r] and ``masks[r]`` [n_r, cache_r.length + n_r]) share one pass over
        the weights. Returns float32 logits [1, n_r, vocab] per row ([1, 1, vocab] with
        ``last_only``); each equals what the row gives alone (bitwise with prepacked matrices in
        bf16). ``keep[r]`` (0..n_r) returns only row r's last ``keep[r]`` logits ([1, keep[r], vocab];
        0 for a prefill chunk skips the output head for it); it overrides ``last_only``.
        ``return_hidden`` also returns each row's pre-norm last-layer features [n_r, hidden].
        A failed forward leaves every cache as it was.
        """
        if len(rows) != len(caches) or not rows:
            raise ValueError(f"forward_rows needs one cache per row, got {len(rows)} rows and {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("forward_rows needs a distinct cache per row")
        ids = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rows]
        if any(r.numel() == 0 for r in ids):
            raise ValueError("every row needs at least one new token")
        positions = positions or [None] * len(ids)
        masks = masks or [None] * len(ids)
        seqs, pos, lo, done = [], [], 0, []
        try:
            for r, cache, p, m in zip(ids, caches, positions, masks):
                n = r.numel()
                start = cache.reserve(n)
                done.append((cache, start))
                seqs.append(_Seq(cache.keys, cache.values, start, lo, lo + n, self._mask(start, n, m)))
                pos.append(torch.arange(start, start + n) if p is None else p.reshape(n))
                lo += n
            if keep is None:
                keep = [1 if last_only else s.hi - s.lo for s in seqs]
            last = [i for s, n in zip(seqs, keep) for i in range(s.hi - n, s.hi)]
            hidden: list[torch.Tensor] | None = [] if return_hidden else None
            chunks = [(s.lo, s.hi) for s, n in zip(seqs, keep) if n == 0 and s.hi - s.lo >= PROMPT_ROWS_MIN]
            lin = _PromptRows(self.weights.linear, chunks, lo) if chunks and self._prompt_copies else None
            logits = self._run(torch.cat(ids), torch.cat(pos), seqs, None if len(last) == lo else last, hidden, lin)
        except BaseException:
            for cache, start in done:
                cache.trim(start)
            raise
        out, at = [], 0
        for n in keep:
            out.append(logits[at : at + n].unsqueeze(0))
            at += n
        if not return_hidden:
            return out
        return out, [hidden[0][s.lo : s.hi].float() for s in seqs]

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[_Seq],
        last_rows: list[int] | None,
        hidden: list | None,
        lin: Linear | None = None,
    ) -> torch.Tensor:
        """Embed ``ids`` [n] at ``positions`` [n] and run the decoder; float32 logits [rows, vocab]."""
        cos, sin = cos_sin(self._inv_freq, positions, torch.float32)
        x = embed_rows(self.weights.embed, ids)  # [n, hidden] float32
        stack = self._layer_stack() if lin is None and self._decoder is _decoder else None
        if stack is not None:
            x = _stacked(stack, x, seqs, cos, sin)
            return _head(x, self.weights, self._dims, last_rows, hidden, self.weights.linear).float()
        rope = (cos[:, None], sin[:, None])  # broadcast over heads
        extra = () if lin is None else (lin,)  # a compiled decoder (float matrices) never gets one
        return self._decoder(x, self.weights, seqs, rope, self._dims, last_rows, hidden, *extra).float()

    @staticmethod
    def _mask(start: int, n: int, attn_mask: torch.Tensor | None) -> torch.Tensor | None:
        """SDPA boolean mask [1, 1, n, start + n]; None for one default-causal token (sees everything)."""
        if attn_mask is not None:
            if attn_mask.shape[-2:] != (n, start + n):
                raise ValueError(f"attn_mask must end in shape ({n}, {start + n}), got {tuple(attn_mask.shape)}")
            return attn_mask.reshape(1, 1, n, start + n).bool()
        if n == 1:
            return None
        rows = torch.arange(start, start + n)[:, None]
        return (torch.arange(start + n)[None, :] <= rows).view(1, 1, n, start + n)


# -- a reduced output vocabulary ------------------------------------------------------------------


class ReducedVocabLM(NativeCausalLM):
    """A native model whose logits cover only ``vocab_ids``: column j scores token ``vocab_ids[j]``.

    Inputs and ``vocab_size`` stay in the full vocabulary; a draft proposer maps drafts back and
    reports q as zero outside ``vocab_ids`` (exactly the distribution it drew from). Where the
    full head's rows can be read one by one (``caps.columns``), any other token can be scored
    too: a draft adds the tokens of its own request's context (:meth:`head_rows`,
    :meth:`column_logits`), which a static cut misses most (names, identifiers).
    """

    def __init__(
        self,
        config: NativeConfig,
        weights: Weights,
        vocab_ids: torch.Tensor,
        dtype: torch.dtype,
        full_head: Any = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, weights, dtype, **kw)
        self.vocab_ids = vocab_ids
        self._full_head = full_head  # rows embed_rows can read (restrict_output's _readable_head), or None
        self.caps = dataclasses.replace(self.caps, columns=full_head is not None)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The full head's rows for token ``ids`` [m] (float32 [m, hidden]); ``caps.columns`` only."""
        if self._full_head is None:
            raise ValueError("this model's full head cannot be read by rows (caps.columns is off)")
        return embed_rows(self._full_head, ids.reshape(-1)).reshape(-1, self.config.hidden_size)

    def column_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, m] of the tokens whose head rows are ``rows`` [m, hidden] (from
        :meth:`head_rows`), at pre-norm last-layer features ``hidden`` [n, hidden]
        (``return_hidden``'s): the head's own final norm, then a plain matmul."""
        return _norm(hidden.float().contiguous(), self.weights.norm, self._dims).float() @ rows.t()


def frequent_ids(n: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``n`` lowest token ids plus ``always`` (end-of-sequence ids), ascending.

    A byte-level BPE vocabulary (GPT-2, Llama 3, Qwen2) numbers tokens in merge order, and a
    merge was learnt because its pair was frequent, so low ids are the common tokens: a draft
    vocabulary without a corpus to count on.
    """
    if not isinstance(n, int) or not 1 <= n <= vocab_size:
        raise ValueError(f"a reduced vocabulary needs 1 <= n <= {vocab_size} tokens, got {n!r}")
    ids = set(range(n)) | {int(t) for t in always if 0 <= int(t) < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


def restrict_output(model: NativeCausalLM, vocab_ids: torch.Tensor) -> ReducedVocabLM:
    """``model`` with its output head cut to the rows ``vocab_ids`` [n]; every other weight is
    shared, not copied. For a draft model whose head is a large share of its weights (the Qwen2.5
    0.5B's 151,936 rows are over a quarter), each draft step then reads and multiplies n rows.

    Logit column j equals the full model's column ``vocab_ids[j]``: bitwise for float and int8
    heads; an int4 head's rows are read back and kept in int8 (within ~1%).
    """
    ids = torch.as_tensor(vocab_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= model.vocab_size:
        raise ValueError(f"vocab_ids must be non-empty ids below {model.vocab_size}")
    head = dataclasses.replace(model.weights, lm_head=_head_rows(model, ids))
    full = _readable_head(model)
    return ReducedVocabLM(
        model.config, head, ids, model.dtype, full_head=full, row_exact=model._dims.row_exact, quant=model.quant
    )


DEFAULT_DRAFT_VOCAB = 32_768  # a draft head's default cut, where its vocabulary is over twice that


def default_draft_vocab(model: Any) -> int:
    """The head cut a loaded draft model gets unless told otherwise: :data:`DEFAULT_DRAFT_VOCAB`
    ids (plus each request's context's, which needs a head readable by rows) where the
    vocabulary is over twice that, else 0 (the whole head). On the Qwen 0.5B (151,936 ids, a
    head of 27% of its weights) a drafted token cost 0.88x and greedy acceptance on HumanEval
    stayed 89-90% (BENCHMARKS.md, session 48); a cut without the context's tokens fell to 76%."""
    if not isinstance(model, NativeCausalLM) or isinstance(model, ReducedVocabLM):
        return 0
    if model.vocab_size <= 2 * DEFAULT_DRAFT_VOCAB:
        return 0
    return DEFAULT_DRAFT_VOCAB if _readable_head(model) is not None else 0


def _readable_head(model: NativeCausalLM) -> Any:
    """The full head as rows :func:`embed_rows` can read (a tied model's embedding table, an
    untied head unless prepacked for oneDNN; either with readable rows if quantized), or None."""
    w = model.weights
    head = w.embed if model.config.tie_word_embeddings else w.lm_head if w.linear is not _mkldnn_linear else None
    return head if head is not None and can_embed(head) else None


def with_draft_vocab(draft: LoadedModel, n: int, name: str = "--draft-vocab") -> LoadedModel:
    """A loaded draft model whose logits cover its ``n`` most common tokens (:func:`frequent_ids`,
    plus its end-of-sequence ids); ConfigError naming ``name`` for a model off the native path,
    one already cut, or a bad ``n``."""
    model = draft.model
    if not isinstance(model, NativeCausalLM) or isinstance(model, ReducedVocabLM):
        raise ConfigError(f"{name} needs a draft model on the native backend with its full head")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= model.vocab_size:
        raise ConfigError(f"{name} must be 1..{model.vocab_size} (the draft's vocabulary), got {n!r}")
    ids = frequent_ids(n, model.vocab_size, draft.eos_token_ids)
    return dataclasses.replace(draft, model=restrict_output(model, ids))


def target_matrix(model: NativeCausalLM, matrix: Any, n_in: int) -> torch.Tensor:
    """One of ``model``'s matrices as plain float32 [out, in], also when prepacked for oneDNN or
    quantized: those are opaque, so multiplying the identity [n_in, n_in] through them reads them back."""
    w = model.weights
    if w.linear is F.linear:
        return matrix.float()
    return w.linear(torch.eye(n_in, dtype=model.dtype), matrix, None).float().t().contiguous()


def output_rows(model: NativeCausalLM, vocab_ids: torch.Tensor) -> torch.Tensor:
    """``model``'s LM-head rows for ``vocab_ids`` (float32 [n, hidden]), tied or not, packed or not."""
    w = model.weights
    if model.config.tie_word_embeddings:
        return embed_rows(w.embed, vocab_ids).contiguous()
    return target_matrix(model, w.lm_head, w.embed.shape[1])[vocab_ids].contiguous()


def _head_rows(model: NativeCausalLM, ids: torch.Tensor) -> QuantMatrix | torch.Tensor:
    """The head cut to rows ``ids``, in the head's own form (int4's rows kept in int8)."""
    head = model.weights.lm_head
    if isinstance(head, QuantMatrix) and (rows := select_rows(head, ids)) is not None:  # bitwise
        return rows
    rows = output_rows(model, ids)
    if isinstance(head, QuantMatrix):  # int4 again would lose ~2% of the bf16 values read back
        return quantize_matrix(rows, "int8")
    if model.weights.linear is _mkldnn_linear:
        return torch.ops.mkldnn._reorder_linear_weight(rows.to(model.dtype))
    return rows.to(model.dtype)
