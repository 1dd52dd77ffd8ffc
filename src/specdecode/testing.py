"""Conformance testing for proposers: tiny enumerable targets, exact sequence laws, chi-square.

Speculative decoding is exact when the committed tokens follow the target's own law, whatever
the proposer drafts. On a target small enough to enumerate (a second-order Markov chain over a
handful of tokens) the law of every continuation of ``n_new`` tokens is computed exactly and
compared with sampled speculative output by Pearson's chi-square. :func:`certify` runs that
suite on a proposer (chains, and trees when both sides can), plus greedy identity with plain
decoding, and returns a :class:`CertificationReport`.

>>> from specdecode.testing import certify
>>> report = certify(MyProposer())        # a PerRequest subclass declaring caps
>>> report.passed, [(c.name, c.pvalue) for c in report.cases]
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.core.verify import Draft, Verification, draft_probs_or_onehot
from specdecode.engine import Decoder, GenerationConfig, TreeConfig
from specdecode.errors import ConfigError
from specdecode.models.base import CausalLM, ModelCaps, check_trim
from specdecode.proposers.base import Proposer, ProposerCaps

ALPHA = 1e-3  # significance level of every conformance test in this suite
CONFORMANCE_PROMPT = [1, 2, 3, 1, 2, 0, 1]  # repeats, so lookup-style drafts find matches
MAX_SEQUENCES = 20_000  # vocab ** n_new above this is not "enumerable"

# The sampling settings certify() checks (greedy identity is checked besides).
SAMPLINGS = {
    "t=1.0": SamplingConfig(temperature=1.0),
    "t=0.7 top_k=3": SamplingConfig(temperature=0.7, top_k=3),
    "t=1.3 top_p=0.8": SamplingConfig(temperature=1.3, top_p=0.8),
}
GREEDY_PROMPTS = (CONFORMANCE_PROMPT, [0], [4, 3, 2, 1, 0, 4, 3], [2, 2, 2, 2, 1])
GREEDY_TOKENS = 16


# -- tiny enumerable models ----------------------------------------------------------------------


class TokenCache:
    """Cache of a table model: just the tokens, under the shared trim contract."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def trim(self, length: int) -> None:
        check_trim(self, length)
        del self.tokens[length:]

    def compact(self, start: int, keep: list[int]) -> None:
        self.tokens[start:] = [self.tokens[start + i] for i in keep]


class MarkovLM:
    """A second-order Markov chain given by a logit table [vocab, vocab, vocab] (a CausalLM).

    Verifies trees (explicit attention masks; the cache compacts), so tree drafting can be
    certified on it too.
    """

    backend = "table"
    caps = ModelCaps(trees=True)

    def __init__(self, vocab: int, seed: int, sharpness: float = 2.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, vocab, generator=g) * sharpness
        self.vocab_size = vocab
        self.max_length = 1 << 16

    def new_cache(self, max_length: int) -> TokenCache:
        return TokenCache()

    def forward(
        self, input_ids: torch.Tensor, cache: TokenCache, positions=None, attn_mask=None, last_only=False
    ) -> torch.Tensor:
        """Logits from the last two tokens each new token attends to (causal unless ``attn_mask``)."""
        start = cache.length
        cache.tokens.extend(input_ids[0].tolist())
        out = []
        for i in range(input_ids.shape[1]):
            row = start + i
            seen = range(row + 1) if attn_mask is None else [j for j in range(row + 1) if attn_mask[i, j]]
            history = [cache.tokens[j] for j in seen]
            prev2 = history[-2] if len(history) > 1 else 0
            out.append(self.table[prev2, history[-1]])
        return torch.stack(out).unsqueeze(0)


def default_target() -> MarkovLM:
    """The target :func:`certify` uses by default: a Markov chain over 5 tokens."""
    return MarkovLM(5, seed=11)


# -- exact laws and the test -------------------------------------------------------------------


