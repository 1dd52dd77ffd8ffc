"""Candidate trees: structure, masks, greedy/sampling verification, tree-vs-chain equivalence."""

from __future__ import annotations

import torch

from helpers import MarkovLM
from specdecode.core.tree import Tree, TreeVerification, verify_tree_greedy, verify_tree_sampling

PATHS = [[5, 6, 7], [5, 8], [9]]


def test_prefix_tree_structure_and_mask():
    tree = Tree.from_paths(PATHS)
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert tree.parents.tolist() == [0, 1, 2, 1, 0]
    assert tree.depths().tolist() == [0, 1, 2, 3, 2, 1]
    mask = tree.attention_mask()
    assert mask[4].tolist() == [True, True, False, False, True, False]  # 8 sees root, 5, itself
    assert mask.sum(dim=1).tolist() == (tree.depths() + 1).tolist()
    assert tree.path_to(3) == [0, 1, 2, 3]


def _onehot_logits(best: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 1.0
    return logits


def test_greedy_tree_takes_the_matching_branch():
    tree = Tree.from_paths(PATHS)
    # argmax after: root -> 5, node(5) -> 8, node(6) -> 0, node(7) -> 0, node(8) -> 3, node(9) -> 0
    verdict = verify_tree_greedy(tree, _onehot_logits([5, 8, 0, 0, 3, 0]))
    assert verdict.path == [0, 1, 4] and verdict.committed(tree) == [5, 8, 3]


def test_tree_verification_equals_chain_verification_on_every_branch():
    """Same logits per node as each branch verified alone, and the same greedy outcome."""
    model = MarkovLM(10, seed=1)
    prompt = torch.tensor([[1, 2, 3, 4]])
    tree = Tree.from_paths(PATHS)
    cache = model.new_cache(64)
    model.forward(prompt[:, :-1], cache)
    base = cache.length
    mask = torch.cat([torch.ones(tree.size + 1, base, dtype=torch.bool), tree.attention_mask()], dim=1)
    ids = torch.cat([prompt[0, -1:], tree.tokens]).unsqueeze(0)
    tree_logits = model.forward(ids, cache, positions=(base + tree.depths()).unsqueeze(0), attn_mask=mask)[0]
    best_len = 0
    for node in range(1, tree.size + 1):
        path = tree.path_to(node)
        chain = model.new_cache(64)
        model.forward(prompt[:, :-1], chain)
        chain_ids = torch.cat([prompt[0, -1:], tree.tokens[[i - 1 for i in path[1:]]]]).unsqueeze(0)
        chain_logits = model.forward(chain_ids, chain)[0]
        assert torch.allclose(chain_logits, tree_logits[path], atol=1e-5)
        best = chain_logits.argmax(-1)
        accepted = 0
        while accepted < len(path) - 1 and int(tree.tokens[path[accepted + 1] - 1]) == int(best[accepted]):
            accepted += 1
        best_len = max(best_len, accepted)
    assert len(verify_tree_greedy(tree, tree_logits).path) - 1 == best_len


def test_sampling_with_zero_residual_falls_back():
    tree = Tree.from_paths([[1], [2]])
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3] * 3, [1 / 3] * 3])
    out = verify_tree_sampling(tree, probs, torch.Generator().manual_seed(0))
    assert isinstance(out, TreeVerification) and out.next_token in (0, 1)
