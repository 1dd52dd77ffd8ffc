"""Rotary position embeddings for the native path: inverse frequencies per scaling variant."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# "dynamic" (NTK) only changes frequencies past max_position_embeddings, which the native model
# never reaches (it refuses longer requests), so inside its range it equals "default".
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings read from config.json (``rope_parameters`` or the older ``rope_scaling``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_config(cls, cfg: dict, max_position_embeddings: int) -> "RopeConfig":
        """Read either the transformers v5 ``rope_parameters`` or the v4 ``rope_theta``/``rope_scaling``."""
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return cls(
            theta=float(theta),
            rope_type=str(rope_type),
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", max_position_embeddings)
            ),
            partial_rotary_factor=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
        )


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Float32 inverse frequencies [head_dim // 2], computed exactly as transformers does."""
    dim = head_dim  # partial rotary is refused by ``supports``
    base = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return base / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(base, rope)
    return base


def _llama3(freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, a smooth ramp in between."""
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, head_dim] for int64 ``positions`` [n], in ``dtype`` (angles in float32)."""
    angles = positions.float()[:, None] * freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
