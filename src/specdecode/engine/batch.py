"""Continuous batching of plain decoding over the native backend's multi-row forward.

Every step is one forward over all active sequences: prompts that just joined contribute their
whole prefill, running ones their last token, each over its own cache of its own length. A
sequence leaves at EOS or its token limit and a waiting prompt takes its slot in the next step,
so the batch stays full. Each sequence's tokens are exactly what decoding it alone gives
(``NativeCausalLM.forward_rows`` computes each row as a lone forward would).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.errors import ConfigError, InputError


@dataclass
class _Slot:
    index: int  # position of the prompt in the caller's list
    cache: object
    pending: list[int]  # tokens to feed in the next step (the prompt, then the last token)
    out: list[int] = field(default_factory=list)


def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
    sampling: SamplingConfig | None = None,
    max_batch: int = 32,
    generator: torch.Generator | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """New tokens for every prompt (EOS included when produced), in the prompts' order.

    Greedy unless ``sampling`` has a temperature. ``max_batch`` bounds the sequences in one
    forward; ``on_step(n_finished)`` is called after each step (progress bars).
    """
    if not hasattr(model, "forward_rows"):
        raise ConfigError("batched decoding needs the native backend (a model with forward_rows)")
    if max_new_tokens < 1 or max_batch < 1:
        raise ConfigError(f"max_new_tokens and max_batch must be >= 1, got {max_new_tokens} and {max_batch}")
    if any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token")
    sampling = sampling or SamplingConfig()
    eos = set(eos_token_ids)
    waiting = deque(range(len(prompts)))
    active: list[_Slot] = []
    results: list[list[int]] = [[] for _ in prompts]
    finished = 0
    while waiting or active:
        while waiting and len(active) < max_batch:
            i = waiting.popleft()
            active.append(_Slot(i, model.new_cache(len(prompts[i]) + max_new_tokens), list(prompts[i])))
        rows = [torch.tensor(s.pending) for s in active]
        logits = model.forward_rows(rows, [s.cache for s in active], last_only=True)
        tokens = _next_tokens(torch.cat([lg[0] for lg in logits]), sampling, generator)
        still = []
        for slot, token in zip(active, tokens):
            slot.out.append(token)
            slot.pending = [token]
            if token in eos or len(slot.out) >= max_new_tokens:
                results[slot.index] = slot.out
                finished += 1
            else:
                still.append(slot)
        active = still
        if on_step is not None:
            on_step(finished)
    return results


def _next_tokens(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> list[int]:
    """One token per row of ``logits`` [rows, vocab]."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    return sample(logits_to_probs(logits, sampling), generator).tolist()
