"""Tensors read straight from a GGUF file, under transformers' names, dequantized one at a time.

Loading a GGUF this way never holds a whole-model float32 copy: each tensor is dequantized by the
``gguf`` package when the loader asks for it and cast (or re-quantized) before the next one, so
peak memory is the final weights plus one float32 tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import ModelLoadError

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
FOUR_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def quantized_share(path: str | Path) -> float:
    """The share of a GGUF file's 2-D weight elements stored in quantized (not float) types,
    4- to 8-bit alike (reads the header only)."""
    import gguf

    try:
        tensors = [t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2]
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    total = sum(int(t.n_elements) for t in tensors)
    quantized = sum(int(t.n_elements) for t in tensors if t.tensor_type.name not in FLOAT_TYPES)
    return quantized / total if total else 0.0


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a GGUF tensor (Llama/Qwen2 layout), or None for tensors not used."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order for Llama models (it interleaves each head's two RoPE halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFTensors:
    """A GGUF file's tensors by transformers name; ``pop`` dequantizes one to float32 on demand.

    ``heads``/``kv_heads`` are needed for Llama files, whose Q and K rows llama.cpp reorders.
    """

    def __init__(self, path: str | Path, heads: int, kv_heads: int) -> None:
        import gguf

        try:
            self._reader = gguf.GGUFReader(str(path))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
        arch = self._reader.fields.get("general.architecture")
        self.arch = bytes(arch.parts[-1]).decode() if arch is not None else ""
        self._heads, self._kv_heads = heads, kv_heads
        self._tensors = {n: t for t in self._reader.tensors if (n := hf_name(t.name)) is not None}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def pop(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        """The tensor as float32 (its transformers shape), removed from the source; ``default`` if absent."""
        t = self._tensors.pop(name, None)
        if t is None:
            return default
        import gguf

        array = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not array.flags.writeable:  # float32 tensors come back as views of the read-only file map
            array = array.copy()
        out = torch.from_numpy(array)
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            out = unpermute_rope_rows(out, self._heads if "q_proj" in name else self._kv_heads)
        return out

    def low_bit(self, name: str) -> bool | None:
        """Whether the tensor is stored in a 4-bit GGUF type (so int4 can keep it); None if absent."""
        t = self._tensors.get(name)
        return None if t is None else t.tensor_type.name in FOUR_BIT_TYPES

    def names(self) -> list[str]:
        return sorted(self._tensors)
