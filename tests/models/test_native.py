"""The native Llama-family path: logits match transformers, cache trim, positions/mask, loading."""

from __future__ import annotations

import pytest
import torch

from specdecode.errors import ModelLoadError
from specdecode.models.native import NativeCausalLM, supports

FP32 = {"rtol": 1e-4, "atol": 1e-4}


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM, kw


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2Config, Qwen2ForCausalLM, kw


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralConfig, MistralForCausalLM, kw


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small: every band is scaled
}
CASES = {
    "llama-tied-gqa-llama3": lambda: _llama(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    "llama-untied-bias-linear": lambda: _llama(
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    ),
    "llama-mha-dynamic": lambda: _llama(
        num_key_value_heads=4, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "qwen2-qkv-bias": lambda: _qwen2(tie_word_embeddings=False),
    "mistral": lambda: _mistral(sliding_window=None),
}


def make_checkpoint(tmp_path, case: str, seed: int = 0):
    """Save a tiny random transformers model of ``case``; return (folder, transformers model)."""
    config_cls, model_cls, kw = CASES[case]()
    base = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    base.update(kw)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base)).eval()
    if any(b is not None for b in _biases(model)):
        with torch.no_grad():  # transformers zero-initialises biases; make them matter
            for b in _biases(model):
                if b is not None:
                    b.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    return tmp_path, model


def _biases(model):
    return [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear)]


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits.float()


def ragged_rows(native: NativeCausalLM, vocab: int = 96, seed: int = 6):
    """Three sequences for one ``forward_rows`` call (a prefill, a verify, a decode over caches of
    three lengths): (prefixes, new rows, their caches holding the prefixes, each row's logits alone)."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(0, vocab, (1, n), generator=g) for n in (0, 9, 3)]
    news = [torch.randint(0, vocab, (n,), generator=g) for n in (6, 4, 1)]
    alone, caches = [], []
    for prefix, new in zip(prefixes, news):
        cache = native.new_cache(4)
        if prefix.shape[1]:
            native.forward(prefix, cache)
        alone.append(native.forward(new[None], cache))
        caches.append(cache)
        cache.trim(prefix.shape[1])
    return prefixes, news, caches, alone


def chunked(native: NativeCausalLM, ids: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Feed ``ids`` through one cache in chunks of ``sizes``; concatenated logits."""
    cache = native.new_cache(ids.shape[1])
    out, at = [], 0
    for n in sizes:
        out.append(native.forward(ids[:, at : at + n], cache))
        at += n
    assert cache.length == ids.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    folder, hf = make_checkpoint(tmp_path, case)
    assert supports(folder)
    native = NativeCausalLM.from_pretrained(folder)
    ids = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(1))
    got = chunked(native, ids, [6, 1, 4, 1, 2])  # prefill, decode, verify, decode, verify
    assert got.dtype == torch.float32 and got.shape == (1, 14, 96)
    torch.testing.assert_close(got, reference_logits(hf, ids), **FP32)


def test_unpacked_matrices_agree(tmp_path):
    folder, hf = make_checkpoint(tmp_path, "qwen2-qkv-bias")
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    plain = chunked(NativeCausalLM.from_pretrained(folder, pack=False), ids, [5, 1, 3])
    torch.testing.assert_close(plain, reference_logits(hf, ids), **FP32)


def test_trim_and_continue_equals_fresh_prefill(tmp_path):
    folder, _ = make_checkpoint(tmp_path, "llama-tied-gqa-llama3")
    native = NativeCausalLM.from_pretrained(folder)
    g = torch.Generator().manual_seed(3)
    ids, junk = torch.randint(0, 96, (1, 13), generator=g), torch.randint(0, 96, (1, 5), generator=g)
    cache = native.new_cache(32)
    native.forward(ids[:, :10], cache)
    native.forward(junk, cache)  # rejected drafts
    cache.trim(10)
    assert cache.length == 10
    got = native.forward(ids[:, 10:], cache)
    fresh = native.forward(ids, native.new_cache(13))[:, 10:]
    torch.testing.assert_close(got, fresh, **FP32)


def test_explicit_positions_and_mask_equal_default(tmp_path):
    folder, _ = make_checkpoint(tmp_path, "mistral")
    native = NativeCausalLM.from_pretrained(folder)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(4))
    a, b = native.new_cache(16), native.new_cache(16)
    native.forward(ids[:, :7], a)
    native.forward(ids[:, :7], b)
    default = native.forward(ids[:, 7:], a)
    positions = torch.arange(7, 11).unsqueeze(0)
    mask = torch.arange(11)[None, :] <= positions[0, :, None]  # causal over cache + new
    explicit = native.forward(ids[:, 7:], b, positions=positions, attn_mask=mask.unsqueeze(0))
    torch.testing.assert_close(explicit, default, **FP32)


