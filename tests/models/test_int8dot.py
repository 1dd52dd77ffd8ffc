"""The int8dot kernels (AVX-512 VNNI or AVX2, whichever this machine builds) against plain torch:
activation rounding, packing, the two matmuls over 1..19 rows (row by row bitwise equal to the
whole call), sums at the integer limits, cutting a head's rows, and, on a machine with both
instruction sets, the two builds bitwise equal."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import int8dot, quant

pytestmark = pytest.mark.skipif(not int8dot.available(), reason=f"int8dot: {int8dot.unavailable_reason()}")

# Stated tolerance: the kernel against the same rounded activations times the dequantized matrix
# in float64; only the fp32 summation differs (relative Frobenius error).
RTOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int4(out: int, n_in: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    q = torch.randint(0, 16, (out, n_in), generator=g, dtype=torch.uint8)
    scale = (torch.rand(out, n_in // 32, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    zero = (torch.randn(out, n_in // 32, generator=g) * 0.05).to(torch.bfloat16)
    return q, scale, zero


def _rounded(x: torch.Tensor) -> torch.Tensor:
    xq, dx = int8dot.reference_activations(x)
    return (xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_activation_rounding_matches_plain_torch():
    x = torch.randn(7, 256, generator=_gen(1)) * torch.logspace(-3, 3, 256)  # outliers in some groups
    x[2] = 0.0  # a zero row: scale 0, every value 0
    x[3, :32] = 1e-30
    xq, dx, xs = int8dot.quantize_activations(x)
    ref_q, ref_dx = int8dot.reference_activations(x)
    assert torch.equal(xq, ref_q) and torch.equal(dx, ref_dx)
    assert torch.equal(xs, ref_q.reshape(7, -1, 32).int().sum(-1))
    assert int(xq.abs().max()) == 127 and torch.equal(xq[2], torch.zeros_like(xq[2]))


@pytest.mark.parametrize("shape", [(32, 32), (96, 96), (256, 1536)])
def test_packing_round_trips(shape):
    q, scale, zero = _int4(*shape)
    back = int8dot.unpack_u4(int8dot.pack_u4(q, scale, zero), *shape)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, scale, zero)))
    q8 = torch.randint(-128, 128, shape, generator=_gen(2), dtype=torch.int8)
    assert torch.equal(int8dot.unpack_u8(int8dot.pack_u8(q8), *shape), q8)


@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (512, 1536), (32, 8960)])
def test_u4_matches_reference_and_rows_are_independent(shape):
    q, scale, zero = _int4(*shape, seed=shape[0])
    packed = int8dot.pack_u4(q, scale, zero)
    x = torch.randn(19, shape[1], generator=_gen(3))
    y = int8dot.u4_mm(x, packed, shape)
    w = quant.dequantize_int4(q, scale, zero).double()
    assert y.dtype == torch.float32 and y.shape == (19, shape[0])
    assert _rel(y, _rounded(x) @ w.t()) < RTOL
    for n in (1, 2, 5, 8, 9, 16):  # every register block size and a remainder
        assert torch.equal(int8dot.u4_mm(x[:n].contiguous(), packed, shape), y[:n])


@pytest.mark.parametrize("shape", [(16, 32), (64, 96), (1024, 576)])
def test_u8_matches_reference_and_rows_are_independent(shape):
    q = torch.randint(-128, 128, shape, generator=_gen(4), dtype=torch.int8)
    scale = torch.rand(shape[0], generator=_gen(5)) * 0.01
    packed = int8dot.pack_u8(q)
    x = torch.randn(19, shape[1], generator=_gen(6))
    y = int8dot.u8_mm(x, packed, scale, shape)
    assert _rel(y, _rounded(x) @ (q.double() * scale.double()[:, None]).t()) < RTOL
    for n in (1, 3, 8, 11):
        assert torch.equal(int8dot.u8_mm(x[:n].contiguous(), packed, scale, shape), y[:n])


def test_bad_inputs_are_refused_with_a_reason():
    packed = int8dot.pack_u4(*_int4(32, 64))
    with pytest.raises(RuntimeError, match="float32"):
        int8dot.u4_mm(torch.ones(1, 64, dtype=torch.bfloat16), packed, (32, 64))
    with pytest.raises(RuntimeError, match="x has 32 inputs, the matrix 64"):
        int8dot.u4_mm(torch.ones(1, 32), packed, (32, 64))
    with pytest.raises(RuntimeError, match="wrong size"):
        int8dot.u4_mm(torch.ones(1, 64), packed, (64, 64))
    with pytest.raises(RuntimeError, match="out % 32 == 0"):
        int8dot.pack_u4(*_int4(16, 64))


@pytest.mark.parametrize("kind", ["w4a8", "w8a8g"])
def test_cut_rows_give_bitwise_the_same_logits(kind):
    """A reduced draft head: the kept rows (an odd count, so the cut is padded to whole tiles)
    score exactly as they did in the full head."""
    w = quant.dequantize_int4(*_int4(96, 64)) if kind == "w4a8" else torch.randn(96, 64, generator=_gen(7))
    m = quant.quantize_matrix(w, kind)
    assert m.kind == kind
    ids = torch.tensor([0, 3, 5, 17, 40, 95, 64])
    cut = quant.select_rows(m, ids)
    assert cut.kind == kind and cut.shape == (7, 64)
    x = torch.randn(4, 64, generator=_gen(8))
    assert torch.equal(cut(x), m(x)[:, ids])


def _python_attention(qkv, cos, sin, keys, values, start, mask, hq, hkv):
    """The native path's own ops (rotate-half RoPE, cache write, SDPA) as the reference."""
    from specdecode.models.native import _rotate

    n, d = qkv.shape[0], keys.shape[-1]
    qk = _rotate(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos[:, None], sin[:, None])
    keys[:, start : start + n] = qk[:, hq:].transpose(0, 1)
    values[:, start : start + n] = qkv[:, (hq + hkv) * d :].view(n, hkv, d).transpose(0, 1)
    q = qk[:, :hq].transpose(0, 1)[None]
    if mask is None:
        mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(),
        keys[None, :, : start + n].double(),
        values[None, :, : start + n].double(),
        attn_mask=mask[None, None],
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(n, hq * d).float()