def sequence_law(model: CausalLM, prompt: list[int], n_new: int, sampling: SamplingConfig) -> dict[tuple, float]:
    """Exact probability of every continuation of length ``n_new`` under the target alone."""
    vocab = model.vocab_size
    law = {}
    cond: dict[tuple, torch.Tensor] = {}
    for length in range(n_new):
        for prefix in itertools.product(range(vocab), repeat=length):
            cache = model.new_cache(64)
            logits = model.forward(torch.tensor([prompt + list(prefix)]), cache)[:, -1]
            cond[prefix] = logits_to_probs(logits, sampling)[0].double()
    for seq in itertools.product(range(vocab), repeat=n_new):
        prob = 1.0
        for i in range(n_new):
            prob *= float(cond[seq[:i]][seq[i]])
        law[seq] = prob
    return law


def sample_sequences(
    decoder: Decoder, prompt: list[int], n_new: int, sampling: SamplingConfig, n: int, seed: int = 0
) -> Counter:
    """How often each continuation came out of ``n`` generations (request seeds from ``seed``)."""
    counts: Counter = Counter()
    for i in range(n):
        cfg = GenerationConfig(max_new_tokens=n_new, sampling=sampling, seed=seed * 1_000_003 + i)
        counts[tuple(decoder.generate(prompt, cfg).token_ids)] += 1
    return counts


