"""Shared test fixtures: enumerable tiny models, exact sequence laws, and a chi-square check."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import torch
from scipy import stats

from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.core.verify import Draft, Verification, draft_probs_or_onehot
from specdecode.engine import Decoder, GenerationConfig
from specdecode.models.base import ModelCaps, check_trim

ALPHA = 1e-3  # significance level of every conformance test in this suite


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
    """A second-order Markov chain given by a logit table [vocab, vocab, vocab]."""

    backend = "table"
    caps = ModelCaps(trees=True)

    def __init__(self, vocab: int, seed: int, sharpness: float = 2.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, vocab, generator=g) * sharpness
        self.vocab_size = vocab
        self.max_length = 1 << 16

    def new_cache(self, max_length: int) -> TokenCache:
        return TokenCache()

    def forward(self, input_ids: torch.Tensor, cache: TokenCache, positions=None, attn_mask=None, last_only=False) -> torch.Tensor:
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


def tiny_llama(vocab: int = 6, seed: int = 0, layers: int = 2):
    """A tiny random transformers Llama wrapped in the adapter (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdecode.models.hf import HFCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.5, tie_word_embeddings=False,
    )
    return HFCausalLM(LlamaForCausalLM(config).eval())


def sequence_law(model, prompt: list[int], n_new: int, sampling: SamplingConfig) -> dict[tuple, float]:
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


def sample_sequences(decoder: Decoder, prompt: list[int], n_new: int, sampling: SamplingConfig, n: int, seed: int = 0) -> Counter:
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
    exp_arr = np.array(exp)
    exp_arr *= n / exp_arr.sum()
    return float(stats.chisquare(np.array(obs), exp_arr).pvalue)


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + <s>, </s>), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), pre_tokenizers.Split("", "isolated")]
    )
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def save_tiny_llama(path, seed: int = 0, layers: int = 2) -> None:
    """A tiny random Llama with the byte-level tokenizer, saved as a transformers folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def tiny_native(vocab: int = 6, seed: int = 0, layers: int = 2):
    """The same tiny random Llama as :func:`tiny_llama`, run by the native backend."""
    import tempfile

    from specdecode.models.native import NativeCausalLM

    folder = tempfile.mkdtemp(prefix="specdecode-tiny-")
    tiny_llama(vocab=vocab, seed=seed, layers=layers).model.save_pretrained(folder)
    return NativeCausalLM.from_pretrained(folder)


def no_residual_verify(draft: Draft, target_probs: torch.Tensor, generator=None) -> Verification:
    """A broken verifier: after a rejection it samples from p instead of norm(max(p - q, 0))."""
    q = draft_probs_or_onehot(draft, target_probs.shape[-1])[0]
    p = target_probs[0]
    for i in range(draft.k):
        x = int(draft.tokens[0, i])
        if torch.rand(1, generator=generator).item() * q[i, x] >= p[i, x]:
            return Verification(torch.tensor([i]), sample(p[i].unsqueeze(0), generator))
    return Verification(torch.tensor([draft.k]), sample(p[draft.k].unsqueeze(0), generator))


CONFORMANCE_PROMPT = [1, 2, 3, 1, 2, 0, 1]  # repeats, so lookup-style drafts find matches


def proposer_pvalue(target, proposer, sampling: SamplingConfig, n: int, k: int = 2, n_new: int = 3) -> float:
    """Chi-square p-value of ``n`` speculative samples against the target's exact sequence law."""
    counts = sample_sequences(Decoder(target, proposer, k=k), CONFORMANCE_PROMPT, n_new, sampling, n)
    return chi_square_pvalue(counts, sequence_law(target, CONFORMANCE_PROMPT, n_new, sampling))


def greedy_draft_lengths(make_proposer, thresholds, k: int = 6) -> list[int]:
    """Greedy chain lengths drafted on a fixed context by ``make_proposer(threshold)`` per threshold."""
    context = [1, 2, 3, 4, 1, 2]
    lengths = []
    for threshold in thresholds:
        proposer = make_proposer(threshold)
        proposer.reset(context)
        lengths.append(proposer.propose(context, k, SamplingConfig(temperature=0.0), None).tokens.shape[1])
    return lengths


def started_states(proposer) -> list:
    """The per-request states ``proposer.start`` hands out from now on (to inspect them after a run)."""
    states, start = [], proposer.start
    proposer.start = lambda *args: states.append(start(*args)) or states[-1]
    return states