def test_tree_branches_see_only_their_ancestors(tmp_path):
    """Two sibling drafts at the same position score as if each were the only continuation."""
    folder, _ = make_checkpoint(tmp_path, "llama-untied-bias-linear")
    native = NativeCausalLM.from_pretrained(folder)
    prefix, root, left, right = [5, 9, 3, 14], 21, 33, 47
    tree = native.new_cache(16)
    native.forward(torch.tensor([prefix]), tree)
    positions = torch.tensor([[4, 5, 5]])
    mask = torch.ones(3, 7, dtype=torch.bool)  # columns: prefix 0-3, root 4, left 5, right 6
    mask[0, 5:] = False  # the root sees neither child
    mask[1, 6] = mask[2, 5] = False  # siblings do not see each other
    got = native.forward(torch.tensor([[root, left, right]]), tree, positions=positions, attn_mask=mask)
    for row, child in ((1, left), (2, right)):
        chain = native.forward(torch.tensor([prefix + [root, child]]), native.new_cache(8))
        torch.testing.assert_close(got[:, row], chain[:, -1], **FP32)
    torch.testing.assert_close(got[:, 0], chain[:, -2], **FP32)


def test_bf16_runs_and_tracks_fp32(tmp_path):
    folder, _ = make_checkpoint(tmp_path, "qwen2-qkv-bias")
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(5))
    bf16 = NativeCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.backend == "native"
    got = chunked(bf16, ids, [6, 1, 3])
    ref = chunked(NativeCausalLM.from_pretrained(folder), ids, [10])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_cache_grows_past_its_capacity_and_keeps_entries(tmp_path):
    folder, _ = make_checkpoint(tmp_path, "mistral")
    native = NativeCausalLM.from_pretrained(folder)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    cache = native.new_cache(3)
    got = chunked_into(native, cache, ids, [3, 2, 2])
    assert cache.capacity >= 7 and cache.length == 7
    assert torch.allclose(got, chunked(native, ids, [7]), atol=1e-5)


def chunked_into(native, cache, ids, sizes):
    out, at = [], 0
    for n in sizes:
        out.append(native.forward(ids[:, at : at + n], cache))
        at += n
    return torch.cat(out, dim=1)


def test_failed_forward_leaves_the_cache(tmp_path):
    folder, _ = make_checkpoint(tmp_path, "mistral")
    native = NativeCausalLM.from_pretrained(folder)
    cache = native.new_cache(8)
    native.forward(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="attn_mask"):
        native.forward(torch.tensor([[4, 5]]), cache, attn_mask=torch.ones(2, 2, dtype=torch.bool))
    assert cache.length == 3


def test_compact_moves_an_accepted_path_into_place(tmp_path):
    """Tree verify then compact equals feeding the accepted path as a chain."""
    from specdecode.core.tree import Tree

    folder, _ = make_checkpoint(tmp_path, "llama-tied-gqa-llama3")
    native = NativeCausalLM.from_pretrained(folder)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    tree = Tree.from_paths([[9, 2, 6], [9, 5], [3]])
    cache = native.new_cache(32)
    native.forward(prompt[:, :-1], cache)
    base = cache.length
    mask = torch.cat([torch.ones(tree.size + 1, base, dtype=torch.bool), tree.attention_mask()], dim=1)
    ids = torch.cat([prompt[0, -1:], tree.tokens]).unsqueeze(0)
    native.forward(ids, cache, positions=(base + tree.depths()).unsqueeze(0), attn_mask=mask)
    cache.compact(base, [0, 1, 4])  # root, 9, 5
    after = native.forward(torch.tensor([[7]]), cache)
    chain = native.new_cache(32)
    ref = native.forward(torch.tensor([[3, 1, 4, 1, 5, 9, 5, 7]]), chain)[:, -1:]
    assert torch.allclose(after, ref, atol=1e-4)


def test_layer_view_shares_the_first_layers(tmp_path):
    from specdecode.proposers.early_exit import exit_model

    folder, _ = make_checkpoint(tmp_path, "llama-tied-gqa-llama3")
    native = NativeCausalLM.from_pretrained(folder)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    cache = native.new_cache(16)
    native.forward(ids[:, :5], cache)
    head = exit_model(native, 1)
    view = cache.layer_view(1)
    view.follow_parent()
    shared = head.forward(ids[:, 5:], view)
    ref = head.forward(ids, head.new_cache(16))[:, -1:]
    assert torch.allclose(shared, ref, atol=1e-4)


