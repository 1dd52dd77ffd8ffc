"""Prefix caching: a prompt that starts like an earlier request's sequence skips that prefill.

Chat prompts repeat their beginnings: the system prompt of every request to a server, the whole
history of a conversation's next turn, a benchmark's instruction. The keys and values a target
wrote for a sequence depend only on its tokens, so a later prompt sharing the first n tokens can
take those n positions from a stored copy instead of computing them. Reuse is exact, not an
approximation: the model declares the split at which a prefill is bitwise one forward
(``ModelCaps.prefix_align``), and only prefixes cut there are reused, so a request's tokens are
the same with the cache and without (greedy identical, sampled draws identical under a seed).

The store is shared explicitly: an engine owns one, or is handed one (a ``Decoder`` gives all its
runs the same), bounded in bytes with least-recently-used eviction. Entries carry the storing
request's ``cache_salt`` and serve only requests with the same one: a shared prefix is
otherwise visible to another user through timing (vLLM's ``cache_salt`` answers the same). A
proposer with a model cache of its own (a draft model) gets a companion store for that model,
made beside the target's and sized to as many tokens, through the request's
:class:`PrefixScope`, under the same salt.

Entries also carry the kernel path each position was computed on, where a model computes long
prompt chunks on another path than other rows (``ModelCaps.prefix_rest``: bf16 prompt copies):
a position serves a later sequence only where that sequence, prefilled without the store, would
compute it on the same path. Tokens alone would let a long prompt's rows, computed on the prompt
path, stand in for a short prompt's, which its own prefill computes on the decode kernels.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.errors import ConfigError


@dataclass
class _Entry:
    tokens: torch.Tensor  # [n] int64: the sequence whose positions these are
    keys: torch.Tensor  # [layers, batch, kv_heads, n, head_dim]
    values: torch.Tensor
    salt: str | None  # the scope it serves
    paths: torch.Tensor  # [n] bool: the kernel path each position was computed on (see the module notes)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.tokens.nbytes + self.paths.nbytes


class PrefixCache:
    """Stored key/value prefixes of earlier sequences, at most ``max_bytes`` of them.

    ``align``: stored and reused lengths are multiples of it (the target's ``prefix_align``).
    ``paths`` (every method; None: one path throughout) gives each position's kernel path, True
    for rows of a prompt chunk on the model's prompt path: positions match only on both.
    Thread-safe: engines on several threads (a generator called from many) may share one.
    """

    def __init__(self, max_bytes: int, align: int = 16, token_bytes: int = 0) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"prefix cache size must be an integer >= 0 bytes, got {max_bytes!r}")
        if align < 1:
            raise ConfigError(f"prefix alignment must be >= 1, got {align}")
        self.max_bytes, self.align = max_bytes, align
        self.token_bytes = token_bytes  # one position's keys and values in its model (0: not known)
        self._companions: dict[int, tuple[object, PrefixCache | None]] = {}  # id(model) -> (model, store)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.lookups = self.hits = self.hit_tokens = 0
        self.version = 0  # counts changes to the entries: what was reusable is until it moves

    @classmethod
    def for_target(cls, target, max_mb: int) -> "PrefixCache | None":
        """A store of ``max_mb`` MiB aligned as ``target`` declares; None where it cannot reuse
        prefixes (``caps.prefix_align`` 0) or ``max_mb`` is 0."""
        align = target.caps.prefix_align
        return cls(max_mb << 20, align, _token_bytes(target)) if align and max_mb else None

    def companion(self, model) -> "PrefixCache | None":
        """The store of another model's positions (a draft's) beside this one, made on first use
        and shared from then on: as many tokens' worth of bytes as this store holds, aligned as
        ``model`` declares; None where it cannot reuse prefixes."""
        with self._lock:
            if id(model) not in self._companions:
                align, store = model.caps.prefix_align, None
                if align:
                    size, per_token = self.max_bytes, _token_bytes(model)
                    if self.token_bytes:
                        size = size * per_token // self.token_bytes
                    store = PrefixCache(size, align, per_token)
                self._companions[id(model)] = (model, store)
            return self._companions[id(model)][1]

    def match(self, tokens: Sequence[int], limit: int, salt: str | None = None, paths: Paths = None) -> int:
        """Positions a prompt ``tokens`` could take from the store: the longest common prefix
        stored under ``salt`` (on the same ``paths``), cut to ``limit`` and down to a multiple of
        ``align`` (0: none)."""
        with self._lock:
            return self._best(*_keyed(tokens, paths), limit, salt)[0]

    def reusable(self, tokens: Sequence[int], rows: int, chunk: int, rest: int, salt: str | None = None) -> int:
        """Positions of ``tokens`` (a sequence whose first ``rows`` are read in chunks of ``chunk``
        at fixed offsets, by a model with ``prefix_rest`` ``rest``) the store can supply so that
        the rows after them are computed bitwise as a read from 0 computes them."""
        return self._reusable(tokens, rows, chunk, rest, salt, cold_paths(rows, len(tokens), chunk, rest))

    def reuse(self, cache, tokens: Sequence[int], rows: int, chunk: int, rest: int, salt: str | None = None) -> int:
        """Load :meth:`reusable`'s positions into the empty ``cache``; how many it loaded."""
        paths = cold_paths(rows, len(tokens), chunk, rest)
        n = self._reusable(tokens, rows, chunk, rest, salt, paths)
        return self.load(cache, tokens, n, salt, paths) if n else 0

    def _reusable(self, tokens: Sequence[int], rows: int, chunk: int, rest: int, salt: str | None, paths: Paths) -> int:
        n = self.match(tokens, rows, salt, paths)
        while n and not split_exact(n, rows, chunk, rest):
            n -= self.align
        return n

    def load(self, cache, tokens: Sequence[int], n: int, salt: str | None = None, paths: Paths = None) -> int:
        """Copy the stored keys/values of ``tokens[:n]`` into the empty ``cache``; the positions
        loaded (``n``, or 0 where no entry holds them any more: it may have been evicted since
        :meth:`match`)."""
        with self._lock:
            self.lookups += 1
            if n < self.align:
                return 0
            length, key = self._best(*_keyed(tokens[:n], None if paths is None else paths[:n]), n, salt)
            if length < n:
                return 0
            entry = self._entries[key]
            self._entries.move_to_end(key)
            cache.load(entry.keys[:, :, :, :n], entry.values[:, :, :, :n])
            self.hits += 1
            self.hit_tokens += n
            return n

    def store(self, tokens: Sequence[int], cache, salt: str | None = None, paths: Paths = None) -> None:
        """Keep the positions of ``tokens`` (``cache`` holds them, possibly more) for later
        prompts: up to the last multiple of ``align``. An entry this one extends is dropped (the
        new one serves every prompt it served); one that extends this one is kept instead."""
        n = min(len(tokens), cache.length) // self.align * self.align
        if n == 0 or self.max_bytes == 0:
            return
        ids, tags = _keyed(tokens[:n], None if paths is None else paths[:n])
        with self._lock:
            for key, entry in list(self._entries.items()):
                m = min(n, entry.tokens.numel())
                same = torch.equal(entry.tokens[:m], ids[:m]) and torch.equal(entry.paths[:m], tags[:m])
                if entry.salt != salt or not same:
                    continue
                if entry.tokens.numel() >= n:  # already held
                    self._entries.move_to_end(key)
                    return
                self._drop(key)  # extended by the new sequence
        keys, values = cache.export(n)
        entry = _Entry(ids, keys, values, salt, tags)
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            while self._entries and self.bytes + entry.nbytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[self._next] = entry
            self._next += 1
            self.bytes += entry.nbytes
            self.version += 1

    def stats(self) -> dict[str, int]:
        """Entries and bytes held, and lookups, hits and positions reused so far."""
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self.bytes,
                "max_bytes": self.max_bytes,
                "lookups": self.lookups,
                "hits": self.hits,
                "hit_tokens": self.hit_tokens,
            }

    def companion_stats(self) -> dict[str, int]:
        """The companion stores' :meth:`stats`, summed."""
        with self._lock:
            stores = [store for _, store in self._companions.values() if store is not None]
        out = dict.fromkeys(("entries", "bytes", "max_bytes", "lookups", "hits", "hit_tokens"), 0)
        for stats in (store.stats() for store in stores):
            out = {key: out[key] + stats[key] for key in out}
        return out

    def _best(self, ids: torch.Tensor, tags: torch.Tensor, limit: int, salt: str | None) -> tuple[int, int]:
        """(aligned common-prefix length, entry key) of the entry under ``salt`` sharing most of
        ``ids`` computed on the paths ``tags``."""
        best, best_key = 0, -1
        for key, entry in self._entries.items():
            m = min(ids.numel(), entry.tokens.numel(), limit)
            if m <= best or entry.salt != salt:
                continue
            differ = ((entry.tokens[:m] != ids[:m]) | (entry.paths[:m] != tags[:m])).nonzero()
            common = m if differ.numel() == 0 else int(differ[0, 0])
            common = common // self.align * self.align
            if common > best:
                best, best_key = common, key
        return best, best_key

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes
        self.version += 1


