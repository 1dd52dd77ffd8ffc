"""Cross-tokenizer drafts ("universal assisted decoding"): a draft model with its own tokenizer.

Each round the target context is decoded to text, re-tokenised for the draft (its cache keeps
the longest common prefix and is trimmed past it), the draft continues greedily, and the drafted
text is re-tokenised with the target's tokenizer. The target tokens that follow the context are
proposed as a deterministic draft (one-hot q), so the shared verifier keeps sampling exact and
greedy decoding token-identical whatever the draft does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.proposers.base import PerRequest, ProposerCaps

_DECODE = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}


class CrossTokenizerProposer(PerRequest):
    """Greedy drafts from a model whose tokenizer differs from the target's.

    ``draft`` is a :class:`~specdecode.models.loading.LoadedModel` (model + tokenizer).
    ``draft_tokens`` fixes how many draft tokens to generate per round; by default it is
    ``ceil((k + 1) * r)`` where r is the draft-to-target token ratio of the context, capped at
    ``max_draft_tokens``. The last target token is withheld when the drafted text may end
    mid-token (fewer than k + 1 target tokens came out and the draft did not stop on EOS).
    """

    name = "xtok"
    caps = ProposerCaps(catches_up=True)

    def __init__(
        self,
        draft: Any,
        target_tokenizer: Any,
        max_length: int | None = None,
        draft_tokens: int | None = None,
        max_draft_tokens: int = 64,
    ) -> None:
        if draft_tokens is not None and draft_tokens < 1:
            raise ConfigError(f"draft_tokens must be >= 1, got {draft_tokens}")
        if max_draft_tokens < 1:
            raise ConfigError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        if getattr(draft, "tokenizer", None) is None or target_tokenizer is None:
            raise ConfigError("method 'xtok' needs both the target's and the draft's tokenizer")
        self.model = draft.model
        self.dtok = draft.tokenizer
        self.ttok = target_tokenizer
        self.draft_eos = frozenset(getattr(draft, "eos_token_ids", ()) or ())
        self.max_length = max_length or self.model.max_length
        self.draft_tokens, self.max_draft_tokens = draft_tokens, max_draft_tokens
        self.cache = None
        self.cached: list[int] = []  # draft tokens whose keys/values sit in the draft cache

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.new_cache(self.max_length)
        self.cached = []

    def catch_up(self, context: list[int]) -> int:
        """The prompt, re-tokenized for the draft, read before the first round that drafts."""
        if not self.cached and self.cache is not None:
            dids = list(self.dtok.encode(self.ttok.decode(context, **_DECODE), add_special_tokens=False))
            if len(dids) > 1:
                self._sync(dids[:-1])
                return len(dids) - 1
        return 0

    def _sync(self, ids: list[int]) -> torch.Tensor:
        """Keep the cached draft tokens' longest common prefix with ``ids``; feed the rest."""
        limit = min(len(self.cached), len(ids) - 1)  # always refeed at least one token
        keep = 0
        while keep < limit and self.cached[keep] == ids[keep]:
            keep += 1
        self.cache.trim(keep)
        logits = self.model.forward(torch.tensor([ids[keep:]], dtype=torch.long), self.cache)
        self.cached = list(ids)
        return logits[:, -1]

    def _count(self, k: int, n_draft: int, n_target: int) -> int:
        if self.draft_tokens is not None:
            return self.draft_tokens
        ratio = max(1.0, n_draft / max(1, n_target))
        return min(self.max_draft_tokens, math.ceil((k + 1) * ratio))

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        if k < 1:
            return Draft.empty()
        if self.cache is None:
            self.reset(context)
        text = self.ttok.decode(context, **_DECODE)
        dids = list(self.dtok.encode(text, add_special_tokens=False))
        n = self._count(k, len(dids), len(context))
        if not dids or len(dids) + n > self.max_length:
            return Draft.empty()
        new, stopped = self._draft(dids, n)
        cand = self._to_target(context, text, dids, new)
        if len(cand) <= k and not stopped:
            cand = cand[:-1]  # the drafted text may end inside the last target token
        cand = cand[:k]
        if not cand:
            return Draft.empty()
        return Draft(tokens=torch.tensor([cand], dtype=torch.long))

    def _draft(self, dids: list[int], n: int) -> tuple[list[int], bool]:
        """Up to ``n`` greedy draft tokens after ``dids``; True when the draft stopped on EOS."""
        logits = self._sync(dids)
        new: list[int] = []
        for i in range(n):
            x = int(logits.argmax(-1))
            new.append(x)
            if x in self.draft_eos:
                return new, True
            if i + 1 < n:
                logits = self.model.forward(torch.tensor([[x]], dtype=torch.long), self.cache)[:, -1]
                self.cached.append(x)
        return new, False

    def _to_target(self, context: list[int], text: str, dids: list[int], new: list[int]) -> list[int]:
        """Target tokens continuing ``context`` whose text is the drafted text."""
        base = self.dtok.decode(dids, **_DECODE)
        full = self.dtok.decode(dids + new, **_DECODE)
        drafted = full[len(base) :] if full.startswith(base) else self.dtok.decode(new, **_DECODE)
        drafted = drafted.rstrip("\ufffd")  # an incomplete UTF-8 character at the end
        if not drafted:
            return []
        ids = list(self.ttok.encode(text + drafted, add_special_tokens=False))
        m = len(context)
        if ids[:m] == context:
            return ids[m:]
        # The re-tokenised context differs from the real one (the drafted text merged with the
        # last context token, or the context is not the canonical tokenisation): encode the
        # drafted text alone and use it only if it appends exactly that text.
        alone = list(self.ttok.encode(drafted, add_special_tokens=False))
        if alone and self.ttok.decode(context + alone, **_DECODE) == text + drafted:
            return alone
        return []

    def observe(self, num_accepted: int) -> None:
        pass  # the next round re-tokenises the committed text and trims the draft cache
