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

        Grows the buffers (doubling, amortised O(1)) when ``n`` more would not fit.
        """
        start = self._length
        if start + n > self.capacity:
            self._grow(max(start + n, 2 * self.capacity))
        self._length = start + n
        return start

    def _grow(self, capacity: int) -> None:
        layers, batch, heads, _, dim = self.keys.shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty((layers, batch, heads, capacity, dim), dtype=old.dtype)
            new[:, :, :, : self._length] = old[:, :, :, : self._length]
            setattr(self, name, new)
        self.capacity = capacity

    @torch.inference_mode()  # buffers grown inside a forward are inference tensors
    def compact(self, start: int, keep: list[int]) -> None:
        """Keep positions ``start + keep[i]`` at ``start + i`` (an accepted tree path); drop the rest."""
        check_trim(self, start)
        index = torch.tensor(keep, dtype=torch.long) + start
        for buf in (self.keys, self.values):
            buf[:, :, :, start : start + len(keep)] = buf[:, :, :, index]
        self._length = start + len(keep)

    def export(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values at positions ``[0, n)`` [layers, batch, kv_heads, n, head_dim]."""
        check_trim(self, n)
        return self.keys[:, :, :, :n].clone(), self.values[:, :, :, :n].clone()

    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take ``keys``/``values`` (as :meth:`export` gives them) as positions ``[0, n)`` of this
        empty cache."""
        if self._length:
            raise ValueError(f"load needs an empty cache, this one holds {self._length} positions")
        n = keys.shape[3]
        self.reserve(n)
        self.keys[:, :, :, :n] = keys
        self.values[:, :, :, :n] = values

    def layer_view(self, layers: int) -> "LayerView":
        """A cache over this cache's first ``layers`` layers, sharing its buffers (early exit)."""
        return LayerView(self, layers)


class LayerView(StaticKVCache):
    """The first layers of a parent cache: same storage, its own length.

    Positions below the parent's length hold the parent's entries for those layers; positions
    written past it are scratch that the parent's next forward overwrites.
    """

    def __init__(self, parent: StaticKVCache, layers: int) -> None:
        self.parent, self.layers = parent, layers
        self._length = 0

    @property
    def keys(self) -> torch.Tensor:
        return self.parent.keys[: self.layers]

    @property
    def values(self) -> torch.Tensor:
        return self.parent.values[: self.layers]

    @property
    def capacity(self) -> int:
        return self.parent.capacity

    def follow_parent(self) -> None:
        """Take the parent's committed entries as this view's own (its length becomes the parent's)."""
        self._length = self.parent.length

    def reserve(self, n: int) -> int:
        start = self._length
        if start + n > self.parent.capacity:
            self.parent._grow(max(start + n, 2 * self.parent.capacity))
        self._length = start + n
        return start
