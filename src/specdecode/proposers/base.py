"""The one interface every proposer implements; the decode loop never knows which it drives."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.core.verify import Draft


@runtime_checkable
class Proposer(Protocol):
    name: str

    def reset(self, prompt_ids: list[int]) -> None:
        """Start a new request whose prompt is ``prompt_ids``."""
        ...

    def propose(
        self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """Up to ``k`` candidates continuing ``context`` (every committed token so far).

        Stochastic proposers return their processed distributions q ([1, k, vocab], the same
        ``sampling`` as the target); deterministic ones return ``probs=None`` (one-hot q).
        """
        ...

    def observe(self, num_accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted."""
        ...