Paths = Sequence[bool] | None


def _token_bytes(model) -> int:
    cache = model.new_cache(1)
    return cache.keys[..., :1, :].nbytes + cache.values[..., :1, :].nbytes


def cold_paths(rows: int, n: int, chunk: int, rest: int) -> list[bool] | None:
    """The kernel path of a sequence's first ``n`` positions where its first ``rows`` are read
    from 0 in chunks of ``chunk`` at fixed offsets: True in a chunk of ``rest``+ rows (the model's
    prompt path, ``ModelCaps.prefix_rest``), False elsewhere and past ``rows`` (decode and
    verify rows); None where the model has one path."""
    if rest <= 1:
        return None
    return [i < rows and min(chunk, rows - i // chunk * chunk) >= rest for i in range(n)]


def split_exact(n: int, rows: int, chunk: int, rest: int) -> bool:
    """Whether rows ``[n, rows)``, read after ``n`` stored positions, take the kernel path they
    take in a read from 0: the chunk that now starts at ``n`` keeps a length on the same side
    of ``rest`` (chunks end at the same fixed offsets either way)."""
    start = n // chunk * chunk
    end = min(start + chunk, rows)
    return end - n == 0 or end - n >= rest or end - start < rest


@dataclass(frozen=True)
class PrefixScope:
    """A request's part in what an engine shares between requests: its ``salt`` (the request's
    ``cache_salt``), and ``store``, the target's prefix store (None: none), whose companions serve
    the request's proposer. The salt also scopes what a proposer learns from other requests'
    outputs (suffix decoding's corpus).

    A proposer with a model and cache of its own (a draft model) reads a prompt in one forward;
    :meth:`reuse` gives it the stored positions that forward would compute bitwise the same, and
    :meth:`keep` stores what it read for later requests.
    """

    store: PrefixCache | None
    salt: str | None = None
    # (id(model), length, store version) -> reusable: a request's reads of one length are the same
    # tokens (its context only grows), so a read's price is not matched again every step.
    _seen: dict = field(default_factory=dict, compare=False, repr=False)

    def reusable(self, model, tokens: Sequence[int]) -> int:
        """How many positions :meth:`reuse` would load for ``tokens`` now (for pricing a read)."""
        store = self._for(model, tokens)
        if store is None:
            return 0
        key = (id(model), len(tokens), store.version)
        if key not in self._seen:
            self._seen.clear()
            self._seen[key] = store.reusable(tokens, len(tokens), len(tokens), model.caps.prefix_rest, self.salt)
        return self._seen[key]

    def reuse(self, model, cache, tokens: Sequence[int]) -> int:
        """Load into ``model``'s empty ``cache`` the longest stored prefix of ``tokens`` after
        which the rest, read in one forward, is computed as reading all of ``tokens`` would be;
        the positions loaded (0: none)."""
        store = self._for(model, tokens)
        if store is None:
            return 0
        return store.reuse(cache, tokens, len(tokens), len(tokens), model.caps.prefix_rest, self.salt)

    def keep(self, model, tokens: Sequence[int], cache) -> None:
        """Store ``cache``'s positions of ``tokens``, computed as one read of them, for later requests."""
        store = self._companion(model)
        if store is not None:
            n = len(tokens)
            store.store(tokens, cache, self.salt, cold_paths(n, n, max(n, 1), model.caps.prefix_rest))

    def _for(self, model, tokens: Sequence[int]) -> PrefixCache | None:
        """``model``'s companion store, where ``tokens`` are long enough to take from it."""
        store = self._companion(model)
        return store if store is not None and len(tokens) > store.align else None

    def _companion(self, model) -> PrefixCache | None:
        return None if self.store is None else self.store.companion(model)


def _keyed(tokens: Sequence[int], paths: Paths) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` [n] int64 and their positions' paths [n] bool (all False where not given)."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    if paths is None:
        return ids, torch.zeros(ids.numel(), dtype=torch.bool)
    tags = torch.as_tensor(list(paths), dtype=torch.bool)
    if tags.numel() != ids.numel():
        raise ValueError(f"{ids.numel()} tokens need as many paths, got {tags.numel()}")
    return ids, tags


__all__ = ["PrefixCache", "PrefixScope", "cold_paths", "split_exact"]
