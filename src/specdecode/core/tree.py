"""Candidate trees: attention masks, positions, and exact verification of several drafts at once.

A tree holds N candidate nodes after a root (the last committed token, node 0 of the forward).
``parents[i]`` is the forward index (0 = root, i = node i) of node i's parent, always < i + 1, so
the forward input is ``[root, *tokens]`` and node i sits at forward index i + 1.

Siblings are distinct deterministic candidates (one-hot q each). Sampling verification walks
from the root: each child x is accepted with probability r(x) under the current residual r
(initially the target's p); a rejected child is removed from r (r <- norm(r - onehot(x))), which
is exactly speculative sampling against a one-hot proposal, applied recursively over siblings
(SpecInfer's multi-draft rule). When no child is accepted the token is drawn from r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.core.sampling import sample
from specdecode.core.verify import RESIDUAL_EPS


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [N] int64 candidate tokens
    parents: torch.Tensor  # [N] int64 forward index of each node's parent (0 = root)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def from_paths(paths: list[list[int]]) -> "Tree":
        """Merge candidate token paths into a prefix tree (shared prefixes become one node)."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, ...], int] = {(): 0}
        for path in paths:
            for depth in range(1, len(path) + 1):
                key = tuple(path[:depth])
                if key not in index:
                    tokens.append(path[depth - 1])
                    parents.append(index[key[:-1]])
                    index[key] = len(tokens)
        return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def children(self) -> list[list[int]]:
        """Forward indices of each forward node's children, in insertion order (best first)."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, parent in enumerate(self.parents.tolist()):
            kids[parent].append(i + 1)
        return kids

    def depths(self) -> torch.Tensor:
        """[N + 1] depth of every forward node (root 0)."""
        depth = [0]
        for parent in self.parents.tolist():
            depth.append(depth[parent] + 1)
        return torch.tensor(depth, dtype=torch.long)

    def attention_mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool: node i may attend to node j iff j is i or an ancestor of i."""
        n = self.size + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i, parent in enumerate(self.parents.tolist(), start=1):
            mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def path_to(self, node: int) -> list[int]:
        """Forward indices from the root to ``node`` inclusive."""
        path = [node]
        while path[-1] != 0:
            path.append(int(self.parents[path[-1] - 1]))
        return path[::-1]


@dataclass(frozen=True)
class TreeVerification:
    path: list[int]  # forward indices of accepted nodes, starting with the root (0)
    next_token: int  # the token the target adds after the accepted path

    def committed(self, tree: Tree) -> list[int]:
        return [int(tree.tokens[i - 1]) for i in self.path[1:]] + [self.next_token]


def verify_tree_greedy(tree: Tree, target_logits: torch.Tensor) -> TreeVerification:
    """The longest root path whose tokens equal the target's argmax; ``target_logits`` [N+1, vocab]."""
    best = target_logits.argmax(dim=-1).tolist()
    kids, tokens = tree.children(), tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in kids[node] if tokens[c - 1] == best[node]), None)
        if nxt is None:
            return TreeVerification(path=path, next_token=best[node])
        path.append(nxt)


def verify_tree_sampling(
    tree: Tree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> TreeVerification:
    """Exact multi-draft verification over sibling candidates; ``target_probs`` [N+1, vocab]."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        residual = target_probs[node].float().clone()
        chosen = None
        for child in kids[node]:
            x = tokens[child - 1]
            mass = float(residual.sum())
            if mass <= RESIDUAL_EPS:
                break
            if float(torch.rand((), generator=generator)) * mass < float(residual[x]):
                chosen = child
                break
            residual[x] = 0.0  # r <- norm(max(r - onehot(x), 0)), normalisation deferred
        if chosen is None:
            if float(residual.sum()) <= RESIDUAL_EPS:
                residual = target_probs[node].float()  # stable fallback: rejection had ~0 mass
            token = int(sample(residual[None], generator))
            return TreeVerification(path=path, next_token=token)
        path.append(chosen)
