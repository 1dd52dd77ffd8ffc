"""Prompt chunks on bf16 copies of the quantized matrices: a chunk gives the same rows alone and
in any batch, tracks the int8dot path, and rows that are not prompt chunks never touch a copy."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import int8dot, native
from specdecode.models.native import PROMPT_ROWS_MIN, NativeCausalLM
from specdecode.models.quant import _w4a8, _w8a8g

needs_copies = pytest.mark.skipif(
    not int8dot.available() or not native._packing_works(torch.randn(8, 8).bfloat16()),
    reason="needs the int8dot kernels and oneDNN's bf16 packing",
)


@pytest.mark.parametrize("out", [40, 1100])
def test_dequantized_in_blocks_equals_reading_every_row(out):
    """The copy is made from exactly the values the kernels use, tiles padded or not."""
    g = torch.Generator().manual_seed(out)
    scale = torch.rand(out, 3, generator=g)
    m4 = _w4a8((out, 96), torch.randint(0, 16, (out, 96), dtype=torch.uint8, generator=g), scale, scale * 0.1)
    q8 = torch.randint(-127, 128, (out, 96), dtype=torch.int8, generator=g)
    m8 = _w8a8g((out, 96), q8, torch.rand(out, generator=g))
    for m in (m4, m8):
        every = m.rows(torch.arange(out))
        assert torch.equal(m.dequantized(block=64), every)
        staging = torch.empty(out * 96 + 7, dtype=torch.bfloat16)
        assert torch.equal(m.dequantized(torch.bfloat16, into=staging), every.to(torch.bfloat16))


def _models(tmp_path):
    from helpers import wide_checkpoint

    wide_checkpoint(tmp_path)
    plain = NativeCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quant="w4a8", prompt_copies=False)
    copies = NativeCausalLM.from_pretrained(tmp_path, dtype=torch.float32, quant="w4a8", prompt_copies=True)
    return plain, copies


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(seed))


@needs_copies
def test_a_prompt_chunk_gives_the_same_cache_alone_and_in_a_batch(tmp_path):
    """Exactness in a batch needs each chunk's rows independent of what shares its forward: a
    chunk alone, and beside another chunk and a decoding row, writes bitwise the same cache."""
    _, model = _models(tmp_path)
    assert "bf16" in model.kernels()["prompt chunks"]
    chunks = [_ids(PROMPT_ROWS_MIN + 2, 3), _ids(PROMPT_ROWS_MIN + 9, 1)]
    alone = [model.new_cache(64) for _ in chunks]
    for ids, cache in zip(chunks, alone):
        model.forward_rows([ids], [cache], keep=[0])
    caches = [model.new_cache(64) for _ in range(3)]
    model.forward_rows([_ids(3, 2)], [caches[2]])
    model.forward_rows([*chunks, _ids(1, 4)], caches, keep=[0, 0, 1])
    nxt = torch.tensor([5])
    for ids, a, b in zip(chunks, alone, caches):
        n = ids.numel()
        assert torch.equal(a.keys[:, :, :, :n], b.keys[:, :, :, :n])
        assert torch.equal(a.values[:, :, :, :n], b.values[:, :, :, :n])
        assert torch.equal(model.forward_rows([nxt], [a])[0], model.forward_rows([nxt], [b])[0])


@needs_copies
def test_prompt_copies_track_the_int8dot_path_and_leave_other_rows_alone(tmp_path):
    """The copies change a prompt's keys and values by bf16 rounding only; decode rows and
    chunks shorter than PROMPT_ROWS_MIN run on the int8dot kernels, bitwise as before."""
    plain, copies = _models(tmp_path)
    n = PROMPT_ROWS_MIN + 5
    a, b = plain.new_cache(64), copies.new_cache(64)
    plain.forward_rows([_ids(n, 7)], [a], keep=[0])
    copies.forward_rows([_ids(n, 7)], [b], keep=[0])
    ka, kb = a.keys[:, :, :, :n], b.keys[:, :, :, :n]
    assert not torch.equal(ka, kb) and (ka - kb).norm() < 0.05 * ka.norm()
    la, lb = plain.forward_rows([torch.tensor([3])], [a])[0], copies.forward_rows([torch.tensor([3])], [b])[0]
    assert (la - lb).norm() < 0.05 * la.norm()
    short = PROMPT_ROWS_MIN - 1
    for keep in ([0], [short]):  # a short chunk, and every row wanting logits (a verify or forward())
        a, b = plain.new_cache(64), copies.new_cache(64)
        out_a = plain.forward_rows([_ids(short, 8)], [a], keep=keep)[0]
        out_b = copies.forward_rows([_ids(short, 8)], [b], keep=keep)[0]
        assert torch.equal(out_a, out_b) and torch.equal(a.keys[:, :, :, :short], b.keys[:, :, :, :short])


def test_the_environment_decides(monkeypatch):
    monkeypatch.setenv(native.PROMPT_COPIES_ENV, "0")
    assert native.prompt_copies_pay() is False
    monkeypatch.setenv(native.PROMPT_COPIES_ENV, "1")
    assert native.prompt_copies_pay() is True


def test_copies_asked_for_where_the_cpu_cannot_pack_bf16_are_a_clear_error(tmp_path, monkeypatch):
    """Forcing copies on a CPU without oneDNN's bf16 packing (AVX2 without AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT) names the problem at load, not deep in the first prompt's forward."""
    from helpers import wide_checkpoint
    from specdecode.errors import ModelLoadError

    wide_checkpoint(tmp_path)
    monkeypatch.setattr(native, "_packing_works", lambda sample: False)
    with pytest.raises(ModelLoadError, match="bf16 prompt copies"):
        NativeCausalLM.from_pretrained(tmp_path, quant="w4a8", prompt_copies=True)
    monkeypatch.setenv(native.PROMPT_COPIES_ENV, "1")
    with pytest.raises(ModelLoadError, match="bf16 prompt copies"):
        NativeCausalLM.from_pretrained(tmp_path, quant="w4a8")
