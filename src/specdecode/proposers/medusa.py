"""Medusa drafting: trained heads on the target's last hidden state propose several tokens at once.

Which token comes first. When a round starts, the committed context x_0..x_{n-1} ends with the
target's own token x_{n-1} (the previous verify's bonus or correction, or the prompt's last
token), which the target has not been fed yet: the last position with a known feature is n-2
(:class:`~specdecode.proposers.features.TargetFeatures` keeps it from the verify forwards). The
target's LM head on h_{n-2} is exactly the distribution the verifier already drew x_{n-1} from,
so that "first" Medusa token is the committed x_{n-1} itself, and head i on h_{n-2} proposes
x_{n+i}: draft token i+1. The number of heads bounds k.

Chains: draft token i+1 is drawn from head i's distribution under the request's sampling
settings (over the draft vocabulary, q zero elsewhere). The heads are independent given h, and
each reported q is exactly the distribution its token was drawn from, so verification is exact;
greedy takes each head's argmax.

Trees: best-first over each head's top-``branch`` tokens. A node at depth d (head d-1) scores
the product of its path's head probabilities; the ``max_nodes`` best nodes form a prefix-closed
tree (a child never scores above its parent). The verifier treats nodes as deterministic
candidates.
"""

from __future__ import annotations

import heapq
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
from specdecode.networks.medusa_heads import MedusaHeads
from specdecode.networks.storage import load_head
from specdecode.proposers.base import PerRequest, ProposerCaps
from specdecode.proposers.features import TargetFeatures


class MedusaProposer(TargetFeatures, PerRequest):
    name = "medusa"
    caps = ProposerCaps(trees=True, reads_target_features=True, confidence=True, needs_native=True)

    def __init__(
        self, target, heads=None, path: str | Path | None = None, branch: int = 4, confidence_threshold: float = 0.0
    ) -> None:
        """``heads``: trained :class:`~specdecode.networks.medusa_heads.MedusaHeads`, or a folder ``path`` with them.
        ``confidence_threshold`` > 0: a chain stops before the first head whose top probability is below it."""
        if not target.caps.hidden:
            raise ConfigError("Medusa needs the native backend (it reads the target's hidden states)")
        if branch < 1:
            raise ConfigError(f"branch must be >= 1, got {branch}")
        check_threshold(confidence_threshold)
        if heads is None:
            if path is None:
                raise ConfigError("Medusa needs trained heads (a folder with model.safetensors and card.json)")
            heads, self.card = load_head(path, MedusaHeads)
        else:
            self.card = {}
        heads.attach(target)
        self.heads = heads.eval()
        heads.pack_for_drafting(target)
        self.target = target
        self.branch = branch
        self.confidence_threshold = confidence_threshold
        self.hidden = heads.cfg.hidden
        self.reset([])

    def reset(self, prompt_ids: list[int]) -> None:
        self._watch(prompt_ids)

    def _head_logits(self, context: list[int], k: int) -> torch.Tensor | None:
        """Logits [min(k, heads), draft_vocab] of the heads on the last known feature (position n-2)."""
        n = len(context)
        if n < 2 or k < 1:
            return None
        self._features_upto(context, n - 1)
        return self.heads(self.feats[n - 2], min(k, self.heads.cfg.num_heads))

    # -- chains -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        logits = self._head_logits(context, k)
        n = 0 if logits is None else confident_prefix(logits, self.confidence_threshold)
        if n == 0:
            return Draft.empty()
        logits = logits[:n]
        small = logits_to_probs(logits, sampling)  # [k, draft_vocab], one row per head
        j = small.argmax(-1) if sampling.greedy else sample(small, generator)
        vocab_ids = self.heads.vocab_ids
        tokens = vocab_ids[j].unsqueeze(0)
        if sampling.greedy:
            return Draft(tokens=tokens)
        q = to_vocab(self._reported(small, logits, sampling), vocab_ids, self.heads.cfg.vocab_size)
        return Draft(tokens=tokens, probs=q.unsqueeze(0))

    def _reported(self, q: torch.Tensor, logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """The q reported to the verifier: exactly the distributions the tokens were drawn from."""
        return q

    # -- trees --------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_tree(self, context: list[int], k: int, max_nodes: int) -> list[list[int]]:
        """The ``max_nodes`` most probable paths over the heads' top-``branch`` tokens, as leaf paths."""
        logits = self._head_logits(context, k)
        if logits is None:
            return []
        top = torch.topk(torch.softmax(logits, -1), min(self.branch, logits.shape[-1]))
        probs, ids = top.values.tolist(), self.heads.vocab_ids[top.indices].tolist()
        heap = [(-p, (tok,)) for p, tok in zip(probs[0], ids[0])]
        heapq.heapify(heap)
        nodes: list[tuple[int, ...]] = []
        while heap and len(nodes) < max_nodes:
            score, path = heapq.heappop(heap)  # score: minus the path's probability
            nodes.append(path)
            depth = len(path)
            if depth < len(probs):
                for p, tok in zip(probs[depth], ids[depth]):
                    heapq.heappush(heap, (score * p, path + (tok,)))
        inner = {path[:-1] for path in nodes}
        return [list(path) for path in nodes if path not in inner]

    def observe(self, num_accepted: int) -> None:
        pass  # the next round's features come from the verify forward itself
