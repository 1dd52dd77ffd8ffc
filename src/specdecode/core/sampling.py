"""Logit processing shared by target and draft, so p and q see the same transformations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.errors import ConfigError

GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    """Temperatures below GREEDY_BELOW are greedy: dividing logits by them overflows float32,
    and the law they describe is the argmax's to within float precision (vLLM does the same)."""
    return temperature < GREEDY_BELOW


def check_top_p(value: float, name: str = "top_p") -> float:
    """``value`` if it is a nucleus mass in (0, 1] (1: off), else a ConfigError naming ``name``
    (the field, or the command-line flag that set it)."""
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{name} must be in (0, 1], got {value}")
    return value


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings, named as in transformers' ``generate``; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    min_p: float = 0.0  # 0.0 disables min-p filtering

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        check_top_p(self.top_p)
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        """Whether this samples the argmax (:func:`is_greedy`)."""
        return is_greedy(self.temperature)


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (removed entries become -inf).

    ``logits``: [..., vocab]. Returns float32 logits of the same shape.
    """
    x = logits.float() / cfg.temperature
    vocab = x.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        x = top_p_filter(x, cfg.top_p)
    if cfg.min_p > 0.0:
        p = torch.softmax(x, dim=-1)
        x = x.masked_fill(p < cfg.min_p * p.amax(dim=-1, keepdim=True), float("-inf"))
    return x


NUCLEUS_CANDIDATES = (256, 4096)  # tokens sorted for top-p, in turn; a row wider still sorts all


def top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """``x`` [..., vocab] with every token outside the nucleus set to -inf: in order of
    decreasing probability (float32 softmax), a token is dropped when the probability strictly
    before it (summed in float64, compared in float32) already reaches ``top_p``; the top token
    always stays.

    Sorting all 151,936 probabilities of the Qwen2 vocabulary took ~12 ms a row on 2 cores, more
    than the 0.5B draft's whole step, and a 9-row verify ~60 ms. The nucleus almost always lies
    among the top few hundred tokens, so only the top :data:`NUCLEUS_CANDIDATES` are sorted
    (``torch.topk``); a row whose candidates hold less than ``top_p`` tries the next, larger
    count, and at last sorts in full (:func:`top_p_filter_sorted`, the reference).
    """
    vocab = x.shape[-1]
    rows = x.reshape(-1, vocab)  # [rows, vocab]
    probs = torch.softmax(rows, dim=-1)  # [rows, vocab]
    out, wide = _nucleus_within(rows, probs, NUCLEUS_CANDIDATES[0], top_p)  # every row, no gathered copy
    for n in NUCLEUS_CANDIDATES[1:] + (vocab,):
        todo = wide.nonzero().squeeze(-1)  # rows whose nucleus may reach past the last candidates
        if not todo.numel():
            break
        out[todo], still = _nucleus_within(rows[todo], probs[todo], n, top_p)
        wide = torch.zeros_like(wide).index_fill_(0, todo[still], True)
    return out.view(x.shape)


def _nucleus_within(rows: torch.Tensor, probs: torch.Tensor, n: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_p_filter` over each row's top ``n`` tokens ([rows, vocab] each), and which rows
    those hold less than ``top_p`` of (their nucleus may be wider; never with ``n`` = vocab)."""
    if n >= rows.shape[-1]:
        return top_p_filter_sorted(rows, top_p), torch.zeros(rows.shape[0], dtype=torch.bool)
    top, order = torch.topk(probs, n, dim=-1)  # [rows, n], descending
    p = top.double()
    held = torch.cumsum(p, dim=-1)
    return _keep_only(rows, order, _reached(held - p, top_p)), held[:, -1] < top_p


