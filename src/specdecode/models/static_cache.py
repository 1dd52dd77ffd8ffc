"""A preallocated key/value cache: appends write into fixed buffers, trim only moves the length."""

from __future__ import annotations

import torch

from specdecode.models.base import check_trim


class StaticKVCache:
    """Keys and values for every layer in two buffers [layers, kv_heads, capacity, head_dim].

    Positions ``[0, length)`` are valid. ``trim`` is O(1): entries past the new length are left in
    place and overwritten by the next append, never read (attention only looks at ``[:length]``).
    """

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, batch: int = 1
    ) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        shape = (layers, batch, kv_heads, capacity, head_dim)
        # empty, not zeros: unwritten slots are never read, and zeroing a big cache costs a pass.
        self.keys = torch.empty(shape, dtype=dtype)
        self.values = torch.empty(shape, dtype=dtype)
        self.capacity = capacity
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def trim(self, length: int) -> None:
        check_trim(self, length)
        self._length = length

    def reserve(self, n: int) -> int:
        """Claim the next ``n`` slots for a forward; return where they start.

        Raises ValueError when they would overflow the capacity given to ``new_cache``.
        """
        start = self._length
        if start + n > self.capacity:
            raise ValueError(
                f"cache overflow: {start} cached + {n} new tokens exceeds its capacity of {self.capacity}"
            )
        self._length = start + n
        return start
