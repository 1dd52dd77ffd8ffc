"""``specdecode bench-decode`` building blocks on a tiny native model (speed is never asserted)."""

from __future__ import annotations

import pytest

from helpers import tiny_native
from specdecode.bench.decode import (
    BATCH_SIZES,
    K_VALUES,
    Prompt,
    _curve_models,
    agreement,
    batch_throughput,
    forward_curve,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_curve_and_batched_throughput_cover_every_size():
    model = tiny_native(vocab=16)
    curve = forward_curve(model, reps=1, context=8)
    assert set(curve["ratio"]) == set(K_VALUES) and curve["ratio"][1] == 1.0 and curve["k1_ms"] > 0
    prompts = [Prompt("x", [1, 2, 3]), Prompt("y", [4, 5])]
    rates = batch_throughput(model, prompts, 4)
    assert set(rates) == set(BATCH_SIZES) and all(r > 0 for r in rates.values())


def test_curve_models_add_a_batched_attention_bf16_sharing_weights():
    model = tiny_native(vocab=16)
    both = _curve_models({"fp32": model, "bf16": model})
    assert both["bf16 batched attention"].weights is model.weights
    assert both["bf16 batched attention"]._dims.row_exact is False


def test_agreement_stops_at_eos_and_reports_divergence():
    got = agreement([[1, 2, 9, 4], [1, 2, 3]], [[1, 2, 9, 7], [1, 5, 3]], stop=(9,))
    assert got == {"identical": 1, "of": 2, "first_divergence": [1]}
