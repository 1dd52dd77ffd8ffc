"""GGUF weights read directly: names, llama.cpp's Q/K row order, and the real file (no fp32 copy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdecode.models.gguf_source import hf_name, unpermute_rope_rows


def test_names_follow_transformers():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama Q/K rows (convert_hf_to_gguf.py's ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads,head_dim", [(4, 8), (3, 64), (1, 2)])
def test_unpermute_undoes_llama_cpp(heads, head_dim):
    w = torch.randn(heads * head_dim, 5)
    permuted = _llama_cpp_permute(w, heads)
    assert not torch.equal(permuted, w) or head_dim == 2
    assert torch.equal(unpermute_rope_rows(permuted, heads), w)


# -- the embedded default model ---------------------------------------------------------------


@pytest.mark.slow
def test_embedded_gguf_equals_the_transformers_conversion():
    from safetensors.torch import load_file

    from specdecode.models.gguf_source import GGUFTensors
    from specdecode.models.loading import convert_gguf, default_gguf_path

    converted = load_file(str(convert_gguf(default_gguf_path()) / "model.safetensors"))
    source = GGUFTensors(default_gguf_path(), heads=9, kv_heads=3)
    names = source.names()
    assert len(names) == 30 * 9 + 2  # 9 tensors a layer, the embedding, the final norm (tied head)
    for name in names:
        mine = source.pop(name)
        theirs = converted["lm_head.weight" if name == "model.embed_tokens.weight" else name]
        assert torch.equal(mine, theirs), name


_PEAK = """
import json, resource, sys, torch
from specdecode.models.loading import load_model
loaded = load_model(sys.argv[1] if sys.argv[1] != "-" else None, dtype=sys.argv[2])
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "source": loaded.source, "quant": loaded.model.quant}))
"""


@pytest.mark.slow
def test_native_load_reads_the_gguf_without_a_float32_copy(tmp_path):
    """A fresh cache: the native backend makes config and tokenizer only, never model.safetensors,
    and peak memory stays below what a float32 copy would add (540 MB on top of the weights)."""
    from specdecode.models.loading import default_gguf_path

    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"}
    base = subprocess.run(
        [sys.executable, "-c", _PEAK.split("loaded =")[0] + "import transformers\n" + _BASE],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    baseline = json.loads(base.stdout)["peak_mb"]
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, str(default_gguf_path()), "bfloat16"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    folders = list((tmp_path / "specdecode" / "models").iterdir())
    assert len(folders) == 1 and out["source"] == str(folders[0])
    assert (folders[0] / "config.json").exists() and not list(folders[0].glob("*.safetensors"))
    # Measured here: +620 MB (tokenizer 110, bf16 weights 270, the mapped file, one float32
    # tensor at a time); the old path held the 540 MB float32 model on top of that.
    assert out["quant"] is None and out["peak_mb"] - baseline < 800, (out, baseline)


_BASE = """
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def test_auto_dtype_picks_w4a8_for_a_four_bit_gguf_where_the_kernels_build(monkeypatch):
    """``dtype="auto"``: the embedded file is Q4_1 and Q8_0, so w4a8 where int8dot builds (a
    draft: w4a8-lossy), else float32; the transformers backend and float files always get float32."""
    from specdecode.models import int8dot, loading
    from specdecode.models.gguf_source import quantized_share

    folder = loading.resolve_model_dir(None, weights=False)
    assert quantized_share(loading.default_gguf_path()) > 0.99
    assert loading.auto_dtype(folder) == ("w4a8" if int8dot.available() else "float32")
    assert loading.auto_dtype(folder, backend="transformers") == "float32"
    # a draft's error costs only acceptance: every matrix in 4 bits
    assert loading.auto_dtype(folder, draft=True) == ("w4a8-lossy" if int8dot.available() else "float32")
    monkeypatch.setattr(int8dot, "available", lambda: False)
    assert loading.auto_dtype(folder, draft=True) == "float32"
    assert loading.auto_dtype(folder) == "float32"
    monkeypatch.setattr(int8dot, "available", lambda: True)
    monkeypatch.setattr(loading, "gguf_source", lambda _: None)  # a transformers folder
    assert loading.auto_dtype(folder) == "float32"
