"""Lookup first, trained drafter second: a lookup where the context repeats itself, else a
trained drafter (EAGLE, Medusa or the distilled draft model).

Prompt lookup costs nothing to draft and is accepted often where the answer copies the prompt
(translation, rewriting, code edits), but it has nothing good to offer elsewhere; a trained
drafter costs a little per token and guesses everywhere. Each round takes the lookup when the
context's tail (at least ``min_match`` tokens) occurred before, and asks the drafter otherwise;
when the drafter drafts nothing (its confidence stop), a shorter match is tried last. The lookup
is suffix decoding (the default), which also continues what this proposer's earlier requests
wrote, or n-gram prompt lookup (``lookup="ngram"``).

Each round's source is named before the engine chooses k (``source``): the engine keeps
acceptance and draft speed per source, and a draft model reads the context it has not seen only
before a round it drafts, so rounds that lookup covers cost it nothing.

Exactness: which proposer drafts depends on the committed context alone (and, for suffix, on
the outputs of requests that finished before), never on this round's draws; each reports
exactly its own q (one-hot for lookup), so the one verifier keeps the target's distribution.
A feature-reading drafter picks up the target's forwards of lookup rounds when it next drafts
(:mod:`specdecode.proposers.features`), so it never recomputes them.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.errors import ConfigError
from specdecode.proposers.base import PerRequest, Proposer, ProposerCaps, Source
from specdecode.proposers.ngram import lookup
from specdecode.proposers.suffix import SuffixProposer

LOOKUPS = ("ngram", "suffix")
DEFAULT_LOOKUP = "suffix"
LOOKUP = Source("lookup", catches_up=False)  # a lookup round: the drafter need not read anything
SCORED_LOOKUP = Source("lookup", catches_up=False, scored=True)  # suffix decoding's, scored by match length
DRAFTER = Source("drafter")


class HybridProposer(PerRequest):
    name = "hybrid"

    def __init__(self, drafter: Proposer, min_match: int = 2, max_ngram: int = 3, lookup: str = DEFAULT_LOOKUP) -> None:
        """``min_match``: the shortest context tail whose earlier occurrence makes a lookup round;
        shorter matches are used only when the drafter drafts nothing (its confidence stop).
        ``lookup``: "suffix" (suffix decoding over the context and the outputs of this proposer's
        earlier requests, :class:`SuffixProposer` with its defaults; a lookup round when it drafts
        at least ``min_match`` tokens), or "ngram" (the latest earlier match of the context's last
        3..min_match tokens). Suffix is the default: it measured at least as fast as n-gram on
        every workload and target we have (BENCHMARKS.md, session 42)."""
        if not 1 <= min_match <= max_ngram:
            raise ConfigError(f"need 1 <= min_match <= max_ngram, got {min_match}, {max_ngram}")
        if lookup not in LOOKUPS:
            raise ConfigError(f"hybrid lookup must be one of {', '.join(LOOKUPS)}, got {lookup!r}")
        self.drafter, self.min_match, self.max_ngram = drafter, min_match, max_ngram
        self.suffix = SuffixProposer() if lookup == "suffix" else None  # shared corpus; a state per request
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
        self._named: tuple[int, Draft, Draft | None] | None = None  # (context length, lookup, weak) of ``source``
        self._short = False  # the engine took ``fallback``: the named lookup is the short one

    def _bind(self, target_cache: object | None) -> None:
        self._target_cache = target_cache  # for the drafter's own start, in reset

    def reset(self, prompt_ids: list[int]) -> None:
        """This request's drafter state and counts (``start`` calls this on the request's copy)."""
        self.drafter = self.drafter.start(prompt_ids, self._target_cache, self.prefix_scope)
        self.suffix = None if self.suffix is None else self.suffix.start(prompt_ids, None, self.prefix_scope)
        self._target_cache = None
        self.rounds = dict.fromkeys(self.rounds, 0)
        self._source = "drafter"
        self._named = None
        self._short = False

    def finish(self, context: list[int]) -> None:
        self.drafter.finish(context)
        if self.suffix is not None:
            self.suffix.finish(context)  # the output joins the suffix corpus

    def stats(self) -> dict:
        return {"hybrid_rounds": dict(self.rounds), **self.drafter.stats()}

    def catch_up(self, context: list[int]) -> int | None:
        return self.drafter.catch_up(context)

    def reads(self, context: list[int], start: int) -> int:
        return self.drafter.reads(context, start)

    def observe_forward(self, ids, positions, mask, hidden) -> None:
        self.drafter.observe_forward(ids, positions, mask, hidden)

    def source(self, context: list[int], k: int) -> Source:
        """A lookup round when the lookup has its evidence (see ``_lookup``) for up to ``k``
        drafts, else the drafter's. The next ``propose`` on this context drafts from the source
        named here (the lookup's drafts, cut to the k the engine chose)."""
        if self._named is None or self._named[0] != len(context):  # not named yet for this context
            self._named = (len(context), *self._lookup_or_empty(context, k))
        if not self._named[1].k:
            return DRAFTER
        return LOOKUP if self.suffix is None else SCORED_LOOKUP

    def fallback(self, context: list[int]) -> Source | None:
        """Suffix decoding's short draft (fewer than ``min_match`` tokens), scored, for a round
        named for the drafter that the engine keeps off: the round then drafts what plain suffix
        decoding would, instead of nothing (on HumanEval the 0.5B stayed off in half the rounds)."""
        named = self._named
        if named is None or named[0] != len(context) or named[1].k or named[2] is None or not named[2].k:
            return None
        self._named = (named[0], named[2], None)  # the next propose drafts the short lookup
        self._short = True
        return SCORED_LOOKUP

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        named, self._named = self._named, None
        short, self._short = self._short, False
        if named is not None and named[0] == len(context):  # the source named for this round
            found, weak = named[1].prefix(k), None if named[2] is None else named[2].prefix(k)
        else:
            found, weak = self._lookup_or_empty(context, k)
        if found.k:
            return self._count("short" if short else "lookup", found)
        draft = self.drafter.propose(context, k, sampling, generator)
        if draft.k or k == 0:
            return self._count("drafter", draft)
        short = weak if weak is not None else self._short_ngram(context, k)  # the drafter drafted nothing
        return self._count("short", short) if short.k else self._count("drafter", draft)

    def _lookup_or_empty(self, context: list[int], k: int) -> tuple[Draft, Draft | None]:
        return self._lookup(context, k) if k > 0 else (Draft.empty(), None)

    def _lookup(self, context: list[int], k: int) -> tuple[Draft, Draft | None]:
        """(a lookup draft with at least ``min_match`` tokens of evidence behind it, else empty;
        suffix's shorter draft, kept for a round the drafter leaves empty)."""
        if self.suffix is None:
            return _chain(lookup(context, k, self.max_ngram, self.min_match)), None
        drafted = self.suffix.propose(context, k, SamplingConfig(), None)  # q one-hot (probs None), scored
        return (drafted, None) if drafted.k >= min(k, self.min_match) else (Draft.empty(), drafted)

    def _short_ngram(self, context: list[int], k: int) -> Draft:
        return _chain(lookup(context, k, self.min_match - 1)) if self.min_match > 1 else Draft.empty()

    def _count(self, source: str, draft: Draft) -> Draft:
        self._source = source
        self.rounds[source] += 1
        return draft

    def observe(self, num_accepted: int) -> None:
        if self._source == "drafter":
            self.drafter.observe(num_accepted)


def _chain(tokens: list[int]) -> Draft:
    """An n-gram lookup's draft (deterministic: one-hot q); empty where nothing matched."""
    return Draft(tokens=torch.tensor([tokens], dtype=torch.long)) if tokens else Draft.empty()