@pytest.mark.parametrize(("hq", "hkv", "d"), [(12, 2, 128), (9, 3, 64), (6, 2, 80), (4, 4, 16)])
@pytest.mark.parametrize(("start", "n"), [(0, 7), (37, 1), (200, 5), (3, 37)])
def test_attention_matches_sdpa_and_rows_are_independent(hq, hkv, d, start, n):
    from specdecode.models.rope import cos_sin

    g = _gen(start + n)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    cache = torch.randn(2, hkv, 256, d, generator=g)
    freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = cos_sin(freq, torch.arange(start, start + n), torch.float32)
    ref_cache = cache.clone()
    want = _python_attention(qkv, cos, sin, ref_cache[0], ref_cache[1], start, None, hq, hkv)
    got = int8dot.attend_rows(qkv, cos, sin, cache[0], cache[1], start, None, hq, hkv)
    assert torch.allclose(cache, ref_cache, atol=1e-6)  # the rows' rotated keys and values stored
    assert _rel(got, want) < RTOL
    for i in range(n):  # each row alone, after the rows before it: bitwise the same
        alone = cache.clone()
        alone[:, :, start + i :] = 0.0
        int8dot.attend_rows(qkv[:i].contiguous(), cos[:i], sin[:i], alone[0], alone[1], start, None, hq, hkv)
        one = int8dot.attend_rows(
            qkv[i : i + 1].contiguous(),
            cos[i : i + 1].contiguous(),
            sin[i : i + 1].contiguous(),
            alone[0],
            alone[1],
            start + i,
            None,
            hq,
            hkv,
        )
        assert torch.equal(one[0], got[i])


