"""The model interface the decode loop drives: forward over new tokens with a cache, and trim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ModelCaps:
    """What a model's forward can do beyond appending a causal chain; read, never probed for."""

    trees: bool = False  # forward takes explicit positions + attention masks; caches compact
    rows: bool = False  # forward_rows: several sequences (each over its own cache) in one pass
    hidden: bool = False  # return_hidden=True also returns the last layer's pre-norm features
    # A prompt prefilled in two forwards split at a multiple of ``prefix_align`` positions writes
    # bitwise the cache and logits of one forward, so a stored prefix may stand in for its
    # prefill (0: never; the cache then need not export or load positions). ``prefix_rest``:
    # rows a split-off prompt chunk needs to be computed as in the unsplit chunk (some kernels
    # choose their path by chunk size).
    prefix_align: int = 0
    prefix_rest: int = 1
    # Every position's keys/values are bitwise the same whichever forward wrote it (a prefill
    # chunk, a decode row, a verify chain): a finished sequence's whole cache may then stand in
    # for a later prefill, not only its prompt chunks.
    row_exact: bool = False
    # The output head's share of a row's multiply-adds. A row whose logits are not kept (a prompt
    # chunk's) costs that much less than a row that scores its token (a decode or verify row):
    # on a step bound by arithmetic (many rows), 18% of a scoring row for the Qwen 1.5B.
    head_share: float = 0.0
    # A reduced output vocabulary (``vocab_ids``: logit column j scores token ``vocab_ids[j]``)
    # that also scores other tokens on demand: ``head_rows(ids)`` gives their rows of the full
    # head, ``column_logits(hidden, rows)`` their logits from ``return_hidden``'s features.
    columns: bool = False


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

    backend: str  # "native", "transformers", ...
    caps: ModelCaps
    vocab_size: int
    max_length: int  # longest sequence (prompt + output) the model accepts

    def new_cache(self, max_length: int) -> KVCache: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Append ``input_ids`` [1, n] to ``cache``; return float32 logits [1, n, vocab].

        ``positions`` [1, n] and ``attn_mask`` (bool [n, cache.length + n], True = may attend)
        are given only to a model whose ``caps.trees`` is set (tree verification); otherwise the
        rows take the next n positions, causally. ``last_only=True`` may return just the last row
        ([1, 1, vocab]): prefill needs no more. A model with ``caps.hidden`` also takes
        ``return_hidden=True`` and then returns ``(logits, hidden [n, hidden_size])``.
        """
        ...


def check_trim(cache: KVCache, length: int) -> None:
    """Shared argument check for ``trim`` implementations."""
    if not 0 <= length <= cache.length:
        raise ValueError(f"cannot trim a cache of length {cache.length} to {length}")
