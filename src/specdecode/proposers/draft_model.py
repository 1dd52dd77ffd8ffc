"""A small draft model sharing the target's tokenizer; its own cache, trimmed after rejections."""

from __future__ import annotations

from dataclasses import dataclass

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
from specdecode.models.base import CausalLM
from specdecode.proposers.base import ROUND_FEED, PerRequest, ProposerCaps

SINK = 4  # first prompt tokens a windowed draft keeps: attention sinks (StreamingLLM, arXiv 2309.17453)


class DraftModelProposer(PerRequest):
    """Samples k tokens autoregressively from the draft with the target's sampling settings.

    ``confidence_threshold`` > 0 stops drafting before the first token whose draft top probability
    (temperature 1, unfiltered) is below it, possibly before the first (a plain round); exactness
    is unaffected because the decision depends only on the draft's own distributions.

    A model with an output-vocabulary map ``vocab_ids`` (logit column j scores token
    ``vocab_ids[j]``, e.g. a distilled draft over the most frequent tokens) drafts within it; the
    reported q is zero outside it, which is exactly the distribution the tokens were drawn from.

    Where such a model can also score other tokens (``caps.columns``: a cut of a full head,
    :func:`~specdecode.models.native.restrict_output`), ``context_vocab`` (default on) adds a
    column for every token of the request's context outside ``vocab_ids``. A static cut misses
    mostly a prompt's own rare tokens (names, identifiers), and those are the ones an answer
    repeats: for the Qwen 0.5B's 32,768 lowest ids, 94% / 93% of the target's greedy tokens on
    HumanEval / Spec-Bench, 99.5% / 98.8% with the context's (BENCHMARKS.md). q is still exactly
    the distribution drawn from, over the columns of that round.

    ``prompt_window`` > 0 lets the draft read only the prompt's first :data:`SINK` tokens and its
    last ``prompt_window`` (then everything generated): a long prompt's read, which a draft pays
    before its first round, shrinks to a constant (TriForce / MagicDec draft from a partial cache;
    StreamingLLM's attention sinks). Exactness is unaffected: the draft reports the q it drew
    from, whatever it read; only acceptance may change.
    """

    name = "draft"
    caps = ProposerCaps(trees=True, batched_drafting=True, confidence=True, catches_up=True)

    def __init__(
        self,
        model: CausalLM,
        max_length: int | None = None,
        confidence_threshold: float = 0.0,
        branch: int = 3,
        static_tree: list[tuple[int, ...]] | None = None,
        prompt_window: int = 0,
        context_vocab: bool = True,
    ) -> None:
        check_threshold(confidence_threshold)
        if branch < 1:
            raise ConfigError(f"branch must be >= 1, got {branch}")
        if not isinstance(prompt_window, int) or prompt_window < 0:
            raise ConfigError(f"prompt_window must be an int >= 0 (0 reads the whole prompt), got {prompt_window!r}")
        if prompt_window and self.caps.shares_target_cache:
            raise ConfigError(f"{self.name} reads the target's own cache of the prompt: it takes no prompt_window")
        self.prompt_window = prompt_window
        self.model = model
        self.vocab_ids: torch.Tensor | None = getattr(model, "vocab_ids", None)
        if not isinstance(context_vocab, bool):
            raise ConfigError(f"context_vocab must be true or false, got {context_vocab!r}")
        self._outside: torch.Tensor | None = None  # [vocab] bool: tokens the reduced head lacks
        if context_vocab and self.vocab_ids is not None and model.caps.columns:
            self._outside = torch.ones(model.vocab_size, dtype=torch.bool)
            self._outside[self.vocab_ids] = False
        self.extra: _ContextColumns | None = None  # per request
        self.columns: torch.Tensor | None = self.vocab_ids  # token id of each logit column, this round
        self.branch = max([branch] + [r + 1 for path in static_tree or () for r in path])
        self.static_tree = None if static_tree is None else {tuple(p) for p in static_tree}
        self.confidence_threshold = confidence_threshold
        self.max_length = max_length or model.max_length
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values sit in the draft cache (of the view)
        self.agreed = 0  # cached[:agreed] is known to equal the view of the committed context
        self.skipped: tuple[int, int] = (0, 0)  # the slice of the context the draft never reads
        self.reused = 0  # positions of this request's read taken from the prefix store
        self.first_read: list[int] = []  # what the first read covers of the prompt (its view, less the last)

    def reset(self, prompt_ids: list[int]) -> None:
        # Caches grow on demand; start with room for the prompt and a typical answer. The prompt
        # is read by ``catch_up`` before the first round that drafts: never, where a batch
        # planner keeps this request at k = 0.
        cut = len(prompt_ids) - SINK - self.prompt_window
        self.skipped = (SINK, SINK + cut) if self.prompt_window and cut > 0 else (0, 0)
        self.cache = self.model.new_cache(min(self.max_length, len(prompt_ids) - self.dropped + 512))
        self.first_read = self._view(prompt_ids)[:-1]  # priced every step until read: built once
        self.extra = None if self._outside is None else _ContextColumns(self.model, self._outside, self.vocab_ids)
        self.columns = self.vocab_ids
        self.cached = []
        self.agreed = 0
        self.reused = 0

    @property
    def dropped(self) -> int:
        """How many prompt tokens this request's draft skips (its window's cut)."""
        return self.skipped[1] - self.skipped[0]

    def reads(self, context: list[int], start: int) -> int:
        """The tokens of the view the cache does not hold yet (so none of a window's cut, and
        none of the drafts it fed itself and the target accepted: after a fully accepted round
        only the last draft and the bonus token, which the next round feeds, so 0), before the
        first read less what the prefix store would supply of the prompt now. Counted from the
        committed context's start alone, a round that kept k drafts looked like k + 1 tokens to
        read, and near a request's end, spread over its last few tokens, priced drafting out."""
        view = self._view(context)
        n = len(view) - self._kept(view)
        if n <= ROUND_FEED and self.cached:  # a round's own leftovers go with the round
            return 0
        if not self.cached and self.prefix_scope is not None:
            n -= min(self.prefix_scope.reusable(self.model, self.first_read), n)
        return n

    def _view(self, context: list[int]) -> list[int]:
        """What the draft reads of ``context``: all of it, or its sink and window and what follows.
        The view of a context that grew by appending is the old view with the same appended."""
        lo, hi = self.skipped
        return context if hi == 0 else context[:lo] + context[hi:]

    def _kept(self, context: list[int]) -> int:
        """How much of the cache agrees with ``context`` (always refeeding its last token)."""
        # Context only grows by appending, so what agreed last round still agrees.
        keep = min(self.agreed, len(context) - 1)
        limit = min(len(self.cached), len(context) - 1)
        while keep < limit and self.cached[keep] == context[keep]:
            keep += 1
        return keep

    def _fresh(self, context: list[int]) -> list[int]:
        """Trim the cache to its longest prefix agreeing with ``context``; the tokens to feed."""
        keep = self._kept(context)
        self.cache.trim(keep)
        self.cached = list(context)
        self.agreed = len(context)
        return context[keep:]

    def catch_up(self, context: list[int]) -> int:
        """Feed all but the last token of ``context`` where a round would feed more than one
        following a drafting round does (a rejection's correction, or the last draft and the
        bonus token): the prompt, or what was committed while this request did not draft.
        Left to the round, that read was priced as drafting (the Qwen 0.5B's prompt: 80 ms a
        drafted token against 24) and a cost-aware k policy switched speculation off for good."""
        context = self._view(context)
        if len(context) - self._kept(context) <= ROUND_FEED:
            return 0
        read = context[:-1]
        scope, first = self.prefix_scope, not self.cached
        if scope is not None and first:  # an earlier request read the same start: copy it
            self.reused = scope.reuse(self.model, self.cache, read)
            self.cached, self.agreed = read[: self.reused], self.reused
        fresh = torch.tensor(self._fresh(read), dtype=torch.long)
        if fresh.numel() == 0:
            return 0
        if self.model.caps.rows:  # a prompt chunk: no logits wanted (and its fast path, if any)
            self.model.forward_rows([fresh], [self.cache], keep=[0])
        else:
            self.model.forward(fresh[None], self.cache, last_only=True)
        if scope is not None and first:  # later requests starting the same way take it from here
            scope.keep(self.model, read, self.cache)
        return fresh.numel()

    def finish(self, context: list[int]) -> None:
        """Store the whole conversation read so far, where the model writes every position bitwise
        alike however it was read (``caps.row_exact``): the next turn then starts from it."""
        if self.prefix_scope is not None and self.model.caps.row_exact and self.cache is not None:
            view = self._view(context)
            self.prefix_scope.keep(self.model, view[: self._kept(view)], self.cache)

    def stats(self) -> dict:
        return {"draft_cached_tokens": self.reused}

    def _round(self, context: list[int]) -> None:
        """Start a round on the committed ``context``: the columns its logits will have."""
        if self.extra is not None:
            self.extra.learn(context)
            self.columns = self.extra.columns

    def _forward(self, ids: torch.Tensor, **kw) -> torch.Tensor:
        """Feed ``ids`` [1, n] to the cache (``kw``: positions, attn_mask, last_only); logits
        [n, columns] (the last row's only with ``last_only``)."""
        if self.extra is None or not self.extra.ids:
            return self.model.forward(ids, self.cache, **kw)[0]
        logits, hidden = self.model.forward(ids, self.cache, return_hidden=True, **kw)
        return self.extra.extend(logits[0], hidden[-logits.shape[1] :])

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Bring the cache up to ``context``; the logits after its last token ([1, columns])."""
        fresh = self._fresh(context)
        return self._forward(torch.tensor([fresh], dtype=torch.long), last_only=True)[-1:]

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        if k == 0:
            return Draft.empty()
        self._round(context)
        chain = _Chain(self, k, sampling, generator)
        logits = self._sync(self._view(context))
        while chain.pick(logits):
            logits = self._forward(chain.tokens[-1].view(1, 1))
        return chain.draft()

    def propose_batch(
        self,
        states: list["DraftModelProposer"],
        contexts: list[list[int]],
        ks: list[int],
        samplings: list[SamplingConfig],
        generators: list[torch.Generator | None],
    ) -> list[Draft]:
        """Every state's chain (states started from this proposer, so sharing its draft model),
        with one multi-row draft forward per draft step; each chain is exactly what ``propose``
        gives that state alone (the model's rows are computed as lone forwards would be)."""
        if not self.model.caps.rows:
            return [s.propose(c, k, sp, g) for s, c, k, sp, g in zip(states, contexts, ks, samplings, generators)]
        for s, c in zip(states, contexts):
            s._round(c)
        chains = [_Chain(s, k, sp, g) for s, k, sp, g in zip(states, ks, samplings, generators)]
        fresh = [torch.tensor(s._fresh(s._view(c))) for s, c in zip(states, contexts)]
        live = list(range(len(states)))
        logits = dict(zip(live, _last_rows(states, fresh)))
        while live:
            live = [i for i in live if chains[i].pick(logits[i])]
            if live:
                out = _last_rows([states[i] for i in live], [chains[i].tokens[-1].view(1) for i in live])
                logits = dict(zip(live, out))
        return [c.draft() for c in chains]

    def propose_tree(self, context: list[int], k: int, max_nodes: int) -> list[list[int]]:
        """Candidate paths (best first) for tree verification; see the tree drafting notes below."""
        if not self.model.caps.trees:
            raise ConfigError("tree drafting from a draft model needs a backend with attention masks (native)")
        self._round(context)
        logits = self._sync(self._view(context))[0]
        base = self.cache.length
        nodes: list[_Node] = []
        frontier = [(_Node((), (), 1.0), logits)]
        slots: dict[tuple[int, ...], int] = {}  # token path -> draft cache index of its last token
        for _ in range(k):
            level = _expand(self, frontier, max_nodes - len(nodes))
            if not level:
                break
            nodes.extend(level)
            frontier = _score_level(self, level, slots, base) if len(nodes) < max_nodes else []
        self.cache.trim(base)
        self.cached = self.cached[:base]
        inner = {n.tokens[:-1] for n in nodes}
        return [list(n.tokens) for n in nodes if n.tokens not in inner]

    def _reported(self, q: torch.Tensor) -> torch.Tensor:
        """The q reported to the verifier [1, vocab]: the drawn-from distribution, mapped to token ids."""
        return q if self.columns is None else to_vocab(q, self.columns, self.model.vocab_size)

    def observe(self, num_accepted: int) -> None:
        pass  # the next _sync trims whatever the target rejected


def _last_rows(states: list[DraftModelProposer], rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """One multi-row draft forward feeding ``rows[i]`` ([n_i] ids) to ``states[i]``'s cache; each
    state's logits after its last token [1, columns] (its context's columns added)."""
    hidden = any(s.extra is not None and s.extra.ids for s in states)
    out = states[0].model.forward_rows(rows, [s.cache for s in states], last_only=True, return_hidden=hidden)
    if not hidden:
        return [o[0, -1:] for o in out]
    return [
        o[0, -1:] if s.extra is None or not s.extra.ids else s.extra.extend(o[0, -1:], h[-1:])
        for s, o, h in zip(states, *out)
    ]


class _ContextColumns:
    """One request's extra logit columns: every token of its context a reduced head lacks,
    with that token's row of the full head (read once, when first seen)."""

    def __init__(self, model: CausalLM, outside: torch.Tensor, static: torch.Tensor) -> None:
        self.model, self.outside, self.static = model, outside, static  # shared: [vocab] bool, [S]
        self.ids: list[int] = []
        self.columns = static  # the token id of each logit column [S + m]: rebuilt only as ids grow
        self.rows = torch.empty(0)  # [len(ids), hidden] float32
        self.scanned = 0  # the context's tokens looked at so far (a committed context only grows)
        self._seen: set[int] = set()

    def learn(self, context: list[int]) -> None:
        """Add the tokens of ``context`` not looked at yet that the reduced head lacks."""
        tail = torch.tensor(context[self.scanned :], dtype=torch.long)
        self.scanned = len(context)
        new = [t for t in tail[self.outside[tail]].unique().tolist() if t not in self._seen]
        if new:
            self._seen.update(new)
            rows = self.model.head_rows(torch.tensor(new, dtype=torch.long))
            self.rows = rows if not self.ids else torch.cat([self.rows, rows])
            self.ids.extend(new)
            self.columns = torch.cat([self.static, torch.tensor(self.ids, dtype=torch.long)])

    def extend(self, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``logits`` [n, S] of the reduced head with this request's columns appended [n, S + m],
        from the same rows' pre-norm features ``hidden`` [n, hidden]."""
        return torch.cat([logits, self.model.column_logits(hidden, self.rows)], dim=-1)


class _Chain:
    """One chain being drafted: ``pick`` takes the next token from the draft's logits."""

    def __init__(self, proposer: DraftModelProposer, k: int, sampling: SamplingConfig, generator) -> None:
        self.p, self.k, self.sampling, self.generator = proposer, k, sampling, generator
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor) -> bool:
        """Draft one token from ``logits`` [1, vocab]; True when the draft must be fed it for more."""
        p = self.p
        if confident_prefix(logits, p.confidence_threshold) == 0:
            self.k = len(self.tokens)
            return False
        q = logits_to_probs(logits, self.sampling)  # [1, output columns]
        j = q.argmax(-1) if self.sampling.greedy else sample(q, self.generator)
        x = j if p.columns is None else p.columns[j]
        self.tokens.append(x)
        if not self.sampling.greedy:
            self.probs.append(p._reported(q))
        if len(self.tokens) < self.k:
            p.cached.append(int(x))
            return True
        return False

    def draft(self) -> Draft:
        if not self.tokens:
            return Draft.empty()
        return Draft(
            tokens=torch.stack(self.tokens, dim=1),  # [1, k]
            probs=None if self.sampling.greedy else torch.stack(self.probs, dim=1),  # [1, k, vocab]
        )


# -- tree drafting -------------------------------------------------------------------------------
# Top-b branches expanded level by level, one masked draft forward per level. Dynamic trees keep,
# at each depth, the candidates with the highest cumulative draft probability within the node
# budget (EAGLE-2's rule); a static tree is a set of rank paths, e.g. {(0,), (1,), (0, 0)}
# (Medusa's format). The draft cache is trimmed back to the context afterwards.


@dataclass(frozen=True)
class _Node:
    tokens: tuple[int, ...]
    ranks: tuple[int, ...]
    prob: float  # cumulative draft probability of the path


def _expand(proposer: DraftModelProposer, frontier: list, budget: int) -> list[_Node]:
    """The frontier's top-b children allowed by the static tree, best cumulative probability first."""
    options = []
    for node, logits in frontier:
        top = torch.topk(torch.softmax(logits.float(), dim=-1), min(proposer.branch, logits.shape[-1]))
        ids = top.indices if proposer.columns is None else proposer.columns[top.indices]
        for rank, (p, tok) in enumerate(zip(top.values.tolist(), ids.tolist())):
            ranks = node.ranks + (rank,)
            if proposer.static_tree is None or ranks in proposer.static_tree:
                options.append(_Node(node.tokens + (tok,), ranks, node.prob * p))
    options.sort(key=lambda n: -n.prob)
    return options[: max(budget, 0)]


def _score_level(proposer: DraftModelProposer, level: list[_Node], slots: dict, base: int) -> list:
    """One masked draft forward over a level's nodes (each sees the context and its ancestors)."""
    start, n = proposer.cache.length, len(level)
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :base] = True
    for i, node in enumerate(level):
        for d in range(1, len(node.tokens)):
            mask[i, slots[node.tokens[:d]]] = True
        mask[i, start + i] = True
        slots[node.tokens] = start + i
    ids = torch.tensor([[node.tokens[-1] for node in level]])
    positions = torch.tensor([[base + len(node.tokens) - 1 for node in level]])
    out = proposer._forward(ids, positions=positions, attn_mask=mask)
    return [(node, out[i]) for i, node in enumerate(level)]
