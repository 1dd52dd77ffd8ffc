"""Continuous batching: each sequence decodes exactly as it would alone.

Greedy outputs must equal one-at-a-time plain decoding (tiny native models and the real default
model); sampled outputs must follow the target's exact sequence law (Pearson chi-square at
ALPHA = 0.001, 20,000 sequences), and a wrong-temperature variant must be caught by the same test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from helpers import ALPHA, chi_square_pvalue, sequence_law, tiny_llama, tiny_native
from real_model import PROMPTS, chat_ids, default_target
from specdecode.core.sampling import SamplingConfig
from specdecode.engine import Decoder, GenerationConfig
from specdecode.engine.batch import generate_batch
from specdecode.errors import ConfigError, InputError

PROMPT = [1, 2, 3, 1, 2, 0, 1]
N_SAMPLES = 20_000

pytestmark = pytest.mark.usefixtures("one_thread")


def plain(model, prompt, n, eos=()):
    return Decoder(model, None, k=1, eos_token_ids=eos).generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids


def test_greedy_batch_equals_decoding_alone():
    target = tiny_native(vocab=16, seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6)]
    # max_batch 2: prompts join while others are mid-flight (prefill rows beside decode rows).
    got = generate_batch(target, prompts, 12, eos_token_ids=(5,), max_batch=2)
    assert got == [plain(target, p, 12, eos=(5,)) for p in prompts]
    assert any(len(g) < 12 for g in got) and all(g[-1] == 5 for g in got if len(g) < 12)


def _batch_pvalue(target, run_at: SamplingConfig, law_at: SamplingConfig, n_new: int = 3) -> float:
    rows = generate_batch(target, [PROMPT] * N_SAMPLES, n_new, sampling=run_at, max_batch=512,
                          generator=torch.Generator().manual_seed(0))
    return chi_square_pvalue(Counter(map(tuple, rows)), sequence_law(target, PROMPT, n_new, law_at))


def test_sampled_batch_follows_the_target_law():
    target = tiny_native(vocab=5, seed=0)
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    assert _batch_pvalue(target, cfg, cfg) > ALPHA


def test_wrong_temperature_is_caught():
    target = tiny_native(vocab=5, seed=0)
    law = SamplingConfig(temperature=1.0, top_k=4)
    assert _batch_pvalue(target, SamplingConfig(temperature=0.7, top_k=4), law) < ALPHA


def test_bad_input_is_refused():
    with pytest.raises(ConfigError, match="native backend"):
        generate_batch(tiny_llama(), [[1, 2]], 4)
    target = tiny_native()
    with pytest.raises(InputError, match="at least one token"):
        generate_batch(target, [[1], []], 4)
    with pytest.raises(ConfigError, match="max_batch"):
        generate_batch(target, [[1]], 4, max_batch=0)


@pytest.mark.slow
def test_real_model_batch_equals_plain_greedy():
    loaded = default_target(backend="native")
    prompts = [chat_ids(loaded, p) for p in PROMPTS[:3]]
    eos = loaded.eos_token_ids
    got = generate_batch(loaded.model, prompts, 24, eos_token_ids=eos, max_batch=2)
    assert got == [plain(loaded.model, p, 24, eos) for p in prompts]
