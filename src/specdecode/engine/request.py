"""One request in the engine: its settings, its cache and proposer state, and its share of a step.

Everything here belongs to one request and dies with it; the target, the proposer prototypes and
the policies' settings are shared and never written to. A step asks each running request for its
row (``plan`` then ``row``: a prefill chunk, the last token alone, a k+1-token chain or a tree)
and hands back that row's logits (``absorb``): accept, trim, emit.
"""

from __future__ import annotations

import copy
import functools
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specdecode.core.sampling import SamplingConfig, logits_to_probs, token_logprobs
from specdecode.core.tree import Tree, verify_tree_greedy, verify_tree_sampling
from specdecode.core.verify import Draft, Verification, verify_greedy, verify_sampling
from specdecode.engine.output import OutputTracker
from specdecode.engine.policy import FixedK, KPolicy
from specdecode.engine.shadow import ShadowTracker
from specdecode.errors import ConfigError, InputError
from specdecode.metrics import RequestMetrics
from specdecode.models.base import CausalLM, KVCache
from specdecode.models.prefix_cache import PrefixScope
from specdecode.proposers.base import ROUND_FEED, SINGLE, Proposer, Source


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request settings."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: none; n: each emitted token's logprob and the top n alternatives
    # Prefix-cache scope: a request reuses only prefixes stored by requests with the same salt
    # (None: the shared, unsalted scope), so one tenant's prompts never speed up another's.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ConfigError(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ConfigError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")


@dataclass(frozen=True)
class TreeConfig:
    """Tree drafting: at most ``max_nodes`` candidate nodes per round (depth is bounded by k)."""

    max_nodes: int = 16

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ConfigError(f"max_nodes must be >= 1, got {self.max_nodes}")


@dataclass(frozen=True)
class Speculation:
    """How one request speculates: a proposer prototype (shared; each request starts its own
    state from it), the most drafts per round, the k policy (a prototype copied per request;
    ``batch_planned`` lets the engine choose k for the whole batch), shadow mode and trees."""

    proposer: Proposer | None = None
    k: int = 4
    policy: KPolicy | None = None
    shadow: bool = False
    tree: TreeConfig | None = None

    def __post_init__(self) -> None:
        if self.proposer is not None and (not isinstance(self.k, int) or self.k < 1):
            raise ConfigError(f"k must be an integer >= 1, got {self.k!r}")
        if self.shadow and self.proposer is None:
            raise ConfigError("shadow mode needs a proposer (a method other than 'none')")

    @property
    def method(self) -> str:
        return self.proposer.name if self.proposer is not None else "none"

    @property
    def k_max(self) -> int:
        if self.proposer is None:
            return 0
        return self.policy.k_max if self.policy is not None else self.k

    @property
    def batch_planned(self) -> bool:
        """The engine picks this request's k each step (policy auto), from the whole batch's costs."""
        return self.proposer is not None and not self.shadow and self.policy is not None and self.policy.batch_planned

    def check(self, target: CausalLM) -> None:
        """Refuse, up front, what this target cannot run."""
        if self.proposer is not None and self.proposer.caps.needs_native and target.backend != "native":
            raise ConfigError(f"method '{self.proposer.name}' needs the native backend")
        if self.tree is None:
            return
        if self.proposer is None or not self.proposer.caps.trees:
            raise ConfigError(f"method '{self.method}' cannot draft trees; use a chain (--no-tree)")
        if not target.caps.trees:
            raise ConfigError(
                f"the {target.backend} backend cannot verify trees "
                "(needs attention masks and cache compaction; the native backend can)"
            )


@dataclass(frozen=True)
class StreamEvent:
    """Tokens committed by one round and the text they completed; with ``logprobs`` asked for,
    each token's target log-probability and its top alternatives ((token, logprob) pairs)."""

    token_ids: list[int]
    text: str
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    finish_reason: str  # "eos", "stop", "length" or "cancelled"


@dataclass
class SourceState:
    """What a request measures of one of its proposer's sources (:class:`Source`): its own k
    policy (a copy of the request's), and its drafting rounds, tokens and seconds."""

    policy: KPolicy
    rounds: int = 0  # rounds that drafted
    drafted: int = 0  # tokens drafted
    draft_s: float = 0.0
    off_steps: int = 0  # consecutive planned steps at k = 0 (to probe acceptance again)


