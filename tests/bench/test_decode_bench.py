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


def test_ops_and_matrix_bytes_count_float_and_quantized_models(tmp_path):
    import torch
    from models.test_native import make_checkpoint

    from specdecode.bench.decode import matrix_bytes, ops_per_token
    from specdecode.models.native import NativeCausalLM

    folder, _ = make_checkpoint(tmp_path, "qwen2-qkv-bias")
    fp32 = NativeCausalLM.from_pretrained(folder)
    int4 = NativeCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quant="int4")
    assert ops_per_token(fp32) > 10 and ops_per_token(int4) > 10
    assert 0 < matrix_bytes(int4) < matrix_bytes(fp32)


def test_bad_dtype_list_and_missing_llama_bench_are_reported(tmp_path, capsys):
    from specdecode.bench.decode import llama_bench, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--dtypes", "fp32,int3"])
    assert "unknown dtype 'int3'" in capsys.readouterr().err
    assert "not a GGUF" in llama_bench("/nonexistent/llama-bench", tmp_path, 1, 4)["error"]


def test_a_4k_pages_variant_loads_the_same_weights_off_huge_pages(tmp_path):
    import argparse

    import torch
    from models.test_native import make_checkpoint

    from specdecode.bench.decode import build_variants, parse_args
    from specdecode.models import hugepages

    assert parse_args(["--dtypes", "fp32,fp32@4k"]).dtypes == ["fp32", "fp32@4k"]
    folder, _ = make_checkpoint(tmp_path, "qwen2-qkv-bias")
    args = argparse.Namespace(no_transformers=True, dtypes=["fp32", "fp32@4k"], compile=False, quick=True)
    runners, natives = build_variants(args, folder, 1)
    assert set(natives) == {"fp32", "fp32@4k"} and "native fp32@4k" in runners
    assert hugepages.resident_huge_bytes(natives["fp32@4k"].weights.norm) == 0
    assert runners["native fp32"]([1, 2, 3], 4) == runners["native fp32@4k"]([1, 2, 3], 4)
    assert torch.equal(natives["fp32"].weights.norm, natives["fp32@4k"].weights.norm)
