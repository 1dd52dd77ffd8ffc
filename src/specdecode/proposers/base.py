"""The one interface every proposer implements; the decode loop never knows which it drives.

A proposer is built once per engine (its weights and settings, shared by every request) and
``start`` gives each request its own small state object; the engine never resets a shared one.
What a proposer can do beyond drafting a chain is declared in ``caps`` and read by the engine,
never probed for.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft
from specdecode.models.prefix_cache import PrefixScope


@dataclass(frozen=True)
class ProposerCaps:
    """Declared capabilities; each flag names the methods the engine may then call."""

    trees: bool = False  # propose_tree(context, k, max_nodes) -> paths
    side_branch: bool = False  # side_branch(context) / observe_side(logits) in tree rounds (lookahead)
    tree_only: bool = False  # drafts only through the tree forward (lookahead): refuse chains
    shares_target_cache: bool = False  # start(prompt, target_cache) aliases part of the target cache
    reads_target_features: bool = False  # observe_forward(ids, positions, mask, hidden) after target forwards
    batched_drafting: bool = False  # the shared object's propose_batch(states, contexts, ks, samplings, gens)
    confidence: bool = False  # takes confidence_threshold (a chain that stops at unsure tokens)
    needs_native: bool = False  # only runs on the native backend
    catches_up: bool = False  # catch_up(context) reads unseen context (the prompt) before a drafting round
    # Drafts are deterministic (a function of the context, probs None), nearly free, and carry
    # Draft.scores: the engine may draft k_max before choosing k and verify only the prefix that
    # round's scores pay for. (Choosing k from the drafted tokens is exact only because they are
    # not sampled; scores on sampled drafts are ignored.)
    scored_drafts: bool = False


@dataclass(frozen=True)
class Source:
    """Which of a proposer's drafters drafts the coming round, named before the engine chooses
    its k (``Proposer.source``). A composite proposer (the hybrid: lookup, else a draft model)
    mixes drafters whose costs and acceptance differ by far; the engine keeps its acceptance
    estimates and draft speed per source, so a free, well-accepted lookup round does not make
    the draft model look cheap, nor the draft model's rounds make the lookup look poor.

    ``catches_up``: the round needs the proposer's ``catch_up`` first (where ``caps.catches_up``).
    A lookup round does not, so a draft model reads the context only before a round it drafts.
    ``scored``: this round's drafts are what ``caps.scored_drafts`` promises of a whole proposer
    (deterministic, nearly free, with ``Draft.scores``), so the engine may draft k_max first and
    verify the prefix the scores pay for, as it does for such a proposer's every round.
    """

    name: str = ""
    catches_up: bool = True
    scored: bool = False


SINGLE = Source()  # a proposer with one drafter (and any round the engine does not plan by source)


# The most committed tokens a round may leave a catching-up proposer to read after a round that
# drafted (a rejection's correction, or the last draft and the bonus token): more is a catch-up.
ROUND_FEED = 2


@runtime_checkable
class Proposer(Protocol):
    name: str
    caps: ProposerCaps

    def start(
        self, prompt_ids: list[int], target_cache: object | None = None, prefix_scope: PrefixScope | None = None
    ) -> "Proposer":
        """A fresh per-request state for a request whose prompt is ``prompt_ids`` (self unchanged).

        ``prefix_scope``: the request's part in what the engine shares between requests (None:
        outside an engine): its ``cache_salt``, and the prefix stores. A state that reads the
        context into a model cache of its own (a draft model) may take stored positions from it
        instead, and store what it read; one that learns from other requests' outputs (a suffix
        corpus) learns only from those with the same salt."""
        ...

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """Up to ``k`` candidates continuing ``context`` (every committed token so far).

        Stochastic proposers return their processed distributions q ([1, k, vocab], the same
        ``sampling`` as the target); deterministic ones return ``probs=None`` (one-hot q).
        """
        ...

    def observe(self, num_accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted."""
        ...

    def catch_up(self, context: list[int]) -> int | None:
        """Read the committed context this state has not seen yet (a draft model's prompt, the
        tokens of rounds it did not draft) before a round that drafts. Called only where
        ``caps.catches_up``; the engine times it as prefill, so a round's draft time stays the
        price of drafting alone. A request that never drafts never pays for it. Returns how many
        tokens it read (the engine's price of a read is per token read: a state that had most of
        them already, or took them from a prefix store, read few); None: as many as it had not seen."""
        ...

    def source(self, context: list[int], k: int) -> Source:
        """The drafter of the round about to continue ``context`` with up to ``k`` drafts; a
        function of the committed context alone (so choosing k by it keeps sampling exact). The
        next ``propose`` on the same context drafts from it, with any k up to ``k``."""
        ...

    def fallback(self, context: list[int]) -> Source | None:
        """A second drafter for the round ``source`` named, for when the engine plans no drafts
        from the first (a hybrid's short lookup while its draft model is kept off), else None.
        Like ``source``, a function of the committed context alone; once it is returned, the
        next ``propose`` on the same context drafts from it."""
        ...

    def reads(self, context: list[int], start: int) -> int:
        """How many tokens ``catch_up(context)`` would read now, where ``start`` is the first
        committed token the engine has not seen it read: by default all of ``context[start:]``;
        fewer for a draft that reads a window of the prompt, or that fed itself drafts the
        target then accepted (they sit in its cache already). The engine prices a read to come
        by it. Called only where ``caps.catches_up``."""
        ...

    def finish(self, context: list[int]) -> None:
        """The request ended with ``context`` committed (a corpus may learn from it)."""
        ...

    def stats(self) -> dict:
        """Method-specific figures of this request for its result's stats (may be empty)."""
        ...


class PerRequest:
    """Mixin implementing ``start``: a shallow copy shares the weights and settings, then
    ``reset`` gives the copy its own per-request fields (every one of them reassigned, never
    mutated in place, so nothing of one request reaches another or the shared object).

    Subclasses declare ``caps`` and implement ``reset(prompt_ids)``; one that aliases the
    target cache overrides ``_bind``.
    """

    caps: ClassVar[ProposerCaps] = ProposerCaps()

    prefix_scope: PrefixScope | None = None

    def start(self, prompt_ids: list[int], target_cache: object | None = None, prefix_scope: PrefixScope | None = None):
        state = copy.copy(self)
        state._bind(target_cache)
        state.prefix_scope = prefix_scope
        state.reset(list(prompt_ids))
        return state

    def _bind(self, target_cache: object | None) -> None:
        pass

    def reset(self, prompt_ids: list[int]) -> None:
        pass

    def finish(self, context: list[int]) -> None:
        pass

    def catch_up(self, context: list[int]) -> int | None:
        return 0

    def source(self, context: list[int], k: int) -> Source:
        return SINGLE

    def fallback(self, context: list[int]) -> Source | None:
        return None

    def reads(self, context: list[int], start: int) -> int:
        return len(context) - start

    def stats(self) -> dict:
        return {}
