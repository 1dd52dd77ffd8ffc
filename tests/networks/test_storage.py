"""Where shipped drafters and measurement cards are found for a target."""

from __future__ import annotations

import pytest

from specdecode.networks.storage import drafter_name


@pytest.mark.parametrize(
    "source, name",
    [
        ("/cache/models/SmolLM2-135M-Instruct.Q4_1-efc2904d2010", "smollm2-135m-instruct"),
        ("/cache/models/qwen2.5-coder-1.5b-instruct-q4_k_m-b55e8ef979ec", "qwen2.5-coder-1.5b-instruct"),
        ("/cache/models/qwen2.5-coder-0.5b-instruct-q4_k_m-0123456789ab", "qwen2.5-coder-0.5b-instruct"),
        ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("/m/Llama-3-8B.f16", "llama-3-8b"),
    ],
)
def test_drafter_name_drops_the_cache_hash_and_the_quantization_only(source, name):
    """A dot inside the model's own name (Qwen2.5) is kept: 1.5B and 0.5B get different folders."""
    assert drafter_name(source) == name