def chi_square_pvalue(counts: Counter, law: dict[tuple, float]) -> float:
    """Pearson chi-square of observed counts against an exact law; cells with expected < 5 pooled.

    A sample outside the law's support gives p = 0 (an impossible sequence is a hard failure).
    """
    n = sum(counts.values())
    if any(law.get(seq, 0.0) == 0.0 for seq in counts):
        return 0.0
    keys = sorted(law, key=law.get, reverse=True)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for key in keys:
        e = law[key] * n
        if e >= 5:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            pool_o += counts.get(key, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    if len(obs) < 2:
        return 1.0  # one cell holds everything: nothing to test beyond the support check
    exp_arr = np.array(exp)
    exp_arr *= n / exp_arr.sum()
    statistic = float(((np.array(obs) - exp_arr) ** 2 / exp_arr).sum())
    return chi2_sf(statistic, len(obs) - 1)


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularised upper incomplete gamma function."""
    x = torch.tensor(statistic / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), x))


def no_residual_verify(draft: Draft, target_probs: torch.Tensor, generator=None) -> Verification:
    """A broken verifier: after a rejection it samples from p instead of norm(max(p - q, 0))."""
    q = draft_probs_or_onehot(draft, target_probs.shape[-1])[0]
    p = target_probs[0]
    for i in range(draft.k):
        x = int(draft.tokens[0, i])
        if torch.rand(1, generator=generator).item() * q[i, x] >= p[i, x]:
            return Verification(torch.tensor([i]), sample(p[i].unsqueeze(0), generator))
    return Verification(torch.tensor([draft.k]), sample(p[draft.k].unsqueeze(0), generator))


def proposer_pvalue(
    target: CausalLM,
    proposer: Proposer,
    sampling: SamplingConfig,
    n: int,
    k: int = 2,
    n_new: int = 3,
    tree: TreeConfig | None = None,
    seed: int = 0,
) -> float:
    """Chi-square p-value of ``n`` speculative samples against the target's exact sequence law."""
    counts = sample_sequences(Decoder(target, proposer, k=k, tree=tree), CONFORMANCE_PROMPT, n_new, sampling, n, seed)
    return chi_square_pvalue(counts, sequence_law(target, CONFORMANCE_PROMPT, n_new, sampling))


# -- certification ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    """One check: a drafting mode ("chain" or "tree") under one sampling setting (or greedy)."""

    name: str  # e.g. "chain t=0.7 top_k=3", "tree greedy identity"
    mode: str
    sampling: SamplingConfig
    pvalue: float | None  # None for greedy identity (token-for-token, no statistics)
    passed: bool
    detail: str = ""  # what failed (a mismatch, an exception), or what was compared


@dataclass(frozen=True)
class CertificationReport:
    """Every case :func:`certify` ran; ``passed`` when each did (and at least one ran)."""

    proposer: str
    cases: tuple[CaseResult, ...]
    alpha: float
    samples: int
    k: int
    n_new: int
    notes: tuple[str, ...] = ()  # what was not checked, and why

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(case.passed for case in self.cases)

    @property
    def n_passed(self) -> int:
        return sum(case.passed for case in self.cases)

    @property
    def n_failed(self) -> int:
        return len(self.cases) - self.n_passed

    def table(self) -> str:
        """The cases as plain text, one per line, and a final ``N passed, M failed`` line."""
        width = max([len(c.name) for c in self.cases] + [4])
        lines = [f"{'case':<{width}}  {'p-value':>9}  result"]
        for c in self.cases:
            result = "PASS" if c.passed else "FAIL"
            lines.append(
                f"{c.name:<{width}}  {format_pvalue(c.pvalue):>9}  {result}" + (f"  {c.detail}" if c.detail else "")
            )
        lines += [f"note: {note}" for note in self.notes]
        lines.append(f"{self.n_passed} passed, {self.n_failed} failed")
        return "\n".join(lines)


def format_pvalue(pvalue: float | None) -> str:
    """A p-value for a table: 4 decimals, scientific below 1e-4, "-" for none (greedy cases)."""
    if pvalue is None:
        return "-"
    return f"{pvalue:.4f}" if pvalue >= 1e-4 or pvalue == 0.0 else f"{pvalue:.1e}"


def certify(
    proposer: Proposer,
    *,
    target: CausalLM | None = None,
    samples: int = 3000,
    alpha: float = ALPHA,
    k: int = 2,
    n_new: int = 3,
    trees: bool | None = None,
    seed: int = 0,
) -> CertificationReport:
    """Check that decoding with ``proposer`` reproduces ``target``'s law exactly.

    ``target`` (default :func:`default_target`, a Markov chain over 5 tokens) must be small
    enough to enumerate: vocab ** n_new <= MAX_SEQUENCES. For chains, and for trees when
    ``trees`` is True or when it is None and both ``proposer.caps.trees`` and
    ``target.caps.trees`` allow: ``samples`` generations of ``n_new`` tokens (``k`` drafts per
    round) under each of :data:`SAMPLINGS` must pass Pearson's chi-square against the exact law
    at level ``alpha``, and greedy output must equal plain greedy decoding on a few prompts. A
    tree-only proposer (``caps.tree_only``) is certified on trees only. An exception inside a
    case fails that case (its message in ``detail``). ``proposer`` must implement
    :class:`~specdecode.proposers.base.Proposer` (e.g. subclass ``PerRequest`` and declare
    ``caps``); anything else, or impossible settings, is a ConfigError.
    """
    target = default_target() if target is None else target
    _check_inputs(proposer, target, samples, alpha, k, n_new)
    caps: ProposerCaps = proposer.caps
    notes = []
    can_tree = caps.trees and target.caps.trees
    if trees and not can_tree:
        why = (
            "the proposer does not declare caps.trees"
            if not caps.trees
            else f"the {target.backend} target cannot verify trees"
        )
        raise ConfigError(f"trees=True, but {why}")
    if trees is None:
        trees = can_tree
        if not caps.trees:
            notes.append("trees not checked: the proposer does not declare caps.trees")
        elif not target.caps.trees:
            notes.append(f"trees not checked: the {target.backend} target cannot verify trees")
    modes = []
    if caps.tree_only:
        if not trees:
            raise ConfigError(
                f"proposer {proposer.name!r} drafts only trees (caps.tree_only), and trees cannot run here"
            )
        notes.append("chains not checked: the proposer drafts only trees (caps.tree_only)")
    else:
        modes.append(("chain", None))
    if trees:
        modes.append(("tree", TreeConfig(max_nodes=max(8, 3 * k))))

    prompt = [t % target.vocab_size for t in CONFORMANCE_PROMPT]
    cases = []
    for m, (mode, tree) in enumerate(modes):
        for s, (label, sampling) in enumerate(SAMPLINGS.items()):
            case_seed = seed * 1_000 + m * 100 + s
            cases.append(
                _sampling_case(
                    f"{mode} {label}",
                    mode,
                    target,
                    proposer,
                    tree,
                    prompt,
                    sampling,
                    samples,
                    alpha,
                    k,
                    n_new,
                    case_seed,
                )
            )
        cases.append(_greedy_case(f"{mode} greedy identity", mode, target, proposer, tree, k))
    return CertificationReport(
        proposer=proposer.name, cases=tuple(cases), alpha=alpha, samples=samples, k=k, n_new=n_new, notes=tuple(notes)
    )


def _check_inputs(proposer: object, target: object, samples: int, alpha: float, k: int, n_new: int) -> None:
    if not isinstance(proposer, Proposer) or not isinstance(proposer.caps, ProposerCaps):
        raise ConfigError(
            f"{type(proposer).__name__} is not a proposer: implement specdecode.proposers.base.Proposer "
            "(subclass PerRequest, declare caps = ProposerCaps(...), implement propose and observe)"
        )
    if not isinstance(target, CausalLM):
        raise ConfigError(f"target {type(target).__name__} is not a CausalLM (new_cache, forward, vocab_size, caps)")
    if samples < 1 or k < 1 or n_new < 1:
        raise ConfigError(f"samples, k and n_new must be >= 1, got {samples}, {k}, {n_new}")
    if not 0.0 < alpha < 1.0:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha}")
    if target.vocab_size**n_new > MAX_SEQUENCES:
        raise ConfigError(
            f"the target is not enumerable: vocab {target.vocab_size} ** n_new {n_new} "
            f"> {MAX_SEQUENCES} sequences (use a tiny target, e.g. MarkovLM(5, seed=0))"
        )


