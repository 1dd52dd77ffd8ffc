"""Lookup first, trained drafter second: prompt lookup where the context repeats itself, else a
trained drafter (EAGLE, Medusa or the distilled draft model).

Prompt lookup costs nothing to draft and is accepted often where the answer copies the prompt
(translation, rewriting, code edits), but it has nothing good to offer elsewhere; a trained
drafter costs a little per token and guesses everywhere. Each round takes the lookup when the
context's tail (at least ``min_match`` tokens) occurred before, and asks the drafter otherwise;
when the drafter drafts nothing (its confidence stop), a shorter match is tried last.

Exactness: which proposer drafts depends on the committed context alone, and each reports
exactly its own q (one-hot for lookup), so the one verifier keeps the target's distribution.
A feature-reading drafter picks up the target's forwards of lookup rounds when it next drafts
(:mod:`specdecode.proposers.features`), so it never recomputes them.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.proposers.base import PerRequest, Proposer, ProposerCaps
from specdecode.proposers.ngram import lookup


class HybridProposer(PerRequest):
    name = "hybrid"

    def __init__(self, drafter: Proposer, min_match: int = 2, max_ngram: int = 3) -> None:
        """``min_match``: the shortest context tail whose earlier occurrence makes a lookup round;
        shorter matches are used only when the drafter drafts nothing (its confidence stop)."""
        if not 1 <= min_match <= max_ngram:
            raise ConfigError(f"need 1 <= min_match <= max_ngram, got {min_match}, {max_ngram}")
        self.drafter, self.min_match, self.max_ngram = drafter, min_match, max_ngram
        inner = drafter.caps
        self.caps = ProposerCaps(  # chains only; what the drafter reads, the hybrid passes on
            reads_target_features=inner.reads_target_features,
            confidence=True,
            needs_native=inner.needs_native,
            shares_target_cache=inner.shares_target_cache,
            catches_up=inner.catches_up,
        )
        self.rounds = {"lookup": 0, "drafter": 0, "short": 0}  # which source drafted, in this request
        self._source = "drafter"
        self._target_cache: object | None = None

    def _bind(self, target_cache: object | None) -> None:
        self._target_cache = target_cache  # for the drafter's own start, in reset

    def reset(self, prompt_ids: list[int]) -> None:
        """This request's drafter state and counts (``start`` calls this on the request's copy)."""
        self.drafter = self.drafter.start(prompt_ids, self._target_cache)
        self._target_cache = None
        self.rounds = dict.fromkeys(self.rounds, 0)
        self._source = "drafter"

    def finish(self, context: list[int]) -> None:
        self.drafter.finish(context)

    def stats(self) -> dict:
        return {"hybrid_rounds": dict(self.rounds), **self.drafter.stats()}

    def catch_up(self, context: list[int]) -> None:
        self.drafter.catch_up(context)

    def reads(self, start: int, end: int) -> int:
        return self.drafter.reads(start, end)

    def observe_forward(self, ids, positions, mask, hidden) -> None:
        self.drafter.observe_forward(ids, positions, mask, hidden)

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        source, found = "lookup", lookup(context, k, self.max_ngram, self.min_match) if k > 0 else []
        if not found:
            draft = self.drafter.propose(context, k, sampling, generator)
            short = [] if draft.tokens.shape[1] or self.min_match == 1 else lookup(context, k, self.min_match - 1)
            if not short:
                return self._count("drafter", draft)
            source, found = "short", short
        return self._count(source, Draft(tokens=torch.tensor([found], dtype=torch.long)))

    def _count(self, source: str, draft: Draft) -> Draft:
        self._source = source
        self.rounds[source] += 1
        return draft

    def observe(self, num_accepted: int) -> None:
        if self._source == "drafter":
            self.drafter.observe(num_accepted)
