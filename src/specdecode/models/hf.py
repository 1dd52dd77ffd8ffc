"""Adapter for any transformers causal LM whose cache is a plain growing key/value cache."""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from specdecode.errors import ModelLoadError
from specdecode.models.base import ModelCaps, check_trim


class HFCache:
    """A transformers ``DynamicCache`` under the shared trim contract."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.inner = DynamicCache(config=model.config)
        bad = [type(layer).__name__ for layer in self.inner.layers if type(layer) is not DynamicLayer]
        if bad:
            # Sliding-window and linear-attention layers drop or fold history: they cannot roll back.
            raise ModelLoadError(
                f"{type(model).__name__} uses cache layers that cannot be trimmed ({bad[0]}); "
                "speculative decoding needs a cache that can roll back rejected tokens"
            )
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def trim(self, length: int) -> None:
        check_trim(self, length)
        if length < self._length:
            self.inner.crop(length - self._length)  # transformers takes minus the tokens to drop
            self._length = length


class HFCausalLM:
    """``CausalLM`` over a transformers model (float32 logits, batch of one)."""

    backend = "transformers"
    caps = ModelCaps()  # a causal chain over a growing cache; no trees, rows or features

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(model.config, "max_position_embeddings", 1 << 20))
        self.dtype = next(model.parameters()).dtype
        # transformers renamed ``past_key_values`` to ``cache``; use whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def new_cache(self, max_length: int) -> HFCache:
        return HFCache(self.model)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cache: HFCache, positions=None, attn_mask=None, last_only: bool = False
    ) -> torch.Tensor:
        if positions is not None or attn_mask is not None:
            raise ValueError("the transformers adapter verifies chains only (caps.trees is False)")
        n = input_ids.shape[1]
        start = cache.length
        positions = torch.arange(start, start + n).unsqueeze(0)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kwarg: cache.inner},
        )
        cache._length = start + n
        return out.logits.float()