def _sampling_case(
    name: str,
    mode: str,
    target: CausalLM,
    proposer: Proposer,
    tree: TreeConfig | None,
    prompt: list[int],
    sampling: SamplingConfig,
    samples: int,
    alpha: float,
    k: int,
    n_new: int,
    seed: int,
) -> CaseResult:
    try:
        counts = sample_sequences(Decoder(target, proposer, k=k, tree=tree), prompt, n_new, sampling, samples, seed)
        pvalue = chi_square_pvalue(counts, sequence_law(target, prompt, n_new, sampling))
    except Exception as exc:  # a proposer that crashes fails its case; the report says how
        return CaseResult(name, mode, sampling, None, False, f"error: {type(exc).__name__}: {exc}")
    detail = "" if pvalue > alpha else f"p <= alpha = {alpha:g}: not the target's law"
    return CaseResult(name, mode, sampling, pvalue, pvalue > alpha, detail)


def _greedy_case(
    name: str, mode: str, target: CausalLM, proposer: Proposer, tree: TreeConfig | None, k: int
) -> CaseResult:
    greedy = SamplingConfig()
    cfg = GenerationConfig(max_new_tokens=GREEDY_TOKENS, sampling=greedy, seed=0)
    try:
        plain, spec = Decoder(target, None), Decoder(target, proposer, k=k, tree=tree)
        for prompt in GREEDY_PROMPTS:
            prompt = [t % target.vocab_size for t in prompt]
            expected, got = plain.generate(prompt, cfg).token_ids, spec.generate(prompt, cfg).token_ids
            if got != expected:
                return CaseResult(name, mode, greedy, None, False, f"prompt {prompt}: {got} != plain {expected}")
    except Exception as exc:
        return CaseResult(name, mode, greedy, None, False, f"error: {type(exc).__name__}: {exc}")
    return CaseResult(name, mode, greedy, None, True, f"same tokens as plain decoding on {len(GREEDY_PROMPTS)} prompts")
