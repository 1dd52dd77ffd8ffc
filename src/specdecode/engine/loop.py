"""Speculative decoding for one request: the same loop drives every proposer and plain decoding."""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from specdecode.core.sampling import SamplingConfig, logits_to_probs
from specdecode.core.tree import Tree, verify_tree_greedy, verify_tree_sampling
from specdecode.core.verify import Draft, Verification, verify_greedy, verify_sampling
from specdecode.engine.output import OutputTracker
from specdecode.engine.policy import FixedK, KPolicy
from specdecode.engine.shadow import ShadowTracker
from specdecode.errors import ConfigError, InputError
from specdecode.metrics import RequestMetrics
from specdecode.models.base import CausalLM, KVCache
from specdecode.proposers.base import Proposer


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request settings."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class TreeConfig:
    """Tree drafting: at most ``max_nodes`` candidate nodes per round (depth is bounded by k)."""

    max_nodes: int = 16

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ConfigError(f"max_nodes must be >= 1, got {self.max_nodes}")


@dataclass(frozen=True)
class StreamEvent:
    """Tokens committed by one round and the text they completed."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    finish_reason: str  # "eos", "stop" or "length"


class Decoder:
    """Drives a target model with an optional proposer; ``proposer=None`` is plain decoding.

    ``policy`` picks k each round (default: always ``k``). ``shadow=True`` decodes plainly while
    the proposer still drafts, recording the acceptance speculation would have had.
    """

    def __init__(
        self,
        target: CausalLM,
        proposer: Proposer | None = None,
        k: int = 4,
        *,
        policy: KPolicy | None = None,
        shadow: bool = False,
        tree: TreeConfig | None = None,
        eos_token_ids: tuple[int, ...] = (),
        tokenizer: Any = None,
    ) -> None:
        if proposer is not None and (not isinstance(k, int) or k < 1):
            raise ConfigError(f"k must be an integer >= 1, got {k!r}")
        if shadow and proposer is None:
            raise ConfigError("shadow mode needs a proposer (a method other than 'none')")
        if tree is not None:
            _check_tree_support(target, proposer)
        self.target = target
        self.proposer = proposer
        self.policy = policy or FixedK(k)
        self.k = self.policy.k_max if proposer is not None else 0
        self.shadow = shadow
        self.tree = tree
        self.method = proposer.name if proposer is not None else "none"
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer

    def run(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> "DecodeRun":
        return DecodeRun(self, list(prompt_ids), config or GenerationConfig())

    def generate(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> GenerationResult:
        return self.run(prompt_ids, config).result()


def _check_tree_support(target: CausalLM, proposer: Proposer | None) -> None:
    """Refuse tree drafting up front when the proposer or the model cannot do it."""
    if proposer is None or not proposer.caps.trees:
        name = proposer.name if proposer is not None else "none"
        raise ConfigError(f"method '{name}' cannot draft trees; use a chain (--no-tree)")
    if not target.caps.trees:
        raise ConfigError(
            f"the {target.backend} backend cannot verify trees "
            "(needs attention masks and cache compaction; the native backend can)"
        )


class DecodeRun:
    """One request in flight: iterate for :class:`StreamEvent`; ``result()`` finishes it."""

    def __init__(self, decoder: Decoder, prompt_ids: list[int], config: GenerationConfig) -> None:
        if not prompt_ids:
            raise InputError("empty prompt: give at least one token")
        limit = decoder.target.max_length
        if len(prompt_ids) + config.max_new_tokens > limit:
            raise InputError(
                f"request too long: {len(prompt_ids)} prompt tokens + {config.max_new_tokens} new tokens "
                f"exceeds the model's limit of {limit}"
            )
        self.d, self.config, self.prompt_ids = decoder, config, prompt_ids
        self.metrics = RequestMetrics(
            method=decoder.method, k=decoder.k, prompt_tokens=len(prompt_ids),
            policy=decoder.policy.name if decoder.proposer is not None else "none",
        )
        self.output = OutputTracker(decoder.tokenizer, decoder.eos_token_ids, config)
        self._events = self._loop()
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamEvent]:
        return self._events

    def result(self) -> GenerationResult:
        for _ in self._events:
            pass
        assert self._result is not None
        return self._result

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> Iterator[StreamEvent]:
        cfg, m = self.config, self.metrics
        seed = cfg.seed if cfg.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        cache = self._prefill()
        m.prefill_s = time.perf_counter() - start
        context = list(self.prompt_ids)
        while not self.output.finished:
            draft_s, verify_s = m.draft_s, m.verify_s
            k = self._choose_k()
            if self.d.tree is not None and k > 0:
                committed, drafted, accepted = self._tree_round(cache, context, k)
            else:
                committed, drafted, accepted = self._chain_round(cache, context, k)
            m.record_round(drafted, accepted, len(committed))
            if self.d.proposer is not None and not self.d.shadow:
                m.k_history.append(drafted)
                self.policy.update(drafted, accepted, m.draft_s - draft_s, m.verify_s - verify_s)
            context.extend(committed)
            event = self._emit(committed)
            if m.ttft_s == 0.0:
                m.ttft_s = time.perf_counter() - start
            if event.token_ids or event.text:
                yield event
        m.total_s = time.perf_counter() - start
        m.new_tokens = self.output.count
        stats = m.to_dict()
        if self.proposer is not None:
            self.proposer.finish(context)
            stats.update(self.proposer.stats())
        if self.shadow is not None:
            stats.update(self.shadow.stats())
        self._result = GenerationResult(
            text=self.output.text,
            token_ids=self.output.token_ids,
            stats=stats,
            finish_reason=self.output.finish_reason,
        )

    def _choose_k(self) -> int:
        """This round's draft count: the policy's choice, never past the token budget."""
        if self.d.proposer is None or self.d.shadow:
            return 0
        return max(0, min(self.policy.next_k(), self.config.max_new_tokens - self.output.count - 1))

    def _chain_round(self, cache: KVCache, context: list[int], k: int) -> tuple[list[int], int, int]:
        """Propose a chain, verify it in one forward, accept, trim; (committed, drafted, accepted)."""
        draft = self._propose(context, k)
        logits = self._score(cache, context[-1], draft)
        verdict = self._accept(draft, logits)
        accepted = int(verdict.num_accepted[0])
        self._trim(cache, accepted)
        return verdict.committed(draft), draft.k, accepted

    def _tree_round(self, cache: KVCache, context: list[int], k: int) -> tuple[list[int], int, int]:
        """Propose a tree, verify all branches in one masked forward, compact the accepted path.

        A proposer with a side branch (lookahead's Jacobi window) gets that branch scored in the
        same forward; side nodes are never accepted and vanish when the cache is compacted.
        """
        proposer = self.proposer
        t = time.perf_counter()
        tree = Tree.from_paths(proposer.propose_tree(context, k, self.d.tree.max_nodes))
        side = proposer.side_branch(context) if proposer.caps.side_branch else []
        self.metrics.draft_s += time.perf_counter() - t
        t = time.perf_counter()
        logits = self._score_tree(cache, context[-1], tree, side)
        n = tree.size + 1
        if side:
            proposer.observe_side(logits[n - 1 :])  # root's output, then each side node's
        sampling = self.config.sampling
        if sampling.greedy:
            verdict = verify_tree_greedy(tree, logits[:n])
        else:
            verdict = verify_tree_sampling(tree, logits_to_probs(logits[:n], sampling), self.generator)
        cache.compact(self._base, verdict.path)  # the accepted path's keys/values move into place
        self.metrics.verify_s += time.perf_counter() - t
        self.metrics.tree_nodes += tree.size
        accepted = len(verdict.path) - 1
        proposer.observe(accepted)
        depth = int(tree.depths().max()) if tree.size else 0
        return verdict.committed(tree), depth, accepted

    def _score_tree(self, cache: KVCache, last_token: int, tree: Tree, side: list[int]) -> torch.Tensor:
        """One forward over [root, tree nodes, side chain] -> logits [N + 1 + len(side), vocab]."""
        base = self._base = cache.length
        n, s = tree.size + 1, len(side)
        mask = torch.zeros(n + s, base + n + s, dtype=torch.bool)
        mask[:, :base] = True
        mask[:n, base : base + n] = tree.attention_mask()
        mask[n:, base] = True  # the side chain follows the root causally, ignoring the tree
        mask[n:, base + n :] = torch.ones(s, s, dtype=torch.bool).tril()
        positions = torch.cat([tree.depths(), torch.arange(1, s + 1)]) + base
        ids = torch.tensor([[last_token, *tree.tokens.tolist(), *side]])
        return self._forward(ids, cache, positions=positions.unsqueeze(0), attn_mask=mask)[0]

    def _prefill(self) -> KVCache:
        """Cache the prompt except its last token, which the first round feeds with its drafts."""
        cache = self.d.target.new_cache(len(self.prompt_ids) + self.config.max_new_tokens + self.d.k + 1)
        self.policy = copy.deepcopy(self.d.policy)  # per-request estimates
        self.policy.reset()
        self.shadow = None
        self.proposer = None
        if self.d.proposer is not None:
            self.proposer = self.d.proposer.start(self.prompt_ids, cache)  # its own state, this request's
            if self.d.shadow:
                self.shadow = ShadowTracker(self.proposer, self.d.k, self.config.sampling)
        if len(self.prompt_ids) > 1:
            self._forward(torch.tensor([self.prompt_ids[:-1]], dtype=torch.long), cache, last_only=True)
        return cache

    def _forward(self, ids: torch.Tensor, cache: KVCache, positions=None, attn_mask=None, last_only=False) -> torch.Tensor:
        """A target forward over this request's cache; a feature-reading proposer sees its features."""
        if self.proposer is None or not self.proposer.caps.reads_target_features:
            return self.d.target.forward(ids, cache, positions=positions, attn_mask=attn_mask, last_only=last_only)
        base = cache.length
        logits, hidden = self.d.target.forward(
            ids, cache, positions=positions, attn_mask=attn_mask, last_only=last_only, return_hidden=True
        )
        n = ids.shape[1]
        pos = torch.arange(base, base + n) if positions is None else positions.reshape(n)
        self.proposer.observe_forward(ids[0], pos, attn_mask, hidden)
        return logits

    def _propose(self, context: list[int], k: int) -> Draft:
        if self.shadow is not None:
            t = time.perf_counter()
            self.shadow.before_round(context, self.generator)
            self.metrics.draft_s += time.perf_counter() - t
        if self.proposer is None or k < 1:
            return Draft.empty()
        t = time.perf_counter()
        draft = self.proposer.propose(context, k, self.config.sampling, self.generator)
        if draft.k > k:  # a proposer may return fewer than k, never more
            draft = Draft(draft.tokens[:, :k], None if draft.probs is None else draft.probs[:, :k])
        self.metrics.draft_s += time.perf_counter() - t
        return draft

    def _score(self, cache: KVCache, last_token: int, draft: Draft) -> torch.Tensor:
        """One target forward over [last committed token, drafts] -> logits [1, k+1, vocab]."""
        t = time.perf_counter()
        ids = torch.cat([torch.tensor([[last_token]], dtype=torch.long), draft.tokens], dim=1)
        self._base = cache.length
        logits = self._forward(ids, cache)
        self.metrics.verify_s += time.perf_counter() - t
        return logits

    def _accept(self, draft: Draft, logits: torch.Tensor) -> Verification:
        t = time.perf_counter()
        sampling = self.config.sampling
        if sampling.greedy:
            verdict = verify_greedy(draft, logits)
            probs = None
        else:
            probs = logits_to_probs(logits, sampling)
            verdict = verify_sampling(draft, probs, self.generator)
        self.metrics.verify_s += time.perf_counter() - t
        if self.shadow is not None:  # plain round: position 0 holds the emitted token's law
            self.shadow.after_round(None if probs is None else probs[0, 0], int(verdict.next_token[0]))
        return verdict

    def _trim(self, cache: KVCache, num_accepted: int) -> None:
        """Keep the fed last token and the accepted drafts; drop the rejected suffix."""
        cache.trim(self._base + 1 + num_accepted)
        if self.proposer is not None and self.shadow is None:
            self.proposer.observe(num_accepted)

    def _emit(self, committed: list[int]) -> StreamEvent:
        return self.output.add(committed)