def test_attention_follows_a_tree_mask():
    """Row 2 sees the cache, row 0 and itself only (a sibling branch): as SDPA with that mask."""
    from specdecode.models.rope import cos_sin

    hq, hkv, d, start, n = 4, 2, 32, 10, 3
    g = _gen(11)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    cache = torch.randn(2, hkv, 32, d, generator=g)
    cos, sin = cos_sin(torch.rand(d // 2), torch.tensor([10, 11, 11]), torch.float32)
    mask = torch.ones(n, start + n, dtype=torch.bool)
    mask[:, start:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    ref_cache = cache.clone()
    want = _python_attention(qkv, cos, sin, ref_cache[0], ref_cache[1], start, mask, hq, hkv)
    got = int8dot.attend_rows(qkv, cos, sin, cache[0], cache[1], start, mask, hq, hkv)
    assert _rel(got, want) < RTOL


def test_masked_rows_over_several_row_blocks_are_each_what_they_give_alone():
    """A call's rows are split into blocks that pass over the cache together; with a mask (a
    tree of drafts) each row still gives bitwise what it gives alone over the positions it sees."""
    from specdecode.models.rope import cos_sin

    hq, hkv, d, start, n = 6, 2, 32, 50, 40
    g = _gen(12)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    cache = torch.randn(2, hkv, 128, d, generator=g)
    cos, sin = cos_sin(torch.rand(d // 2), torch.arange(start, start + n), torch.float32)
    mask = torch.rand(n, start + n, generator=g) < 0.6
    mask[:, start:] &= torch.ones(n, n, dtype=torch.bool).tril()  # a row sees no later row
    mask[:, start:] |= torch.eye(n, dtype=torch.bool)  # and always itself
    got = int8dot.attend_rows(qkv, cos, sin, cache[0], cache[1], start, mask, hq, hkv)
    assert _rel(got, _python_attention(qkv, cos, sin, cache[0].clone(), cache[1].clone(), start, mask, hq, hkv)) < RTOL
    for i in (0, 15, 16, 17, 39):
        one = int8dot.attend_rows(
            qkv[i : i + 1].contiguous(),
            cos[i : i + 1].contiguous(),
            sin[i : i + 1].contiguous(),
            cache[0].clone(),
            cache[1].clone(),
            start + i,
            mask[i : i + 1, : start + i + 1].contiguous(),
            hq,
            hkv,
        )
        assert torch.equal(one[0], got[i])


def test_attention_refuses_a_full_cache():
    with pytest.raises(RuntimeError, match="holds 4 positions, not 5"):
        int8dot.attend_rows(
            torch.zeros(2, 3 * 16),
            torch.zeros(2, 16),
            torch.zeros(2, 16),
            torch.zeros(1, 4, 16),
            torch.zeros(1, 4, 16),
            3,
            None,
            1,
            1,
        )


def test_row_blocks_change_no_bit():
    """Every row block size (rows sharing one pass over a tile) gives bitwise the same result."""
    shape = (96, 96)
    packed = int8dot.pack_u4(*_int4(*shape, seed=9))
    x = torch.randn(7, shape[1], generator=_gen(10))
    want = int8dot.u4_mm(x, packed, shape)
    for block in range(1, 9):
        assert torch.equal(int8dot.u4_mm(x, packed, shape, block), want)


def test_sums_at_the_integer_limits_are_exact():
    """The largest products either instruction set sums: 4-bit weights 15 (and 0) and 8-bit
    weights -128 and 127 times activations all +-127, so AVX2's int16 pair sums sit at their
    bound (8 * 2 * 15 * 127 = 30480 per 4-bit group, 2 * 128 * 127 per 8-bit pair) and must not
    saturate."""
    n_in = 256
    x = torch.ones(4, n_in)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs
    x[3] = torch.where(torch.arange(n_in) % 3 == 0, -1.0, 1.0)
    q = torch.full((64, n_in), 15, dtype=torch.uint8)
    q[32:] = 0
    q[16:32, ::2] = 0
    scale = torch.full((64, n_in // 32), 0.5, dtype=torch.bfloat16)
    zero = torch.full((64, n_in // 32), 0.25, dtype=torch.bfloat16)
    y = int8dot.u4_mm(x, int8dot.pack_u4(q, scale, zero), (64, n_in))
    assert _rel(y, _rounded(x) @ quant.dequantize_int4(q, scale, zero).double().t()) < RTOL
    q8 = torch.full((32, n_in), 127, dtype=torch.int8)
    q8[:16] = -128
    q8[8:16, 1::2] = 127
    s8 = torch.full((32,), 0.01)
    y8 = int8dot.u8_mm(x, int8dot.pack_u8(q8), s8, (32, n_in))
    assert _rel(y8, _rounded(x) @ (q8.double() * s8.double()[:, None]).t()) < RTOL


def test_the_two_instruction_sets_give_bitwise_the_same_products():
    """Where the CPU has AVX-512 VNNI, the AVX2 build must give bitwise what it gives: the
    integer sums are exact and the float steps are the same instructions in the same order."""
    if int8dot.isa() != "avx512":
        pytest.skip(f"needs an AVX-512 VNNI machine to build both (this one builds {int8dot.isa()})")
    other, reason = int8dot._build_for("avx2")
    assert other is not None, reason
    best = int8dot._ext()
    x = torch.randn(9, 1536, generator=_gen(11))
    q, scale, zero = _int4(64, 1536, seed=12)
    packed = best.pack_u4(q, scale, zero)
    assert torch.equal(packed, other.pack_u4(q, scale, zero))
    for rows in (1, 4, 9):
        xr = x[:rows].contiguous()
        assert torch.equal(best.u4_mm(xr, packed, 64, 1536, 4), other.u4_mm(xr, packed, 64, 1536, 2))
    q8 = torch.randint(-128, 128, (32, 1536), generator=_gen(13), dtype=torch.int8)
    p8, s8 = best.pack_u8(q8), torch.rand(32, generator=_gen(14))
    assert torch.equal(best.u8_mm(x, p8, s8, 32, 1536, 4), other.u8_mm(x, p8, s8, 32, 1536, 3))
    assert all(torch.equal(a, b) for a, b in zip(best.quantize_activations(x), other.quantize_activations(x)))


def test_rms_norm_and_silu_mul_match_torch_and_rows_are_independent():
    """The two fused elementwise ops against torch's (float32 rounding only: 1e-6 relative),
    row by row bitwise equal to the whole call, including huge and tiny gate values."""
    x = torch.randn(11, 576, generator=_gen(21)) * torch.logspace(-2, 2, 576)
    w = torch.rand(576, generator=_gen(22)) + 0.5
    y = int8dot.rms_norm(x, w, 1e-5)
    assert _rel(y, torch.nn.functional.rms_norm(x.double(), (576,), w.double(), 1e-5)) < 1e-6
    gu = torch.randn(11, 2 * 1536, generator=_gen(23)) * 4
    gu[0, :8] = torch.tensor([-200.0, -88.0, -30.0, 0.0, 1e-30, 30.0, 88.0, 200.0])
    z = int8dot.silu_mul(gu)
    gate, up = gu.double().split(1536, dim=-1)
    assert _rel(z, torch.nn.functional.silu(gate) * up) < 1e-6
    assert torch.isfinite(z).all()
    for i in (0, 5, 10):
        assert torch.equal(int8dot.rms_norm(x[i : i + 1].contiguous(), w, 1e-5), y[i : i + 1])
        assert torch.equal(int8dot.silu_mul(gu[i : i + 1].contiguous()), z[i : i + 1])


def test_a_killed_builds_lock_file_does_not_hang_the_next_build(tmp_path):
    """torch's build lock is a file a killed build leaves behind (every later load then waited
    forever); under the OS-held build lock such a file is a dead build's, and is removed. The
    build lock itself is exclusive while held."""
    import fcntl

    (tmp_path / "lock").write_text("")
    with int8dot._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "build.flock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "build.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving
