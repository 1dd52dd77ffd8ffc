"""When speculation pays: predicted tokens per second for each speculation length k.

A round with k drafts costs k draft steps plus one target forward over k + 1 tokens, and commits
1 + sum_i P(first i+1 drafts accepted) tokens. k = 0 is plain decoding (one token per forward).
Leviathan et al.'s (1 - a^(k+1)) / (1 - a) is the special case of i.i.d. acceptance a.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

VerifyCost = Callable[[int], float] | Mapping[int, float]


def extend_acceptance(accept_by_position: Sequence[float], k: int) -> list[float]:
    """Cumulative acceptance for positions 0..k-1, extrapolated geometrically past the data.

    ``accept_by_position[i]`` is P(drafts 0..i all accepted), non-increasing in i.
    """
    cum = [min(max(float(a), 0.0), 1.0) for a in accept_by_position[:k]]
    if not cum:
        return [0.0] * k
    # Conditional rate of the last measured step carries the curve on.
    rate = cum[-1] / cum[-2] if len(cum) > 1 and cum[-2] > 0 else cum[-1]
    while len(cum) < k:
        cum.append(cum[-1] * min(rate, 1.0))
    for i in range(1, len(cum)):  # a later draft cannot be accepted more often than an earlier one
        cum[i] = min(cum[i], cum[i - 1])
    return cum


def expected_tokens_per_round(k: int, accept_by_position: Sequence[float]) -> float:
    """Committed tokens per target call with k drafts, bonus/replacement token included."""
    return 1.0 + sum(extend_acceptance(accept_by_position, k)) if k > 0 else 1.0


def iid_expected_tokens(k: int, a: float) -> float:
    """Leviathan et al. eq. 1: (1 - a^(k+1)) / (1 - a) for i.i.d. acceptance a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def _cost(verify_s: VerifyCost, n_tokens: int) -> float:
    if callable(verify_s):
        return float(verify_s(n_tokens))
    if n_tokens in verify_s:
        return float(verify_s[n_tokens])
    known = sorted(verify_s)  # interpolate linearly between measured forward sizes
    lo = max((n for n in known if n <= n_tokens), default=known[0])
    hi = min((n for n in known if n >= n_tokens), default=known[-1])
    if lo == hi:
        return float(verify_s[lo]) * (n_tokens / lo if n_tokens > hi else 1.0)
    w = (n_tokens - lo) / (hi - lo)
    return float(verify_s[lo]) * (1 - w) + float(verify_s[hi]) * w


def predict_tokens_per_s(
    k: int,
    accept_by_position: Sequence[float],
    draft_s_per_token: float,
    verify_s: VerifyCost,
    overhead_s: float = 0.0,
) -> float:
    """Predicted decode throughput with k drafts per round (k = 0: plain decoding).

    ``verify_s(n)``: seconds for one target forward over n new tokens (a callable or a table).
    """
    if k == 0:
        return 1.0 / (_cost(verify_s, 1) + overhead_s)
    round_s = k * draft_s_per_token + _cost(verify_s, k + 1) + overhead_s
    return expected_tokens_per_round(k, accept_by_position) / round_s


def best_k(
    k_max: int,
    accept_by_position: Sequence[float],
    draft_s_per_token: float,
    verify_s: VerifyCost,
    overhead_s: float = 0.0,
) -> int:
    """The k in 0..k_max with the highest predicted tokens per second."""
    rates = [
        predict_tokens_per_s(k, accept_by_position, draft_s_per_token, verify_s, overhead_s) for k in range(k_max + 1)
    ]
    return max(range(k_max + 1), key=rates.__getitem__)


def predicted_speedup(
    k: int, accept_by_position: Sequence[float], draft_s_per_token: float, verify_s: VerifyCost, overhead_s: float = 0.0
) -> float:
    """Predicted tokens/s with k drafts over plain decoding's."""
    plain = predict_tokens_per_s(0, accept_by_position, draft_s_per_token, verify_s, overhead_s)
    return predict_tokens_per_s(k, accept_by_position, draft_s_per_token, verify_s, overhead_s) / plain


def speedup_bound(tokens_per_call: float, k: int, verify_s: VerifyCost, prefill_share: float) -> float:
    """End-to-end speedup of a k-draft method committing ``tokens_per_call`` per target call at no
    draft cost, over plain decoding that spends ``prefill_share`` of its time in prefill (which no
    proposer speeds up): an upper bound for every drafter with that acceptance."""
    per_token = _cost(verify_s, k + 1) / _cost(verify_s, 1) / tokens_per_call
    return 1.0 / (prefill_share + (1.0 - prefill_share) * per_token)


def tokens_per_call_needed(speedup: float, k: int, verify_s: VerifyCost, prefill_share: float) -> float:
    """The tokens per target call a k-draft method needs, drafting for free, to reach ``speedup``
    (the inverse of :func:`speedup_bound`); ``inf`` when even k + 1 (every draft accepted) falls short."""
    rest = 1.0 / speedup - prefill_share
    if rest <= 0:
        return math.inf
    need = (1.0 - prefill_share) * _cost(verify_s, k + 1) / _cost(verify_s, 1) / rest
    return need if need <= k + 1 else math.inf
