"""A small draft model sharing the target's tokenizer; its own cache, trimmed after rejections."""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.models.base import CausalLM


class DraftModelProposer:
    """Samples k tokens autoregressively from the draft with the target's sampling settings.

    ``confidence_threshold`` > 0 stops drafting early once the draft's own top probability
    (temperature 1, unfiltered) falls below it; exactness is unaffected because the decision
    depends only on tokens already drafted.
    """

    name = "draft"

    def __init__(self, model: CausalLM, max_length: int | None = None, confidence_threshold: float = 0.0) -> None:
        if not 0.0 <= confidence_threshold < 1.0:
            raise ConfigError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        self.confidence_threshold = confidence_threshold
        self.max_length = max_length or model.max_length
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values sit in the draft cache
        self.agreed = 0  # cached[:agreed] is known to equal the committed context

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.new_cache(self.max_length)
        self.cached = []
        self.agreed = 0

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Trim the cache to its longest prefix agreeing with ``context``; feed the rest.

        Returns the logits after the last context token ([1, vocab]).
        """
        # Context only grows by appending, so what agreed last round still agrees.
        keep = min(self.agreed, len(context) - 1)
        limit = min(len(self.cached), len(context) - 1)  # always refeed at least one token
        while keep < limit and self.cached[keep] == context[keep]:
            keep += 1
        self.cache.trim(keep)
        fresh = context[keep:]
        logits = self.model.forward(torch.tensor([fresh], dtype=torch.long), self.cache)
        self.cached = list(context)
        self.agreed = len(context)
        return logits[:, -1]

    def propose(
        self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        if k == 0:
            return Draft.empty()
        logits = self._sync(context)
        tokens, probs = [], []
        for i in range(k):
            if i > 0 and self._unsure(logits):
                break
            q = logits_to_probs(logits, sampling)  # [1, vocab]
            x = q.argmax(-1) if sampling.greedy else sample(q, generator)
            tokens.append(x)
            probs.append(q)
            if i + 1 < k:
                logits = self.model.forward(x.view(1, 1), self.cache)[:, -1]
                self.cached.append(int(x))
        return Draft(
            tokens=torch.stack(tokens, dim=1),  # [1, k]
            probs=None if sampling.greedy else torch.stack(probs, dim=1),  # [1, k, vocab]
        )

    def _unsure(self, logits: torch.Tensor) -> bool:
        if self.confidence_threshold <= 0.0:
            return False
        return float(torch.softmax(logits.float(), dim=-1).max()) < self.confidence_threshold

    def observe(self, num_accepted: int) -> None:
        pass  # the next _sync trims whatever the target rejected
