"""Early-exit self-speculation: the target's first L layers, final norm and LM head draft tokens.

No extra weights: the draft is a view of the target sharing its tensors. With a native target,
the draft's cache aliases the target cache's first L layers (``bind_target_cache``): the keys and
values of committed tokens in those layers are exactly what the draft would compute, so the
draft never re-processes accepted tokens, and the positions it writes past the context are
overwritten by the target's next verify forward.
"""

from __future__ import annotations

import dataclasses

from specdecode.errors import ConfigError
from specdecode.models.static_cache import LayerView, StaticKVCache
from specdecode.proposers.base import ProposerCaps
from specdecode.proposers.draft_model import DraftModelProposer

DEFAULT_EXIT_FRACTION = 0.1  # of the target's layers: the best measured exit on SmolLM2 (BENCHMARKS.md)


def exit_model(target, layers: int):
    """A ``NativeCausalLM`` running only the target's first ``layers`` layers (shared tensors)."""
    if target.backend != "native":
        raise ConfigError("early-exit needs the native backend (a Llama-family target)")
    total = len(target.weights.layers)
    if not 1 <= layers < total:
        raise ConfigError(f"early-exit layers must be in 1..{total - 1}, got {layers}")
    config = dataclasses.replace(target.config, num_layers=layers)
    weights = dataclasses.replace(target.weights, layers=target.weights.layers[:layers])
    return type(target)(config, weights, target.dtype, row_exact=target._dims.row_exact)


class EarlyExitProposer(DraftModelProposer):
    name = "early-exit"
    # no catch_up: its layers' keys and values come from the target's own prefill
    caps = ProposerCaps(trees=True, batched_drafting=True, confidence=True, shares_target_cache=True, needs_native=True)

    def __init__(self, target, layers: int | None = None, **options) -> None:
        if target.backend != "native":
            raise ConfigError("early-exit needs the native backend (a Llama-family target)")
        self.layers = layers or max(1, round(len(target.weights.layers) * DEFAULT_EXIT_FRACTION))
        super().__init__(exit_model(target, self.layers), **options)
        self.shared = None

    def _bind(self, target_cache) -> None:
        """Share the target cache's first L layers for this request (the engine passes it to ``start``)."""
        self.shared = target_cache.layer_view(self.layers) if isinstance(target_cache, StaticKVCache) else None

    def reset(self, prompt_ids: list[int]) -> None:
        super().reset(prompt_ids)
        if self.shared is not None:
            self.cache = self.shared
            self.shared = None

    def _fresh(self, context: list[int]) -> list[int]:
        if isinstance(self.cache, LayerView):
            # The target cache holds context[:parent length]; continue from there.
            self.cache.follow_parent()
            self.cached, self.agreed = list(context[: self.cache.length]), self.cache.length
        return super()._fresh(context)
