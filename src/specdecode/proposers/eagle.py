"""EAGLE drafting: a one-layer head extrapolating the target's last-layer features.

The head needs the target's feature f_i for every committed position i below the last one; it
reads them from the target's own forwards (:class:`~specdecode.proposers.features.TargetFeatures`).
The outputs stay exact: q is reported for exactly the distribution each draft token was drawn from.

Head entry i holds the pair (f_i, x_{i+1}) and predicts f_{i+1}; drafting continues from its own
predictions. The head cache keeps only entries built from true features and is trimmed back to
them after every round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.core.sampling import (
    SamplingConfig,
    check_threshold,
    confident_prefix,
    logits_to_probs,
    sample,
    to_vocab,
)
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.models.static_cache import StaticKVCache
from specdecode.networks.storage import load_head
from specdecode.proposers.base import PerRequest, ProposerCaps
from specdecode.proposers.features import TargetFeatures


class EagleProposer(TargetFeatures, PerRequest):
    name = "eagle"
    caps = ProposerCaps(trees=True, reads_target_features=True, confidence=True, needs_native=True)

    def __init__(
        self, target, head=None, path: str | Path | None = None, branch: int = 4, confidence_threshold: float = 0.0
    ) -> None:
        """``confidence_threshold`` > 0: a chain stops before the first draft token whose head top
        probability is below it (EAGLE-2's observation: the head's confidence tracks acceptance)."""
        if not target.caps.hidden:
            raise ConfigError("EAGLE needs the native backend (it reads the target's hidden features)")
        if branch < 1:
            raise ConfigError(f"branch must be >= 1, got {branch}")
        check_threshold(confidence_threshold)
        if head is None:
            if path is None:
                raise ConfigError("EAGLE needs a trained head (a folder with model.safetensors and card.json)")
            head, self.card = load_head(path)
        else:
            self.card = {}
        head.attach(target)
        self.head = head.eval()
        head.pack_for_drafting(target)
        self.target = target
        self.branch = branch
        self.confidence_threshold = confidence_threshold
        self.hidden = head.cfg.hidden
        self.reset([])

    def reset(self, prompt_ids: list[int]) -> None:
        self._watch(prompt_ids)
        self.cache = StaticKVCache(
            1, self.head.cfg.kv_heads, self.head.cfg.head_dim, len(prompt_ids) + 256, torch.float32
        )
        self.hlen = 0  # head entries 0..hlen-1 are built from true features and committed tokens
        self._tail = None  # the head's output at entry hlen-1 (the predicted f^_{hlen})

    def _sync(self, context: list[int]) -> torch.Tensor | None:
        """Head entries for every committed pair; the predicted feature f^_{L-1} ([1, 1, hidden])."""
        n = len(context)
        if n < 2:
            return None
        self._features_upto(context, n - 1)
        self.cache.trim(self.hlen)
        lo, hi = self.hlen, n - 1  # new entries lo..hi-1
        if lo < hi:  # none when asked twice for the same context
            out = self._step(
                self.feats[lo:hi].unsqueeze(0), torch.tensor(context[lo + 1 : hi + 1]), torch.arange(lo, hi)
            )
            self.hlen, self._tail = hi, out[:, -1:]
        return self._tail

    def _step(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask=None) -> torch.Tensor:
        start = self.cache.reserve(feats.shape[1])
        return self.head(
            feats,
            self.head.embed_tokens(tokens).unsqueeze(0),
            positions,
            self.cache.keys[0],
            self.cache.values[0],
            start,
            mask,
        )

    # -- chains -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        out = self._sync(context) if k > 0 else None
        if out is None:
            return Draft.empty()
        vocab_ids, n = self.head.vocab_ids, len(context)
        tokens, probs = [], []
        for i in range(k):
            logits = self.head.logits(out[0])  # [1, draft_vocab]
            if confident_prefix(logits, self.confidence_threshold) == 0:
                break
            small = logits_to_probs(logits, sampling)
            j = small.argmax(-1) if sampling.greedy else sample(small, generator)
            tok = vocab_ids[j]
            tokens.append(tok)
            if not sampling.greedy:
                probs.append(to_vocab(self._reported(small, out[0], sampling), vocab_ids, self.head.cfg.vocab_size))
            if i + 1 < k:
                out = self._step(out, tok, torch.tensor([n - 1 + i]))
        self.cache.trim(self.hlen)
        if not tokens:
            return Draft.empty()
        return Draft(tokens=torch.stack(tokens, dim=1), probs=None if sampling.greedy else torch.stack(probs, dim=1))

    def _reported(self, q: torch.Tensor, feature: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """The q reported to the verifier: exactly the distribution the token was drawn from."""
        return q

    # -- trees --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_tree(self, context: list[int], k: int, max_nodes: int) -> list[list[int]]:
        """Top-``branch`` children per node, keeping the best cumulative probabilities (EAGLE-2)."""
        out = self._sync(context)
        if out is None or k < 1:
            return []
        base, n = self.cache.length, len(context)
        vocab_ids = self.head.vocab_ids
        self._parents: dict[int, int] = {}  # head cache slot of a scored node -> its parent's slot
        nodes: list[_Node] = []
        frontier = [(_Node((), 1.0, -1), out[0, 0])]
        for depth in range(k):
            options = []
            for node, feat in frontier:
                top = torch.topk(torch.softmax(self.head.logits(feat), -1), min(self.branch, vocab_ids.shape[0]))
                for p, j in zip(top.values.tolist(), top.indices.tolist()):
                    options.append((_Node(node.tokens + (int(vocab_ids[j]),), node.prob * p, -1), node))
            options.sort(key=lambda o: -o[0].prob)
            level = options[: max(0, max_nodes - len(nodes))]
            if not level:
                break
            nodes.extend(o[0] for o in level)
            if len(nodes) >= max_nodes or depth + 1 == k:
                break
            frontier = self._score_level(level, frontier, base, n - 1 + depth)
        self.cache.trim(self.hlen)
        inner = {node.tokens[:-1] for node in nodes}
        return [list(node.tokens) for node in nodes if node.tokens not in inner]

    def _score_level(self, level, frontier, base: int, position: int) -> list:
        """One masked head forward over a level: each node sees the committed entries and its ancestors."""
        start, m = self.cache.length, len(level)
        feats = {id(node): feat for node, feat in frontier}
        mask = torch.zeros(m, start + m, dtype=torch.bool)
        mask[:, :base] = True
        for i, (_node, parent) in enumerate(level):
            slot = parent.slot
            while slot >= 0:  # the parent's entry and, through it, its ancestors'
                mask[i, slot] = True
                slot = self._parents[slot]
            mask[i, start + i] = True
        parent_feats = torch.stack([feats[id(parent)] for _, parent in level]).unsqueeze(0)
        tokens = torch.tensor([node.tokens[-1] for node, _ in level])
        out = self._step(parent_feats, tokens, torch.full((m,), position, dtype=torch.long), mask)[0]
        result = []
        for i, (node, parent) in enumerate(level):
            node.slot = start + i
            self._parents[start + i] = parent.slot
            result.append((node, out[i]))
        return result

    def observe(self, num_accepted: int) -> None:
        pass  # the next round's _absorb keeps exactly the verified rows


@dataclass
class _Node:
    tokens: tuple[int, ...]
    prob: float
    slot: int  # head cache index of this node's entry (-1: not scored)