def top_p_filter_sorted(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`top_p_filter` by sorting every probability (the plain reference); ``x`` [rows, vocab]."""
    sorted_p, order = torch.sort(torch.softmax(x, dim=-1), dim=-1, descending=True)
    p = sorted_p.double()
    return _keep_only(x, order, _reached(torch.cumsum(p, dim=-1) - p, top_p))


def _reached(before: torch.Tensor, top_p: float) -> torch.Tensor:
    """Where the mass before a token (float64) reaches ``top_p``, compared in float32 as the
    probabilities are: a prefix whose mass is top_p exactly (0.5 + 0.2 for 0.7) counts as reached."""
    return before.float() >= top_p


def _keep_only(x: torch.Tensor, order: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """-inf but at the tokens ``order`` [rows, n] not ``drop``-ped, which keep their ``x``
    [rows, vocab]; the first of ``order`` always stays (even when top_p underflows: 1e-300
    reads as 0 next to float probabilities)."""
    drop[:, 0] = False
    kept = x.gather(-1, order).masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, kept)


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Next-token distributions after processing; greedy gives the one-hot argmax.

    ``logits``: [..., vocab] -> float32 probabilities [..., vocab].
    """
    if cfg.greedy:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32).scatter_(-1, top, 1.0)
    return torch.softmax(filter_logits(logits, cfg), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` [batch, vocab] -> [batch] int64: token i with probability
    probs[i] / sum(probs). Rows must be non-negative with positive mass (need not sum to 1).

    Inverse CDF: the first token whose running mass (float64) exceeds u * mass, u ~ U[0, 1), so a
    token without mass is never drawn. ``torch.multinomial`` took ~4 ms a draw over the Qwen2
    vocabulary (151,936 tokens) on 2 cores, a tenth of the 1.5B's decoding step and a third of
    its 0.5B draft's; this takes ~0.2 ms (BENCHMARKS.md, session 46).
    """
    cdf = probs.double().cumsum(-1)  # [batch, vocab], non-decreasing
    mass = cdf[:, -1:].contiguous()  # [batch, 1]
    if not bool(((mass > 0) & mass.isfinite()).all()):  # NaN compares False
        raise ValueError("sample: every row needs positive, finite probability mass")
    u = torch.rand(mass.shape, generator=generator, dtype=torch.float64) * mass  # [batch, 1] in [0, mass)
    drawn = torch.searchsorted(cdf, u, right=True)  # cdf[i - 1] <= u < cdf[i]: token i has mass
    # u * mass can round up to mass (probability ~2^-53): keep to the last token with mass.
    last = torch.searchsorted(cdf, mass)
    return torch.minimum(drawn, last).squeeze(-1)


def to_vocab(probs: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Distributions over a reduced vocabulary [..., len(vocab_ids)] as full-vocabulary ones
    [..., vocab_size]: column j goes to token ``vocab_ids[j]``, every other token gets 0."""
    full = torch.zeros(*probs.shape[:-1], vocab_size)
    full[..., vocab_ids] = probs
    return full


def confident_prefix(logits: torch.Tensor, threshold: float) -> int:
    """How many leading rows of draft logits [n, vocab] have a top probability (temperature 1,
    unfiltered) of at least ``threshold``: a drafter stops before the first unsure token.

    The cut depends only on the drafter's own distributions, so verification stays exact.
    """
    if threshold <= 0.0:
        return logits.shape[0]
    x = logits.float()
    sure = ((x.amax(-1) - x.logsumexp(-1)).exp() >= threshold).tolist()  # top probability, no softmax copy
    return sure.index(False) if False in sure else len(sure)


def check_threshold(threshold: float) -> None:
    """Refuse a confidence threshold outside [0, 1) (0 turns confidence stopping off)."""
    if not 0.0 <= threshold < 1.0:
        raise ConfigError(f"confidence_threshold must be in [0, 1), got {threshold}")


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], top_n: int = 0
) -> list[tuple[float, list[tuple[int, float]]]]:
    """The target's own log-probabilities (raw logits, before any sampling filter) of ``tokens``,
    row i for token i (``logits`` [n >= len(tokens), vocab]), each with the ``top_n`` most likely
    alternatives at its position as (token, logprob) pairs."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [t, vocab]
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    if top_n <= 0:
        return [(lp, []) for lp in chosen]
    values, ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)  # [t, top_n]
    return [(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]
