"""One request at a time: a batch of one on the engine (the same loop serves every batch size)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from specdecode.engine.planner import PlannerMemory
from specdecode.engine.policy import KPolicy
from specdecode.engine.request import (
    GenerationConfig,
    GenerationResult,
    Request,
    Speculation,
    StreamEvent,
    TreeConfig,
)
from specdecode.engine.scheduler import Engine, EngineConfig
from specdecode.models.base import CausalLM
from specdecode.models.prefix_cache import PrefixCache
from specdecode.proposers.base import Proposer


class Decoder:
    """Drives a target model with an optional proposer; ``proposer=None`` is plain decoding.

    ``policy`` picks k each round (default: always ``k``). ``shadow=True`` decodes plainly while
    the proposer still drafts, recording the acceptance speculation would have had. Each run is
    a request of its own engine; the proposer and policy are prototypes that every run copies.
    Every run's engine shares this decoder's :class:`PlannerMemory` (forward costs, read rates,
    score calibrations), so one request after another plans from measurements, not priors, and
    its :class:`PrefixCache` (``prefix_cache_mb`` large, 0: none), so a prompt that starts like an
    earlier run's sequence (a system prompt, a conversation's history) skips that prefill.
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
        prefix_cache_mb: int = EngineConfig.prefix_cache_mb,
    ) -> None:
        self.spec = Speculation(proposer, policy.k_max if policy is not None else k, policy, shadow, tree)
        self.spec.check(target)
        self.target = target
        self.proposer = proposer
        self.k = self.spec.k_max
        self.method = self.spec.method
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.memory = PlannerMemory()
        self.prefixes = PrefixCache.for_target(target, prefix_cache_mb)

    def engine(self, config: EngineConfig | None = None) -> Engine:
        """An engine over this decoder's target (submit many requests with ``self.spec``)."""
        return Engine(
            self.target,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self.tokenizer,
            config=config,
            memory=self.memory,
            prefixes=self.prefixes,
        )

    def run(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> "DecodeRun":
        return DecodeRun(self.engine(), list(prompt_ids), config or GenerationConfig(), self.spec)

    def generate(self, prompt_ids: list[int], config: GenerationConfig | None = None) -> GenerationResult:
        return self.run(prompt_ids, config).result()


class DecodeRun:
    """One request in flight: iterate for :class:`StreamEvent`; ``result()`` finishes it."""

    def __init__(self, engine: Engine, prompt_ids: list[int], config: GenerationConfig, spec: Speculation) -> None:
        self.engine = engine
        self.request: Request = engine.submit(prompt_ids, config, spec)
        self._events = self._loop()

    def __iter__(self) -> Iterator[StreamEvent]:
        return self._events

    def _loop(self) -> Iterator[StreamEvent]:
        r = self.request
        while self.engine.busy:
            self.engine.step()
            events, r.events = r.events, []
            yield from events

    def result(self) -> GenerationResult:
        for _ in self._events:
            pass
        assert self.request.result is not None
        return self.request.result


__all__ = ["Decoder", "DecodeRun", "GenerationConfig", "GenerationResult", "StreamEvent", "TreeConfig"]
