"""Prefix caching: a stored prefix stands in for its prefill bitwise, so every token, logprob and
sampled draw is the one the request gives without the cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import tiny_llama
from specdecode.core.sampling import SamplingConfig
from specdecode.engine import Decoder, Engine, EngineConfig, GenerationConfig, Speculation
from specdecode.errors import ConfigError
from specdecode.models import int8dot, native
from specdecode.models.native import NativeCausalLM
from specdecode.models.prefix_cache import PrefixCache
from specdecode.models.static_cache import StaticKVCache
from specdecode.proposers import NgramProposer

pytestmark = pytest.mark.usefixtures("one_thread")

SHARED = torch.randint(0, 6, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # a "system prompt"
TAILS = [[1, 2, 3, 4, 5, 0, 1], [5, 4, 3, 2, 1, 0, 5, 4, 3], [2, 2, 3, 3, 4, 4]]
PROMPTS = [SHARED + tail for tail in TAILS]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(vocab=6, seed=0, layers=2).model.save_pretrained(path)
    return path


def _filled(tokens: int, layers: int = 2, seed: int = 0) -> StaticKVCache:
    cache = StaticKVCache(layers, 2, 4, tokens + 8, torch.float32)
    cache.reserve(tokens)
    g = torch.Generator().manual_seed(seed)
    cache.keys[:, :, :, :tokens] = torch.randn(layers, 1, 2, tokens, 4, generator=g)
    cache.values[:, :, :, :tokens] = torch.randn(layers, 1, 2, tokens, 4, generator=g)
    return cache


# -- the store ---------------------------------------------------------------------------------
def test_the_longest_aligned_common_prefix_is_loaded_bitwise():
    store, cache = PrefixCache(1 << 20, align=16), _filled(40)
    store.store(SHARED, cache)
    assert store.stats()["entries"] == 1 and store.stats()["bytes"] > 0
    assert store.match(SHARED + [1, 2], limit=100) == 32  # 40 shared, cut to a multiple of 16
    assert store.match(SHARED[:20] + [(SHARED[20] + 1) % 6], limit=100) == 16
    assert store.match(SHARED, limit=20) == 16  # never past the limit (the prompt's last token)
    assert store.match([(SHARED[0] + 1) % 6] + SHARED[1:], limit=100) == 0
    assert store.match(SHARED, limit=100, paths=[False] * 20 + [True] * 20) == 16  # computed elsewhere from 20 on
    fresh = StaticKVCache(2, 2, 4, 64, torch.float32)
    assert store.load(fresh, SHARED + [3], 32) == 32
    assert fresh.length == 32
    assert torch.equal(fresh.keys[:, :, :, :32], cache.keys[:, :, :, :32])
    assert torch.equal(fresh.values[:, :, :, :32], cache.values[:, :, :, :32])
    assert store.stats()["hits"] == 1 and store.stats()["hit_tokens"] == 32


def test_a_longer_sequence_replaces_the_entry_it_extends_and_a_shorter_one_is_not_kept():
    store = PrefixCache(1 << 20, align=16)
    store.store(SHARED[:32], _filled(32))
    longer = SHARED + TAILS[0] + TAILS[1]
    store.store(longer, _filled(len(longer)))
    assert store.stats()["entries"] == 1  # the 32-token entry is served by the longer one
    store.store(SHARED[:16], _filled(16))
    assert store.stats()["entries"] == 1
    assert store.match(longer + [0], limit=100) == len(longer) // 16 * 16


def test_least_recently_used_entries_leave_first_and_the_budget_holds():
    one = PrefixCache(1 << 20, 16)
    one.store(SHARED, _filled(40))
    size = one.stats()["bytes"]
    store = PrefixCache(2 * size, align=16)
    seqs = [[t] + SHARED[1:] for t in range(3)]  # three sequences that differ at the first token
    store.store(seqs[0], _filled(40))
    store.store(seqs[1], _filled(40))
    store.load(StaticKVCache(2, 2, 4, 64, torch.float32), seqs[0], 32)  # seqs[0] used again
    store.store(seqs[2], _filled(40))  # evicts seqs[1], the least recently used
    assert store.stats()["bytes"] <= 2 * size and store.stats()["entries"] == 2
    assert store.match(seqs[0], 100) == 32 and store.match(seqs[2], 100) == 32
    assert store.match(seqs[1], 100) == 0
    tiny = PrefixCache(size - 1, align=16)
    tiny.store(SHARED, _filled(40))  # larger than the whole budget: not kept
    assert tiny.stats()["entries"] == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ConfigError, match="prefix cache size"):
        PrefixCache(-1)
    with pytest.raises(ConfigError, match="prefix_cache_mb"):
        EngineConfig(prefix_cache_mb=-5)


# -- the engine ---------------------------------------------------------------------------------
def _runs(decoder: Decoder, prompts, config: GenerationConfig):
    """Each prompt's tokens, logprobs and cached prompt positions, one run after another."""
    out = []
    for ids in prompts:
        run = decoder.run(ids, config)
        events = list(run)
        result = run.result()
        out.append((result.token_ids, [e.logprobs for e in events], result.stats["cached_tokens"]))
    return out