def test_sliding_window_caps_max_length(tmp_path):
    config_cls, model_cls, _ = _mistral()
    cfg = config_cls(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        sliding_window=24,
    )
    model_cls(cfg).save_pretrained(tmp_path)
    native = NativeCausalLM.from_pretrained(tmp_path)
    assert native.max_length == 24  # within the window, sliding and full attention agree


def test_supports_refuses_gpt2_and_load_model_routes(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from specdecode.models.loading import load_model

    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    assert not supports(tmp_path)
    with pytest.raises(ModelLoadError, match="native backend cannot run.*gpt2"):
        load_model(tmp_path, backend="native")
    assert load_model(tmp_path).model.backend == "transformers"


def test_load_model_picks_native_when_supported(tmp_path):
    from specdecode.models.loading import load_model

    folder, _ = make_checkpoint(tmp_path, "llama-tied-gqa-llama3")
    _save_tokenizer(folder)
    assert load_model(folder).model.backend == "native"
    assert load_model(folder, backend="transformers").model.backend == "transformers"


def test_compile_failure_falls_back_to_eager(tmp_path, monkeypatch):
    folder, hf = make_checkpoint(tmp_path, "llama-tied-gqa-llama3")

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="torch.compile failed"):
        native = NativeCausalLM.from_pretrained(folder, compile=True)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(chunked(native, ids, [4, 2]), reference_logits(hf, ids), **FP32)


def _save_tokenizer(folder) -> None:
    """A minimal fast tokenizer so ``load_model`` can load the folder (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(32)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    tok.save_pretrained(folder)


# -- the real default model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_dir():
    from specdecode.models.loading import resolve_model_dir

    return resolve_model_dir(None)


@pytest.mark.slow
def test_default_model_matches_transformers(default_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_dir), dtype=torch.float32).eval()
    native = NativeCausalLM.from_pretrained(default_dir)
    ids = torch.randint(0, native.vocab_size, (1, 30), generator=torch.Generator().manual_seed(7))
    got = chunked(native, ids, [24, 1, 5])
    torch.testing.assert_close(got, reference_logits(hf, ids), rtol=1e-4, atol=2e-3)


@pytest.mark.slow
def test_default_model_bf16_speculative_equals_plain(default_dir):
    from specdecode.engine import Decoder, GenerationConfig
    from specdecode.models.loading import load_tokenizer
    from specdecode.proposers import NgramProposer

    tok = load_tokenizer(default_dir)
    native = NativeCausalLM.from_pretrained(default_dir, dtype=torch.bfloat16)
    config = GenerationConfig(max_new_tokens=48)
    for text in ("List the days of the week, then list them again.", "Write a Python function that adds two numbers."):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain = Decoder(native, None).generate(ids, config).token_ids
        spec = Decoder(native, NgramProposer(), k=4).generate(ids, config).token_ids
        assert spec == plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_different_lengths_match_forwards_alone(tmp_path, dtype):
    """One forward over three sequences (a prefill, a verify, a decode) over caches of three lengths."""
    folder, _ = make_checkpoint(tmp_path, "qwen2-qkv-bias")
    native = NativeCausalLM.from_pretrained(folder, dtype=dtype)
    prefixes, news, batched, alone = ragged_rows(native)
    got = native.forward_rows(news, batched)
    for cache, prefix, new, g_row, a_row in zip(batched, prefixes, news, got, alone):
        assert cache.length == prefix.shape[1] + new.numel() and g_row.shape == a_row.shape
        if dtype == torch.bfloat16:  # exact: a row's result must not depend on its batch
            assert torch.equal(g_row, a_row)
        else:
            torch.testing.assert_close(g_row, a_row, **FP32)
    last = native.forward_rows([n[-1:] for n in news], batched, last_only=True)
    assert [t.shape for t in last] == [(1, 1, 96)] * 3


def test_rows_refuse_bad_input_and_leave_caches(tmp_path):
    folder, _ = make_checkpoint(tmp_path, "mistral")
    native = NativeCausalLM.from_pretrained(folder)
    a, b = native.new_cache(8), native.new_cache(8)
    native.forward(torch.tensor([[1, 2, 3]]), a)
    with pytest.raises(ValueError, match="one cache per row"):
        native.forward_rows([torch.tensor([1])], [a, b])
    with pytest.raises(ValueError, match="at least one new token"):
        native.forward_rows([torch.tensor([4]), torch.tensor([], dtype=torch.long)], [a, b])
    with pytest.raises(ValueError, match="distinct cache"):
        native.forward_rows([torch.tensor([4]), torch.tensor([5])], [a, a])
    assert (a.length, b.length) == (3, 0)
