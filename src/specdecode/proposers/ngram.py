"""Prompt lookup: find the latest earlier occurrence of the last n-gram and propose what followed."""

from __future__ import annotations

import numpy as np
import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.proposers.base import PerRequest, ProposerCaps


class NgramProposer(PerRequest):
    """Deterministic drafts from prompt + output so far; longest n first (Saxena 2023)."""

    name = "ngram"
    caps = ProposerCaps(trees=True)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        return Draft(tokens=torch.tensor([lookup(context, k, self.max_ngram, self.min_ngram)], dtype=torch.long))

    def propose_tree(self, context: list[int], k: int, max_nodes: int) -> list[list[int]]:
        """Continuations of several earlier matches (longest n, then latest first) as tree paths."""
        return lookup_many(context, k, self.max_ngram, self.min_ngram, max_nodes)

    def observe(self, num_accepted: int) -> None:
        pass


def lookup(context: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the context's tail."""
    seq = np.asarray(context, dtype=np.int64)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # drop the tail itself
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


def lookup_many(context: list[int], k: int, max_ngram: int, min_ngram: int, max_nodes: int) -> list[list[int]]:
    """Distinct continuations of every earlier match, best first, within ``max_nodes`` tree nodes."""
    seq = np.asarray(context, dtype=np.int64)
    paths: list[list[int]] = []
    prefixes: set[tuple[int, ...]] = set()
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        for hit in np.flatnonzero((windows == seq[-n:]).all(axis=1))[::-1]:
            path = seq[hit + n : hit + n + k].tolist()
            new = [tuple(path[: i + 1]) for i in range(len(path)) if tuple(path[: i + 1]) not in prefixes]
            if not new:
                continue
            if len(prefixes) + len(new) > max_nodes:
                return paths
            prefixes.update(new)
            paths.append(path)
    return paths