CONFIGS = [
    GenerationConfig(max_new_tokens=12, logprobs=2),
    GenerationConfig(max_new_tokens=12, logprobs=2, sampling=SamplingConfig(temperature=0.9, top_k=5), seed=7),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["greedy", "sampled"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_reused_prefixes_give_the_same_tokens_and_logprobs_bitwise(folder, config, speculative):
    model = NativeCausalLM.from_pretrained(folder)  # fp32: split prefills exact at 16-row offsets
    proposer = NgramProposer() if speculative else None
    cold = _runs(Decoder(model, proposer, k=3, prefix_cache_mb=0), PROMPTS, config)
    warm = _runs(Decoder(model, proposer, k=3), PROMPTS, config)
    assert [(t, lp) for t, lp, _ in warm] == [(t, lp) for t, lp, _ in cold]
    assert [c for *_, c in cold] == [0, 0, 0]
    assert [c for *_, c in warm] == [0, 32, 32]  # the 40 shared tokens, down to a multiple of 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_conversations_next_turn_reuses_the_answer_where_rows_are_exact(folder, dtype):
    """bf16 writes every position bitwise alike (prefill chunk, decode row, verify chain), so
    the whole first turn is stored; fp32 verify rows differ in the last bits from a prefill,
    so only its prompt chunks are."""
    model = NativeCausalLM.from_pretrained(folder, dtype=dtype)
    config = GenerationConfig(max_new_tokens=30)
    first = PROMPTS[0]
    warm = Decoder(model, NgramProposer(), k=3)
    reply = warm.generate(first, config).token_ids
    turn = first + reply + [0, 1, 2, 3]
    second = warm.generate(turn, config)
    cold = Decoder(model, NgramProposer(), k=3, prefix_cache_mb=0).generate(turn, config)
    assert second.token_ids == cold.token_ids
    cached = second.stats["cached_tokens"]
    if model.caps.row_exact:
        assert cached == (len(first) + len(reply) - 1) // 16 * 16 > len(first)
    else:
        assert cached == (len(first) - 1) // 16 * 16


def test_a_batch_from_a_warm_store_matches_a_cold_batch(folder):
    model = NativeCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    spec = Speculation(NgramProposer(), k=3)
    configs = [GenerationConfig(max_new_tokens=10, seed=i, sampling=SamplingConfig(temperature=0.8)) for i in range(3)]
    cold = Engine(model, config=EngineConfig(prefix_cache_mb=0)).generate(PROMPTS, configs, spec)
    engine = Engine(model)
    engine.generate([SHARED + [0, 0]], None, spec)  # stores the shared start
    warm = engine.generate(PROMPTS, configs, spec)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert [r.stats["cached_tokens"] for r in warm] == [32, 32, 32]
    usage = engine.kv_usage()
    assert usage["prefix_hits"] == 3 and usage["prefix_tokens"] == 96 and usage["prefix_bytes"] > 0


def test_a_split_chunk_too_short_for_its_kernel_path_reuses_less(folder):
    """A target that runs prompt chunks of 32+ rows on another path (bf16 copies) needs the rows
    after a reused prefix in a chunk of 32+ as well, where the unsplit chunk had that many."""
    model = NativeCausalLM.from_pretrained(folder)
    model.caps = dataclasses.replace(model.caps, prefix_rest=32)
    decoder = Decoder(model, None)
    decoder.generate(SHARED + [0, 0], GenerationConfig(max_new_tokens=2))
    prompt = SHARED + TAILS[1] + [0, 1, 2]  # 52 tokens, 51 to prefill: one chunk of 32+ unsplit
    out = decoder.generate(prompt, GenerationConfig(max_new_tokens=4))
    assert out.stats["cached_tokens"] == 16  # 32 reused would leave 19 rows, 16 leaves 35
    cold = Decoder(model, None, prefix_cache_mb=0).generate(prompt, GenerationConfig(max_new_tokens=4))
    assert out.token_ids == cold.token_ids
    short = decoder.generate(SHARED + TAILS[0][:3], GenerationConfig(max_new_tokens=4))
    assert short.stats["cached_tokens"] == 0  # 42 to prefill: 16 reused would leave 26 rows


def test_chunks_after_a_reused_prefix_end_at_the_unsplit_offsets(folder):
    model = NativeCausalLM.from_pretrained(folder)
    engine = Engine(model, config=EngineConfig(prefill_chunk=24))
    engine.generate([SHARED + [0, 0]], GenerationConfig(max_new_tokens=1))
    request = engine.submit(PROMPTS[1], GenerationConfig(max_new_tokens=1))
    engine._schedule()
    assert request.fed == 32
    row = request.prefill_row(24)
    assert (request.fed, row.ids.numel()) == (48, 16)  # up to 48, as a cold prefill's second chunk


def test_no_store_where_the_target_cannot_reuse_or_it_is_turned_off(folder):
    assert Engine(tiny_llama()).prefixes is None  # the transformers adapter: prefix_align 0
    model = NativeCausalLM.from_pretrained(folder)
    assert Engine(model, config=EngineConfig(prefix_cache_mb=0)).prefixes is None
    assert Decoder(model, None, prefix_cache_mb=0).prefixes is None
    with pytest.raises(ConfigError, match="aligned to 24"):
        Engine(model, prefixes=PrefixCache(1 << 20, align=24))


def test_a_proposer_reading_the_targets_features_prefills_in_full(folder):
    """Medusa reads the target's features of every forward, prompt chunks included."""
    from specdecode.networks.medusa_heads import MedusaConfig, MedusaHeads
    from specdecode.proposers.medusa import MedusaProposer

    model = NativeCausalLM.from_pretrained(folder)
    heads = MedusaHeads(MedusaConfig.for_target(model, 2, model.vocab_size)).eval()
    decoder = Decoder(model, MedusaProposer(model, heads=heads), k=2)
    decoder.generate(PROMPTS[0], GenerationConfig(max_new_tokens=4))
    assert decoder.prefixes.stats()["entries"] == 1  # stored for requests that may use it
    assert decoder.generate(PROMPTS[1], GenerationConfig(max_new_tokens=4)).stats["cached_tokens"] == 0


def test_a_store_that_ignored_the_alignment_would_be_caught(folder):
    """The broken variant: fp32 prefixes reused at any length change the logprobs' last bits,
    which the bitwise comparison above sees."""
    model = NativeCausalLM.from_pretrained(folder)
    model.caps = dataclasses.replace(model.caps, prefix_align=1)
    config = GenerationConfig(max_new_tokens=12, logprobs=2)
    cold = _runs(Decoder(model, None, prefix_cache_mb=0), PROMPTS, config)
    warm = _runs(Decoder(model, None), PROMPTS, config)
    assert [c for *_, c in warm] == [0, 40, 40]
    assert [lp for _, lp, _ in warm] != [lp for _, lp, _ in cold]


def test_a_salted_request_reuses_only_prefixes_stored_under_its_salt(folder):
    """``cache_salt`` scopes the store: one tenant's prompts never shorten another's prefill
    (a timing side channel otherwise)."""
    decoder = Decoder(NativeCausalLM.from_pretrained(folder), None)

    def cached(prompt, salt):
        return decoder.generate(prompt, GenerationConfig(max_new_tokens=4, cache_salt=salt)).stats["cached_tokens"]

    assert cached(PROMPTS[0], "alice") == 0
    assert cached(PROMPTS[1], "bob") == 0  # alice's entry shares 40 tokens, but not her salt
    assert cached(PROMPTS[2], None) == 0  # nor does the unsalted scope see either
    assert cached(PROMPTS[1] + [0], "alice") == 32
    assert cached(PROMPTS[2] + [0], "bob") == 32
    with pytest.raises(ConfigError, match="cache_salt"):
        GenerationConfig(cache_salt="")


@pytest.mark.skipif(
    not int8dot.available() or not native._packing_works(torch.randn(8, 8).bfloat16()),
    reason="needs the int8dot kernels and oneDNN's bf16 packing",
)
def test_a_prefix_computed_on_another_kernel_path_is_not_reused(tmp_path):
    """A target reading prompt chunks of 32+ rows on bf16 copies computed a long prompt's rows
    there; a short prompt's rows are computed on the int8dot kernels, so its start must not come
    from the long prompt's entry even though the tokens agree (it would change its bits)."""
    from helpers import wide_checkpoint

    wide_checkpoint(tmp_path)
    target = NativeCausalLM.from_pretrained(tmp_path, quant="w4a8", prompt_copies=True)
    assert target.caps.prefix_rest == native.PROMPT_ROWS_MIN
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 16, (40,), generator=g).tolist()
    long, short = shared + [1, 2, 3, 4, 5, 6, 7], shared[:20] + [8, 9, 10]  # 46 and 22 rows to prefill
    config = GenerationConfig(max_new_tokens=6, logprobs=2)
    cold = _runs(Decoder(target, None, prefix_cache_mb=0), [short, long], config)
    warm = _runs(Decoder(target, None), [long, short, long + [0, 1]], config)
    assert warm[1][:2] == cold[0][:2]  # tokens and logprobs bitwise as without the store
    assert warm[0][:2] == cold[1][:2]
    # The long prompt's rows serve a prompt whose rows are on its path (16 of 48, so that 32 rows
    # after them stay on the copies), never the short one's.
    assert [c for *_, c in warm] == [0, 0, 16]


# -- a draft model's own store -----------------------------------------------------------------
def _draft_pair(folder, dtype=torch.float32):
    from specdecode.proposers import DraftModelProposer

    target = NativeCausalLM.from_pretrained(folder, dtype=dtype)
    draft = NativeCausalLM.from_pretrained(folder, dtype=dtype)  # its own instance (and store)
    return target, draft, DraftModelProposer(draft)


def test_a_draft_reads_from_its_own_store_and_writes_its_cache_bitwise_as_a_cold_read(folder):
    """The draft's read of a prompt whose start an earlier request's draft read: the stored
    positions are copied (to a multiple of 16 in fp32) and the cache equals a cold read's."""
    from specdecode.models.prefix_cache import PrefixScope

    _, draft, proposer = _draft_pair(folder)
    scope = PrefixScope(PrefixCache(1 << 20, align=16))
    first = proposer.start(PROMPTS[0], prefix_scope=scope)
    first.catch_up(PROMPTS[0] + [1])
    second = proposer.start(PROMPTS[1], prefix_scope=scope)
    n = len(PROMPTS[1])
    assert second.reads(PROMPTS[1] + [1], 0) == n + 1 - 32  # the engine prices the read by what is left
    second.catch_up(PROMPTS[1] + [1])
    assert second.reads(PROMPTS[1] + [1, 2, 3], n) == 3  # what was committed since, the last one included
    cold = proposer.start(PROMPTS[1])
    cold.catch_up(PROMPTS[1] + [1])
    assert (first.stats(), second.stats(), cold.stats()) == (
        {"draft_cached_tokens": 0},
        {"draft_cached_tokens": 32},
        {"draft_cached_tokens": 0},
    )
    assert second.cache.length == cold.cache.length == n
    assert torch.equal(second.cache.keys[..., :n, :], cold.cache.keys[..., :n, :])
    assert torch.equal(second.cache.values[..., :n, :], cold.cache.values[..., :n, :])
    other = proposer.start(PROMPTS[2], prefix_scope=PrefixScope(scope.store, salt="alice"))
    other.catch_up(PROMPTS[2] + [1])
    assert other.stats() == {"draft_cached_tokens": 0}  # stored unsalted: another scope


def test_a_draft_store_that_ignored_the_alignment_would_be_caught(folder):
    """The broken variant: an fp32 draft's positions reused at any length differ in their last
    bits from a cold read's, which the comparison above sees."""
    from specdecode.models.prefix_cache import PrefixScope

    _, draft, proposer = _draft_pair(folder)
    draft.caps = dataclasses.replace(draft.caps, prefix_align=1)
    scope = PrefixScope(PrefixCache(1 << 20, align=16))
    proposer.start(PROMPTS[0], prefix_scope=scope).catch_up(PROMPTS[0] + [1])
    second = proposer.start(PROMPTS[1], prefix_scope=scope)
    second.catch_up(PROMPTS[1] + [1])
    cold = proposer.start(PROMPTS[1])
    cold.catch_up(PROMPTS[1] + [1])
    assert second.stats() == {"draft_cached_tokens": 40}
    n = len(PROMPTS[1])  # the rows read after the 40 copied ones, from offset 40, not 0
    assert not torch.equal(second.cache.keys[..., :n, :], cold.cache.keys[..., :n, :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS, ids=["greedy", "sampled"])
def test_a_draft_models_store_keeps_every_token_and_logprob_of_a_conversation(folder, dtype, config):
    """Draft-model decoding over a system prompt and a conversation's next turn: the same tokens,
    logprobs and sampled draws with the stores on and off. The draft stores whole turns where its
    rows are exact (bf16), else its prompt reads."""
    target, _, proposer = _draft_pair(folder, dtype)
    config = dataclasses.replace(config, max_new_tokens=24)  # a first turn past 64 positions

    def conversation(decoder):
        out = _runs(decoder, PROMPTS[:2], config)
        turn = PROMPTS[1] + out[1][0] + [0, 1, 2, 3]
        run = decoder.run(turn, config)
        events = list(run)
        result = run.result()
        return out + [(result.token_ids, [e.logprobs for e in events], result.stats["cached_tokens"])], result.stats

    cold, cold_stats = conversation(Decoder(target, proposer, k=3, prefix_cache_mb=0))
    decoder = Decoder(target, proposer, k=3)
    warm, stats = conversation(decoder)
    assert [(t, lp) for t, lp, _ in warm] == [(t, lp) for t, lp, _ in cold]
    assert cold_stats["draft_cached_tokens"] == 0
    assert [c for *_, c in warm][:2] == [0, 32]
    assert stats["draft_cached_tokens"] == (64 if proposer.model.caps.row_exact else 48)  # 73 in turn 1
    drafts = decoder.prefixes.companion_stats()  # the draft's store sits beside the target's
    assert drafts["bytes"] > 0 and drafts["hit_tokens"] >= stats["draft_cached_tokens"]
    assert decoder.engine().kv_usage()["draft_prefix_bytes"] == drafts["bytes"]
