"""Shared test fixtures: tiny transformers / native models, tokenizers and proposer probes.

The conformance machinery (enumerable tiny models, exact sequence laws, the chi-square check)
is public in :mod:`specdecode.testing`; it is re-exported here for the tests.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingConfig
from specdecode.testing import (  # noqa: F401  (re-exported)
    ALPHA,
    CONFORMANCE_PROMPT,
    MarkovLM,
    TokenCache,
    chi_square_pvalue,
    no_residual_verify,
    proposer_pvalue,
    sample_sequences,
    sequence_law,
)


def tiny_llama(vocab: int = 6, seed: int = 0, layers: int = 2):
    """A tiny random transformers Llama wrapped in the adapter (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdecode.models.hf import HFCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    return HFCausalLM(LlamaForCausalLM(config).eval())


def wide_checkpoint(folder, seed: int = 3, vocab: int = 16) -> None:
    """A small random Llama whose matrices read 1024 inputs: wide enough that oneDNN's
    bf16 matmul gives a row different bits when the rows beside it change (K >= 1024 here),
    so a test over it sees whether prompt chunks are multiplied one call each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)


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
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def tiny_native(vocab: int = 6, seed: int = 0, layers: int = 2, pack: bool = True):
    """The same tiny random Llama as :func:`tiny_llama`, run by the native backend (``pack``:
    its matrices prepacked for oneDNN where that works, as a loaded model's are)."""
    import tempfile

    from specdecode.models.native import NativeCausalLM

    folder = tempfile.mkdtemp(prefix="specdecode-tiny-")
    tiny_llama(vocab=vocab, seed=seed, layers=layers).model.save_pretrained(folder)
    return NativeCausalLM.from_pretrained(folder, pack=pack)


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


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``specdecode ARGV`` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from specdecode.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()
