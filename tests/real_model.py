"""The embedded default model (SmolLM2-135M-Instruct), loaded once per test session."""

from __future__ import annotations

import functools
from pathlib import Path

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the factorial of n.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not react. The fox ran away.",
    "List three uses of copper.",
    "Translate to English: Der Hund schläft im Garten.",
    "Explain photosynthesis to a child.",
    "Repeat this sentence exactly: speculative decoding keeps outputs identical.",
    "If I have 3 apples and buy 5 more, how many do I have?",
    "Write a haiku about the sea.",
    "Rewrite with type hints:\ndef add(a, b):\n    return a + b",
    "Give me a JSON object with keys name and age for a person called Ann aged 31.",
]


@functools.lru_cache(maxsize=None)
def default_target(backend: str = "auto", dtype: str = "float32"):
    from specdecode.models.loading import load_model

    return load_model(None, dtype=dtype, backend=backend)


@functools.lru_cache(maxsize=None)
def truncated_draft_dir(layers: int, root: str) -> Path:
    """A real, different draft sharing the tokenizer: the default model's first ``layers`` layers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdecode.models.loading import resolve_model_dir

    src = resolve_model_dir(None)
    out = Path(root) / f"smollm2-{layers}l"
    model = AutoModelForCausalLM.from_pretrained(src)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def chat_ids(loaded, prompt: str) -> list[int]:
    tok = loaded.tokenizer
    enc = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])
