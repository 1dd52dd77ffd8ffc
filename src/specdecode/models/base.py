"""The model interface the decode loop drives: forward over new tokens with a cache, and trim."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCache(Protocol):
    """Trim contract shared by every cache: ``trim(n)`` keeps exactly the first n positions.

    Entries past ``n`` are forgotten and the prefix is never recomputed. A model whose cache
    cannot honour this is refused when the cache is created, not mid-generation.
    """

    @property
    def length(self) -> int: ...

    def trim(self, length: int) -> None: ...


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model the engine can drive (native path, transformers adapter, tests)."""

    vocab_size: int
    max_length: int  # longest sequence (prompt + output) the model accepts

    def new_cache(self, max_length: int) -> KVCache: ...

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Append ``input_ids`` [1, n] to ``cache``; return float32 logits [1, n, vocab].

        ``last_only=True`` may return just the last row ([1, 1, vocab]): prefill needs no more.
        """
        ...


def check_trim(cache: KVCache, length: int) -> None:
    """Shared argument check for ``trim`` implementations."""
    if not 0 <= length <= cache.length:
        raise ValueError(f"cannot trim a cache of length {cache.length} to {length}")
