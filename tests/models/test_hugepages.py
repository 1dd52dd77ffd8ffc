"""Weights copied into one huge-page arena at load: same bytes, same outputs, one mapping."""

from __future__ import annotations

import mmap

import pytest
import torch

from specdecode.models import hugepages, int8dot
from specdecode.models.native import NativeCausalLM, into_huge_pages
from specdecode.models.quant import QuantMatrix, act_dtype

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")


def test_the_os_mode_is_read_from_its_bracket(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_MODE", f)
    assert hugepages.mode() == "madvise"
    f.write_text("always madvise [never]\n")
    assert hugepages.mode() == "never" and not hugepages.available()
    monkeypatch.setattr(hugepages, "THP_MODE", tmp_path / "missing")
    assert hugepages.mode() is None and not hugepages.available()


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.available()
    assert hugepages.Arena.sized_for([torch.ones(4)]) is None


@needs_madvise
def test_an_arena_copies_bytes_on_cache_lines_and_refuses_overflow():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int8), torch.randn(2, 2).bfloat16()]
    arena = hugepages.Arena(sum(hugepages._span(t) for t in tensors))
    copies = [arena.take(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.is_contiguous()
        assert c.data_ptr() % hugepages.ALIGN == 0 and c.data_ptr() != t.data_ptr()
    assert copies[0].data_ptr() % hugepages.HUGE == 0  # the first tensor opens a 2 MiB-aligned span
    with pytest.raises(ValueError, match="more bytes"):
        arena.take(torch.ones(1))


def test_only_dense_cpu_tensors_are_placed():
    assert hugepages.placeable(torch.ones(3))
    assert not hugepages.placeable(torch.ones(4, 4).t())  # not contiguous
    assert not hugepages.placeable(torch.ones(0)) and not hugepages.placeable(None)
    assert not hugepages.placeable(torch.ones(4, 4).to_mkldnn())


def _kinds() -> list[str | None]:
    return [None, "int8"] + (["w4a8", "w8a8g"] if int8dot.available() else [])


@needs_madvise
@pytest.mark.parametrize("case", ["llama-tied-gqa-llama3", "qwen2-qkv-bias"])
@pytest.mark.parametrize("kind", _kinds())
def test_a_model_in_huge_pages_gives_bitwise_the_same_logits(tmp_path, monkeypatch, case, kind):
    from test_native import make_checkpoint

    folder, _ = make_checkpoint(tmp_path, case)
    dtype = torch.float32 if kind is None else act_dtype(kind)
    monkeypatch.setenv(hugepages.ENV, "0")
    plain = NativeCausalLM.from_pretrained(folder, dtype=dtype, quant=kind, pack=False)
    monkeypatch.setenv(hugepages.ENV, "1")
    if not hugepages.available():
        pytest.skip(f"transparent huge pages are {hugepages.mode()} here")
    huge = NativeCausalLM.from_pretrained(folder, dtype=dtype, quant=kind, pack=False)
    w = huge.weights
    assert (w.embed is w.lm_head) == (plain.weights.embed is plain.weights.lm_head)  # a tied head stays tied
    tensors = [w.norm, w.layers[0].ln1, w.layers[-1].wd]
    tensors = [t for v in tensors for t in (v.tensors if isinstance(v, QuantMatrix) else (v,))]
    arenas = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(arenas) == 1 and arenas != {plain.weights.norm.untyped_storage().data_ptr()}  # one mapping
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    assert torch.equal(plain.forward(ids, plain.new_cache(11)), huge.forward(ids, huge.new_cache(11)))


@needs_madvise
def test_moving_twice_keeps_values_and_packed_matrices_stay(tmp_path, monkeypatch):
    from test_native import make_checkpoint

    monkeypatch.setenv(hugepages.ENV, "1")
    folder, _ = make_checkpoint(tmp_path, "qwen2-qkv-bias")
    model = NativeCausalLM.from_pretrained(folder)  # oneDNN-packed matrices where this torch allows
    before = model.forward(torch.tensor([[3, 1, 4]]), model.new_cache(3))
    into_huge_pages(model.weights)
    assert torch.equal(model.forward(torch.tensor([[3, 1, 4]]), model.new_cache(3)), before)


@needs_madvise
def test_a_fresh_quantization_is_stored_then_placed_and_reads_back_the_same(tmp_path, monkeypatch):
    """The first load of a GGUF quantizes and writes the store, then moves into the arena (the
    arena's one storage viewed as several dtypes cannot be pickled); the second load reads the store."""
    from test_native import make_checkpoint

    from specdecode.models import native, quant_store

    folder, _ = make_checkpoint(tmp_path, "qwen2-qkv-bias")
    monkeypatch.setattr(native, "gguf_source", lambda _: folder / "model.gguf")  # stored as a GGUF's would be
    monkeypatch.setattr(native, "_tensor_source", lambda d, _: native._read_tensors(d))
    monkeypatch.setenv(hugepages.ENV, "1")
    kind = "w4a8" if int8dot.available() else "int8"
    first = NativeCausalLM.from_pretrained(folder, dtype=act_dtype(kind), quant=kind, pack=False)
    assert quant_store.store_path(folder, kind).exists()
    second = NativeCausalLM.from_pretrained(folder, dtype=act_dtype(kind), quant=kind, pack=False)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.equal(first.forward(ids, first.new_cache(5)), second.forward(ids, second.new_cache(5)))