@dataclass
class Row:
    """One request's rows of a step's forward."""

    request: "Request"
    ids: torch.Tensor  # [n] int64
    positions: torch.Tensor | None = None  # [n] (trees); None: the next n positions
    mask: torch.Tensor | None = None  # [n, cache.length + n] bool (trees); None: causal
    keep: int = 0  # logits of the last ``keep`` rows are needed (0: a prefill chunk)


WAITING, PREFILL, RUNNING, DONE = "waiting", "prefill", "running", "done"


class Request:
    """A request from submission to result; owned by the engine that runs it."""

    def __init__(
        self,
        rid: int,
        prompt_ids: list[int],
        config: GenerationConfig,
        spec: Speculation,
        target: CausalLM,
        eos_token_ids: frozenset[int],
        tokenizer: Any,
    ) -> None:
        if not prompt_ids:
            raise InputError("empty prompt: give at least one token")
        limit = target.max_length
        if len(prompt_ids) + config.max_new_tokens > limit:
            raise InputError(
                f"request too long: {len(prompt_ids)} prompt tokens + {config.max_new_tokens} new tokens "
                f"exceeds the model's limit of {limit}"
            )
        self.id, self.prompt_ids, self.config, self.spec = rid, list(prompt_ids), config, spec
        self.target = target
        self.status = WAITING
        self.cancelled = False
        self.arrival = time.perf_counter()
        policy_name = (
            (spec.policy.name if spec.policy is not None else "fixed") if spec.proposer is not None else "none"
        )
        self.metrics = RequestMetrics(
            method=spec.method, k=spec.k_max, prompt_tokens=len(prompt_ids), policy=policy_name
        )
        self.output = OutputTracker(tokenizer, eos_token_ids, config)
        self.events: list[StreamEvent] = []
        self.result: GenerationResult | None = None
        self.fed = 0  # prompt tokens (of prompt[:-1]) in the target cache
        self.cache: KVCache | None = None
        self.k = 0  # drafts wanted this step
        self.read_upto = 0  # context length the proposer had read at its last drafting round
        self.source: Source = SINGLE  # this round's drafter
        self.sources: dict[str, SourceState] = {}  # by source name
        self.draft, self.tree, self.side = Draft.empty(), None, []  # this round's candidates
        self.accepted = 0  # drafts the target accepted in the last round
        self.read_at: int | None = None  # rounds absorbed when the proposer first read the context
        self.drafting_rounds = 0  # rounds since then in which a source that reads drafted

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Cache positions this request may hold at once (its share of the KV budget)."""
        extra = self.spec.k_max + 1
        if self.spec.tree is not None:
            extra = self.spec.tree.max_nodes + 1 + 32  # nodes, root, a side branch
        return len(self.prompt_ids) + self.config.max_new_tokens + extra

    def admit(self, prefix_scope: PrefixScope | None = None) -> None:
        """Allocate the cache and per-request state; the request starts prefilling. The proposer
        state gets ``prefix_scope`` (the engine's prefix stores, under this request's salt)."""
        seed = self.config.seed if self.config.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.cache = self.target.new_cache(self.capacity)
        self.context = list(self.prompt_ids)
        spec = self.spec
        self.proposer = (
            None if spec.proposer is None else spec.proposer.start(self.prompt_ids, self.cache, prefix_scope)
        )
        self.shadow = ShadowTracker(self.proposer, spec.k_max, self.config.sampling) if spec.shadow else None
        self.enter(self.next_source())
        self.reads_features = self.proposer is not None and self.proposer.caps.reads_target_features
        self.status = PREFILL if len(self.prompt_ids) > 1 else RUNNING
        self.admitted = time.perf_counter()
        self.metrics.queue_s = self.admitted - self.arrival

    def free(self) -> None:
        """Drop the cache and proposer state (the KV budget is released by the engine)."""
        self.cache = None
        self.proposer = None
        self.shadow = None

    # -- prefill ---------------------------------------------------------------------------------
    def prefill_row(self, budget: int) -> Row | None:
        """Up to ``budget`` more prompt tokens (the last one is fed with the first round's drafts)."""
        todo = len(self.prompt_ids) - 1 - self.fed
        n = min(todo, budget - self.fed % budget)  # chunks end at fixed offsets, reused prefix or not
        if n <= 0:
            return None
        ids = torch.tensor(self.prompt_ids[self.fed : self.fed + n], dtype=torch.long)
        self.fed += n
        return Row(self, ids, keep=0)

    def reuse(self, n: int) -> None:
        """The cache was given the first ``n`` prompt positions (a stored prefix): prefill the rest."""
        self.fed = self.metrics.cached_tokens = n
        if self.fed == len(self.prompt_ids) - 1:
            self.status = RUNNING

    def prefilled(self, seconds: float) -> None:
        self.metrics.prefill_s += seconds
        if self.fed == len(self.prompt_ids) - 1:
            self.status = RUNNING

    # -- one round: source, plan, propose, row, absorb --------------------------------------------
    def next_source(self) -> Source:
        """The drafter of the coming round, as the proposer names it; SINGLE where rounds are
        not planned by source (no proposer, shadow mode, trees)."""
        if self.proposer is None or self.shadow is not None or self.spec.tree is not None:
            return SINGLE
        return self.proposer.source(self.context, self.clip(self.spec.k_max))

    def fallback(self) -> Source | None:
        """The proposer's second drafter for this round, for when the planner drafts nothing
        from the one it named (None: it has none, or rounds are not planned by source); the
        caller enters it."""
        if self.proposer is None or self.shadow is not None or self.spec.tree is not None:
            return None
        return self.proposer.fallback(self.context)

    def enter(self, source: Source) -> bool:
        """This round drafts from ``source``: its policy and tallies become current. True when
        the request had not met the source before (its policy is fresh, at its prior)."""
        self.source = source
        if source.name in self.sources:
            return False
        spec = self.spec
        policy = copy.deepcopy(spec.policy) if spec.policy is not None else FixedK(spec.k)
        policy.reset()
        self.sources[source.name] = SourceState(policy)
        return True

    @property
    def current(self) -> SourceState:
        """What the request measured of this round's source (entered by ``enter``)."""
        return self.sources[self.source.name]

    @property
    def policy(self) -> KPolicy:
        """The k policy of this round's source."""
        return self.current.policy

    @functools.cached_property
    def regime(self) -> str:
        """ "greedy", or the sampling temperature ("T=0.7"): acceptance depends on it (a greedy
        draft must equal the argmax, a sampled one is kept with probability min(1, p/q)), so
        what requests measured is kept apart per regime."""
        sampling = self.config.sampling
        return "greedy" if sampling.greedy else f"T={sampling.temperature:g}"

    def speed_key(self, name: str | None = None) -> tuple[int, str]:
        """What an engine's memory files a source's draft speed under (default: this round's
        source): (proposer prototype, source name)."""
        return id(self.spec.proposer), self.source.name if name is None else name

    def history_key(self, name: str | None = None) -> tuple[int, str, str]:
        """What an engine's memory files a source's acceptance under: its speed key and the regime."""
        return (*self.speed_key(name), self.regime)

    def policy_k(self, batch: int = 1) -> int:
        """This round's draft count by the request's own policy (told the step's ``batch``
        size), never past the token budget."""
        if self.proposer is None or self.spec.shadow:
            return 0
        return self.clip(self.policy.next_k(batch))

    def clip(self, k: int) -> int:
        return max(0, min(k, self.config.max_new_tokens - self.output.count - 1))

    @property
    def _reads_context(self) -> bool:
        """The proposer reads the committed context before this round's source drafts."""
        p = self.proposer
        return p is not None and p.caps.catches_up and self.source.catches_up

    def unread(self) -> int:
        """Committed tokens the proposer has not read (a draft model's prompt, rounds at k = 0)
        and would read in ``catch_up`` before drafting; 0 for proposers that read nothing."""
        if not self._reads_context:
            return 0
        n = len(self.context) - self.read_upto
        if n <= ROUND_FEED:  # a drafting round's own leftovers go with the round
            return 0
        return self.proposer.reads(self.context, self.read_upto)  # less a window's cut, a draft's own

    @property
    def rounds(self) -> int:
        """Decoding rounds absorbed (one target call each)."""
        return self.metrics.target_calls

    @property
    def rounds_since_read(self) -> int | None:
        """Rounds absorbed since the proposer first read the context; None before it has."""
        return None if self.read_at is None else self.rounds - self.read_at

    def drafting_share(self, prior: float, weight: float = 8.0) -> float:
        """The share of this request's rounds in which a source that reads the context drafts
        (a draft model's rounds at k > 0; not a hybrid's lookup rounds, nor rounds the planner
        keeps at k = 0): ``prior`` until the proposer has read, then ``prior`` counted as
        ``weight`` rounds beside the rounds since its first read (before that it cannot draft)."""
        since = self.rounds_since_read
        return prior if since is None else (self.drafting_rounds + prior * weight) / (since + weight)

    def catch_up(self) -> tuple[int, float]:
        """Before a round that drafts (or shadow-drafts): the proposer reads the context it has
        not seen (a draft model's prompt), timed as prefill since it is prompt work, not drafting.
        Returns (tokens it read, seconds) for the engine's price of such reads: what the proposer
        says it read (a draft that fed its own accepted drafts, or took a stored prefix, reads
        fewer than were committed since its last read), else what it had not read."""
        if not self._reads_context or (self.k == 0 and self.shadow is None):
            return 0, 0.0
        t = time.perf_counter()
        read = self.proposer.catch_up(self.context)
        seconds = time.perf_counter() - t
        n = self.unread() if read is None else read
        self.metrics.prefill_s += seconds
        self.read_upto = len(self.context)
        self.read_at = self.rounds if self.read_at is None else self.read_at
        return n, seconds

    @property
    def drafts_first(self) -> bool:
        """The proposer's drafts are free and scored (``caps.scored_drafts``, or this round's
        source is: a hybrid's suffix lookup) and this round is a plain chain: draft k_max first,
        then let the planner choose how many to verify."""
        p = self.proposer
        scored = p is not None and (p.caps.scored_drafts or self.source.scored)
        return scored and self.spec.tree is None and self.shadow is None

    def draft_scores(self) -> list[float] | None:
        """This round's draft scores, where choosing k from them keeps sampling exact: a
        deterministic chain's (one-hot q). Scores on sampled drafts depend on the tokens drawn,
        and a k chosen from them would bias what is verified."""
        d = self.draft
        if d.scores is None or d.probs is not None or self.tree is not None:
            return None
        return d.scores[0].tolist()

    def propose(self) -> None:
        """Draft this round's candidates (``self.k`` of them at most); timed into ``draft_s``."""
        t = time.perf_counter()
        self.draft, self.tree, self.side = Draft.empty(), None, []
        if self.shadow is not None:
            self.shadow.before_round(self.context, self.generator)
        if self.k > 0 and self.spec.tree is not None:
            p = self.proposer
            self.tree = Tree.from_paths(p.propose_tree(self.context, self.k, self.spec.tree.max_nodes))
            self.side = p.side_branch(self.context) if p.caps.side_branch else []
        elif self.k > 0:
            self.set_draft(self.proposer.propose(self.context, self.k, self.config.sampling, self.generator))
        self.drafted(time.perf_counter() - t)

    def drafted(self, seconds: float) -> None:
        """This round's drafting took ``seconds`` (its share, when drafted in a batch)."""
        self.draft_share = seconds
        self.metrics.draft_s += seconds

    def set_draft(self, draft: Draft) -> None:
        """A chain drafted for this round (by ``propose`` or a batched drafting call)."""
        self.tree, self.side = None, []
        self.draft = draft.prefix(self.k)  # a proposer may return fewer than k, never more

    def row(self) -> Row:
        """[last committed token, drafts] (a chain), or [root, tree nodes, side chain] with its mask."""
        self.base = self.cache.length
        last = self.context[-1]
        if self.tree is None:
            ids = torch.cat([torch.tensor([last], dtype=torch.long), self.draft.tokens[0]])
            return Row(self, ids, keep=ids.numel())
        tree, s, base = self.tree, len(self.side), self.base
        n = tree.size + 1
        mask = torch.zeros(n + s, base + n + s, dtype=torch.bool)
        mask[:, :base] = True
        mask[:n, base : base + n] = tree.attention_mask()
        mask[n:, base] = True  # the side chain follows the root causally, ignoring the tree
        mask[n:, base + n :] = torch.ones(s, s, dtype=torch.bool).tril()
        positions = torch.cat([tree.depths(), torch.arange(1, s + 1)]) + base
        ids = torch.tensor([last, *tree.tokens.tolist(), *self.side], dtype=torch.long)
        return Row(self, ids, positions, mask, keep=n + s)

    def observe_forward(self, row: Row, hidden: torch.Tensor) -> None:
        """A feature-reading proposer sees every target forward over this request's cache."""
        start = self.cache.length - row.ids.numel()
        pos = torch.arange(start, start + row.ids.numel()) if row.positions is None else row.positions
        self.proposer.observe_forward(row.ids, pos, row.mask, hidden)

    def absorb(self, logits: torch.Tensor, verify_s: float) -> StreamEvent:
        """The row's logits [n, vocab]: accept, trim the rejected suffix, emit."""
        t = time.perf_counter()
        if self.tree is None:
            committed, drafted, accepted = self._accept_chain(logits)
        else:
            committed, drafted, accepted = self._accept_tree(logits)
        m = self.metrics
        m.verify_s += verify_s + time.perf_counter() - t
        m.record_round(drafted, accepted, len(committed))
        self.accepted = accepted
        if self.read_at is not None:
            self.drafting_rounds += drafted > 0 and self._reads_context
        if self.proposer is not None and not self.spec.shadow:
            m.k_history.append(drafted)
            self.policy.update(drafted, accepted, self.draft_share, verify_s, planned=self.k)
            state = self.current
            state.rounds, state.drafted = state.rounds + (drafted > 0), state.drafted + drafted
            state.draft_s += self.draft_share
        self.context.extend(committed)
        event = self.output.add(committed)
        if self.config.logprobs is not None and event.token_ids:
            # committed token i's law: row i of a chain, the i-th node of the accepted tree path
            rows = logits if self.tree is None else logits[self.path[: len(committed)]]
            event = replace(event, logprobs=token_logprobs(rows, event.token_ids, self.config.logprobs))
        if m.ttft_s == 0.0:
            m.ttft_s = time.perf_counter() - self.arrival
        return event

    def _accept_chain(self, logits: torch.Tensor) -> tuple[list[int], int, int]:
        draft, sampling = self.draft, self.config.sampling
        logits = logits.unsqueeze(0)  # [1, k+1, vocab]
        probs = None
        if sampling.greedy:
            verdict: Verification = verify_greedy(draft, logits)
        else:
            probs = logits_to_probs(logits, sampling)
            verdict = verify_sampling(draft, probs, self.generator)
        if self.shadow is not None:  # plain round: position 0 holds the emitted token's law
            self.shadow.after_round(None if probs is None else probs[0, 0], int(verdict.next_token[0]))
        accepted = int(verdict.num_accepted[0])
        self.cache.trim(self.base + 1 + accepted)  # keep the fed last token and the accepted drafts
        if self.proposer is not None and self.shadow is None:
            self.proposer.observe(accepted)
        return verdict.committed(draft), draft.k, accepted

    def _accept_tree(self, logits: torch.Tensor) -> tuple[list[int], int, int]:
        """Verify all branches; the accepted path's keys/values move into place (cache compaction).

        A proposer with a side branch (lookahead's Jacobi window) gets that branch's outputs;
        side nodes are never accepted and vanish with the compaction.
        """
        tree, n = self.tree, self.tree.size + 1
        if self.side:
            self.proposer.observe_side(logits[n - 1 :])  # root's output, then each side node's
        sampling = self.config.sampling
        if sampling.greedy:
            verdict = verify_tree_greedy(tree, logits[:n])
        else:
            verdict = verify_tree_sampling(tree, logits_to_probs(logits[:n], sampling), self.generator)
        self.cache.compact(self.base, verdict.path)
        self.path = verdict.path
        self.metrics.tree_nodes += tree.size
        accepted = len(verdict.path) - 1
        self.proposer.observe(accepted)
        depth = int(tree.depths().max()) if tree.size else 0
        return verdict.committed(tree), depth, accepted

    # -- the end ---------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.output.finished or self.cancelled

    def finish(self) -> GenerationResult:
        """Close the request: its result (stats included), its proposer told the final context."""
        m = self.metrics
        m.total_s = time.perf_counter() - self.arrival
        m.new_tokens = self.output.count
        stats = m.to_dict()
        if self.proposer is not None:
            self.proposer.finish(self.context)
            stats.update(self.proposer.stats())
        named = {name: state for name, state in self.sources.items() if name}
        if named:  # a composite proposer: what each source drafted
            stats["sources"] = {
                name: {"rounds": st.rounds, "drafted": st.drafted, "draft_s": st.draft_s} for name, st in named.items()
            }
        if self.shadow is not None:
            stats.update(self.shadow.stats())
        reason = "cancelled" if self.cancelled and not self.output.finished else self.output.finish_reason
        self.result = GenerationResult(self.output.text, self.output.token_ids, stats, reason)
        self.status = DONE
        return self.result
