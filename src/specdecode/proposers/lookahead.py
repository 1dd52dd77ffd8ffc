"""Lookahead decoding (Fu et al. 2024): Jacobi iterations feed an n-gram pool, verified as a tree.

Each round's target forward carries, besides the candidate tree, a side chain of W guessed
tokens after the last committed one. The target's argmax at each side position is the next
Jacobi iterate of that window; n-grams read off the iterate go into a pool keyed by their first
token, and the pool's continuations of the last committed token are next round's candidates.
Side nodes are never accepted, so the output is exactly the target's (greedy-identical; under
sampling the candidates are deterministic one-hot drafts fixed before the round's randomness).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.proposers.base import PerRequest, ProposerCaps


class LookaheadProposer(PerRequest):
    name = "lookahead"
    caps = ProposerCaps(trees=True, side_branch=True, tree_only=True)

    def __init__(self, window: int = 6, ngram: int = 4, max_per_key: int = 6) -> None:
        if window < 1 or ngram < 2 or max_per_key < 1:
            raise ConfigError(
                f"lookahead needs window >= 1, ngram >= 2, max_per_key >= 1; got {window}, {ngram}, {max_per_key}"
            )
        self.window_size, self.ngram, self.max_per_key = window, ngram, max_per_key
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.window: list[int] = []
        self.iterate: list[int] = []

    def reset(self, prompt_ids: list[int]) -> None:
        self.pool = {}
        # Initial guesses: the prompt's own last tokens (any deterministic choice is valid).
        self.window = (list(prompt_ids) * self.window_size)[-self.window_size :]
        self.iterate = []

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """Chain fallback: the freshest pool continuation (no Jacobi step without a tree forward)."""
        paths = self.propose_tree(context, k, k)
        return Draft(tokens=torch.tensor([paths[0] if paths else []], dtype=torch.long))

    def propose_tree(self, context: list[int], k: int, max_nodes: int) -> list[list[int]]:
        """Pool continuations of the last committed token, freshest first, within the node budget."""
        paths, nodes = [], 0
        for cont in reversed(self.pool.get(context[-1], {})):
            path = list(cont[:k])
            if nodes + len(path) > max_nodes:
                break
            paths.append(path)
            nodes += len(path)
        return paths

    def side_branch(self, context: list[int]) -> list[int]:
        return list(self.window)

    def observe_side(self, logits: torch.Tensor) -> None:
        """``logits`` [W + 1, vocab]: the root's output, then each side token's."""
        self.iterate = logits.argmax(dim=-1).tolist()[: self.window_size]  # next Jacobi iterate
        self._collect(self.iterate)

    def _collect(self, seq: list[int]) -> None:
        for i in range(len(seq) - self.ngram + 1):
            key, cont = seq[i], tuple(seq[i + 1 : i + self.ngram])
            bucket = self.pool.setdefault(key, OrderedDict())
            bucket.pop(cont, None)
            bucket[cont] = None
            if len(bucket) > self.max_per_key:
                bucket.popitem(last=False)

    def observe(self, num_accepted: int) -> None:
        """Shift the window past the committed tokens; pad the tail with its last guess."""
        shift = num_accepted + 1
        guesses = self.iterate[shift:] if self.iterate else self.window[shift:]
        pad = guesses[-1] if guesses else self.window[-1]
        self.window = (guesses + [pad] * self.window_size)[: self.window_size]
