"""The Llama decoder layer the drafters share (EAGLE head, distilled draft model): trainable and drafting.

Batched and differentiable (the native path is inference-only, one sequence at a time); with
``keys``/``values`` it also drafts from a cache, one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float


@dataclass
class LayerParams:
    """One layer's tensors in the native layout: q/k/v and gate/up fused, [out, in]; optional biases."""

    ln1: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ln2: torch.Tensor
    wgu: torch.Tensor
    wd: torch.Tensor
    bqkv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    bgu: torch.Tensor | None = None
    bd: torch.Tensor | None = None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' rotate-half convention."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decoder_layer(
    x: torch.Tensor,
    w: LayerParams,
    s: LayerShape,
    rope: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    start: int = 0,
    mask: torch.Tensor | None = None,
    linear=F.linear,
) -> torch.Tensor:
    """One pre-norm Llama layer over ``x`` [B, T, hidden]; ``rope`` = (cos, sin) [T, head_dim].

    ``linear`` multiplies by the layer's matrices (a native target's prepacked oneDNN kernel when
    they are packed for drafting, :func:`packed`; it takes 2-D rows).

    Without ``keys``: causal attention within each row (training). With ``keys``/``values``
    [1, kv_heads, capacity, head_dim] (B = 1): the new entries are written at ``start`` and
    ``mask`` (bool [T, start + T], True = may attend) defaults to causal.
    """
    b, t, _ = x.shape
    hq, hkv, hd = s.heads, s.kv_heads, s.head_dim
    qkv = rows_linear(linear, F.rms_norm(x, (s.hidden,), w.ln1, s.eps), w.wqkv, w.bqkv)
    cos, sin = rope[0].view(1, t, 1, hd), rope[1].view(1, t, 1, hd)
    qk = rotate(qkv[..., : (hq + hkv) * hd].view(b, t, hq + hkv, hd), cos, sin)
    q = qk[:, :, :hq].transpose(1, 2)
    k = qk[:, :, hq:].transpose(1, 2)
    v = qkv[..., (hq + hkv) * hd :].view(b, t, hkv, hd).transpose(1, 2)
    if keys is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != hq)
    else:
        end = start + t
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        if mask is None and t > 1:
            mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        out = F.scaled_dot_product_attention(
            q,
            keys[:, :, :end],
            values[:, :, :end],
            attn_mask=None if mask is None else mask.view(1, 1, t, end),
            enable_gqa=hkv != hq,
        )
    x = x + rows_linear(linear, out.transpose(1, 2).reshape(b, t, hq * hd), w.wo, w.bo)
    gate, up = rows_linear(linear, F.rms_norm(x, (s.hidden,), w.ln2, s.eps), w.wgu, w.bgu).split(s.intermediate, dim=-1)
    return x + rows_linear(linear, F.silu(gate) * up, w.wd, w.bd)


def rows_linear(linear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``linear`` over the last dimension of ``x`` [..., in]; a packed kernel takes 2-D rows only."""
    if linear is F.linear:
        return F.linear(x, w, b)
    return linear(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], -1)


def packed(target, w: LayerParams) -> tuple[LayerParams, object]:
    """Copies of a drafter layer's matrices in the native target's prepacked layout (about 2x
    faster for the few rows of a draft step), and the kernel that multiplies by them; the layer
    unchanged with ``F.linear`` when the target is not packed (float or quantized). Drafting only:
    no gradients."""
    if not target.weights.prepacked:  # plain or quantized target: its float matrices as they are
        return w, F.linear
    lin = target.weights.linear
    pack = lambda m: None if m is None else pack_matrix(m)  # noqa: E731
    return LayerParams(
        w.ln1.detach(),
        pack(w.wqkv),
        pack(w.wo),
        w.ln2.detach(),
        pack(w.wgu),
        pack(w.wd),
        *(None if b is None else b.detach() for b in (w.bqkv, w.bo, w.bgu, w.bd)),
    ), lin


class DraftingSnapshot:
    """Mixin for a drafter module: ``_packed`` holds prepacked copies of its weights for drafting,
    handed out by ``_drafting()`` only without autograd; ``train()`` drops them (they go stale)."""

    _packed: tuple | None = None

    def train(self, mode: bool = True):
        if mode:
            self._packed = None
        return super().train(mode)

    def _drafting(self) -> tuple | None:
        return None if torch.is_grad_enabled() else self._packed


def pack_matrix(m: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] matrix reordered for the native oneDNN linear."""
    return torch.ops.mkldnn._reorder_linear_weight(m.detach().float().contiguous())
