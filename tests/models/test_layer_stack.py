"""Every layer in one C++ call (csrc/layers.cpp): bitwise what the Python layer loop gives, on
every kind of forward (prompt chunks, decode, verify, a tree, ragged rows of several sequences,
the last layer's features), for 4-bit and 8-bit matrices and a QKV bias; the loop stays where the
stack would not compute the same thing."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import int8dot, quant
from specdecode.models.native import LAYER_STACK_ENV, NativeCausalLM, layer_stack

pytestmark = pytest.mark.skipif(not int8dot.available(), reason=f"int8dot: {int8dot.unavailable_reason()}")

VOCAB = 96


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen2 (QKV bias) whose shapes the fused kernels take: head dim 16, whole tiles."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("stack")
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers zero-initialises biases; make them matter
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def _pair(folder, kind: str, monkeypatch) -> tuple[NativeCausalLM, NativeCausalLM]:
    """(the model on its stack, a twin on the same weights that keeps the Python loop)."""
    model = NativeCausalLM.from_pretrained(folder, dtype=torch.float32, quant=kind)
    twin = NativeCausalLM(model.config, model.weights, model.dtype, quant=model.quant)
    monkeypatch.setenv(LAYER_STACK_ENV, "0")
    assert twin.kernels()["layers"] == "Python loop"
    monkeypatch.delenv(LAYER_STACK_ENV)
    assert model.kernels()["layers"] == "one int8dot LayerStack call"
    return model, twin


@pytest.mark.parametrize("kind", ["w4a8", quant.LOSSY])
def test_the_stack_gives_bitwise_the_loops_logits(folder, kind, monkeypatch):
    """w4a8 keeps these random (off-grid) matrices in 8 bits, w4a8-lossy puts them in 4."""
    from specdecode.models.native import quant_matrices

    model, twin = _pair(folder, kind, monkeypatch)
    kinds = {m.kind for m in quant_matrices(model.weights)}
    assert kinds == ({"w8a8g"} if kind == "w4a8" else {"w4a8"})
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (1, 40), generator=g)
    caches = [model.new_cache(64), twin.new_cache(64)]
    for chunk in (ids[:, :17], ids[:, 17:30], ids[:, 30:31], ids[:, 31:40]):  # prompt, prompt, decode, verify
        got, want = (m.forward(chunk, c) for m, c in zip((model, twin), caches))
        assert torch.equal(got, want)
    assert torch.equal(caches[0].keys[:, :, :, :40], caches[1].keys[:, :, :, :40])
    # a tree: two branches off the same root, each row sees only its ancestors
    tree = torch.randint(0, VOCAB, (1, 3), generator=g)
    mask = torch.ones(3, 43, dtype=torch.bool)
    mask[1, 42] = mask[2, 41] = False
    pos = torch.tensor([40, 41, 41])
    got, want = (m.forward(tree, c, positions=pos, attn_mask=mask) for m, c in zip((model, twin), caches))
    assert torch.equal(got, want)


def test_ragged_rows_and_features_are_the_loops(folder, monkeypatch):
    from test_native import ragged_rows

    model, twin = _pair(folder, quant.LOSSY, monkeypatch)
    runs = []
    for m in (model, twin):
        _, news, caches, alone = ragged_rows(m, vocab=VOCAB)
        logits, hidden = m.forward_rows(news, caches, return_hidden=True)
        assert all(torch.equal(a, b) for a, b in zip(logits, alone))  # each row as it gives alone
        runs.append((logits, hidden))
    (la, ha), (lb, hb) = runs
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for a, b in zip(ha, hb))


def test_the_loop_stays_where_the_stack_would_differ(folder):
    """A float model, a model whose matmuls go through another ``linear``, and a matrix with
    padded columns all keep the Python loop."""
    import dataclasses

    assert NativeCausalLM.from_pretrained(folder, dtype=torch.float32)._layer_stack() is None
    model = NativeCausalLM.from_pretrained(folder, dtype=torch.float32, quant=quant.LOSSY)
    assert layer_stack(model.weights, model._dims) is not None
    wrapped = dataclasses.replace(model.weights, linear=lambda x, w, b: quant.quant_linear(x, w, b))
    assert layer_stack(wrapped, model._dims) is None
    layer = model.weights.layers[0]
    odd = quant.quantize_matrix(torch.randn(48, 64), quant.LOSSY)  # 48 outputs: padded to 64
    padded = dataclasses.replace(model.weights, layers=[dataclasses.replace(layer, wo=odd)])
    assert layer_stack(padded, model._dims) is None
