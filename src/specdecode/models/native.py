"""Native PyTorch Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) with a static KV cache.

Built for small-batch CPU decoding: fused QKV and gate/up weights, one preallocated cache whose
trim is O(1), and a forward that takes any number of new tokens with optional explicit positions
and attention mask (for tree verification).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from specdecode.errors import ModelLoadError
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
    if model_dir is not None and not _safetensors_files(model_dir):
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
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as ``embed`` when tied


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


def load_weights(model_dir: Path, config: NativeConfig, dtype: torch.dtype) -> Weights:
    """Read, fuse and cast the checkpoint's tensors; ModelLoadError naming any missing tensor."""
    raw = _read_tensors(model_dir)

    def take(name: str, optional: bool = False) -> torch.Tensor | None:
        t = raw.pop(name, None)
        if t is None and not optional:
            raise ModelLoadError(f"{model_dir}: checkpoint has no tensor {name!r}")
        return None if t is None else t.to(dtype).contiguous()

    embed = take("model.embed_tokens.weight", optional=True)
    head = take("lm_head.weight", optional=True)
    if config.tie_word_embeddings or head is None:
        # Tied checkpoints may store either name (safetensors keeps one copy of shared tensors).
        embed = head = embed if embed is not None else head
    if embed is None or head is None:
        raise ModelLoadError(f"{model_dir}: checkpoint has no embedding or output matrix")
    layers = [_layer(take, f"model.layers.{i}.") for i in range(config.num_layers)]
    return Weights(embed=embed, layers=layers, norm=take("model.norm.weight"), lm_head=head)


def _layer(take: Callable[..., torch.Tensor | None], p: str) -> LayerWeights:
    a, m = p + "self_attn.", p + "mlp."
    qkv = [take(f"{a}{x}_proj.weight") for x in "qkv"]
    qkv_bias = [take(f"{a}{x}_proj.bias", optional=True) for x in "qkv"]
    gu_bias = [take(f"{m}{x}_proj.bias", optional=True) for x in ("gate", "up")]
    return LayerWeights(
        ln1=take(p + "input_layernorm.weight"),
        wqkv=torch.cat(qkv),
        bqkv=torch.cat(qkv_bias) if all(b is not None for b in qkv_bias) else None,
        wo=take(a + "o_proj.weight"),
        bo=take(a + "o_proj.bias", optional=True),
        ln2=take(p + "post_attention_layernorm.weight"),
        wgu=torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]),
        bgu=torch.cat(gu_bias) if all(b is not None for b in gu_bias) else None,
        wd=take(m + "down_proj.weight"),
        bd=take(m + "down_proj.bias", optional=True),
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' rotate-half convention: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention(
    x: torch.Tensor,
    w: LayerWeights,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    d: _Dims,
) -> torch.Tensor:
    """Self-attention over the cache plus ``x`` [n, hidden]; writes the new keys/values at ``start``."""
    n, hq, hkv, hd = x.shape[0], d.heads, d.kv_heads, d.head_dim
    h = F.rms_norm(x, (d.hidden,), w.ln1, d.eps)
    qkv = F.linear(h, w.wqkv, w.bqkv)
    # q and k rotate together: one set of elementwise ops instead of two.
    qk = _rotate(qkv[:, : (hq + hkv) * hd].view(n, hq + hkv, hd), rope[0][:, None], rope[1][:, None])
    end = start + n
    keys[0, :, start:end] = qk[:, hq:].transpose(0, 1)
    values[0, :, start:end] = qkv[:, (hq + hkv) * hd :].view(n, hkv, hd).transpose(0, 1)
    q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
    out = F.scaled_dot_product_attention(
        q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, enable_gqa=hkv != hq
    )
    return F.linear(out[0].transpose(0, 1).reshape(n, hq * hd), w.wo, w.bo)


def _mlp(x: torch.Tensor, w: LayerWeights, d: _Dims) -> torch.Tensor:
    gate, up = F.linear(F.rms_norm(x, (d.hidden,), w.ln2, d.eps), w.wgu, w.bgu).split(d.intermediate, dim=-1)
    return F.linear(F.silu(gate) * up, w.wd, w.bd)


def _decoder(
    x: torch.Tensor,
    weights: Weights,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    d: _Dims,
) -> torch.Tensor:
    """All layers, final norm and output head over ``x`` [n, hidden] -> logits [n, vocab] (model dtype)."""
    for i, w in enumerate(weights.layers):
        x = x + _attention(x, w, keys[i], values[i], start, rope, mask, d)
        x = x + _mlp(x, w, d)
    return F.linear(F.rms_norm(x, (d.hidden,), weights.norm, d.eps), weights.lm_head)


class NativeCausalLM:
    """``CausalLM`` running a Llama-family checkpoint with plain PyTorch ops and a static cache."""

    backend = "native"

    def __init__(self, config: NativeConfig, weights: Weights, dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.vocab_size = int(weights.lm_head.shape[0])
        self.max_length = config.max_length
        self._dims = _Dims(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, config.rms_norm_eps,
        )
        self._inv_freq = inv_freq(config.rope, config.head_dim)
        self._decoder: Callable[..., torch.Tensor] = _decoder

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, compile: bool = False
    ) -> "NativeCausalLM":
        """Load a transformers folder (config.json + safetensors); ModelLoadError if unsupported."""
        model_dir = Path(model_dir)
        cfg = read_config(model_dir)
        reason = unsupported_reason(cfg, model_dir)
        if reason is not None:
            raise ModelLoadError(f"the native backend cannot run {model_dir}: {reason}")
        config = NativeConfig.from_dict(cfg)
        model = cls(config, load_weights(model_dir, config, dtype), dtype)
        if compile:
            model.enable_compile()
        return model

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
        return StaticKVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_length, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: StaticKVCache,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``input_ids`` [1, n] to ``cache``; return float32 logits [1, n, vocab].

        ``positions`` [1, n] (int64) defaults to the next n positions. ``attn_mask`` (bool,
        [1, n, cache.length + n] or [n, cache.length + n], True = may attend) defaults to causal
        over cache + new tokens; pass both for tree verification.
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, n], got {tuple(input_ids.shape)}")
        n = input_ids.shape[1]
        start = cache.reserve(n)
        try:
            pos = torch.arange(start, start + n) if positions is None else positions.reshape(n)
            mask = self._mask(start, n, attn_mask)
            rope = cos_sin(self._inv_freq, pos, self.dtype)
            x = F.embedding(input_ids[0], self.weights.embed)
            logits = self._decoder(x, self.weights, cache.keys, cache.values, start, rope, mask, self._dims)
        except BaseException:
            cache.trim(start)  # a failed forward leaves the cache as it was
            raise
        return logits.float().unsqueeze(0)

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
