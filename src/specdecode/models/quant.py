"""Quantized matrices: weight-only int8 per output channel and int4 in groups on torch's own CPU
kernels, w8a8 (int8 weights, activations rounded to int8 per row, an exact int32 matmul), and w4a8
(4-bit weights, or int8 where the source was 5- to 8-bit, times activations rounded to int8 in
groups of 32, on the AVX-512 VNNI kernels of :mod:`specdecode.models.int8dot`).

Activations enter in bfloat16 (the weight-only kernels' fast path), results come back bfloat16
(w4a8: float32 in and out);
the residual stream outside the matmuls stays float32 as in the float paths. All kernels are
row-invariant (a row's result does not depend on the other rows in the call; tested), so a
matrix may split its rows into the chunks that cost least on this machine (see
:mod:`specdecode.models.kernels`) and 1-token decode stays bitwise equal to a k-token verify.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdecode.models import int8dot
from specdecode.models.kernels import RowPlan, measure

KINDS = ("int8", "int4", "w8a8", "w4a8")
# Matrix kinds of the int8dot kernels: "w4a8" (4-bit tiles) and "w8a8g" (8-bit tiles, what a
# w4a8 model keeps for its 5- to 8-bit sources); float32 activations in, float32 out.
DOT_KINDS = ("w4a8", "w8a8g")
# A model-level choice, not a matrix kind: every matrix as w4a8, 5- to 8-bit sources re-quantized
# to 4 bits whatever it costs them. Meant for drafts, whose error costs acceptance and never
# exactness: reading 4 bits instead of 8 is what a draft step costs.
LOSSY = "w4a8-lossy"
_ON_INT8DOT = (*DOT_KINDS, LOSSY)  # what runs on the int8dot kernels, float32 activations in
INT4_GROUP = 32  # GGUF's Q4_0/Q4_1/Q4_K blocks are 32 wide; smaller groups track them best
ACT = torch.bfloat16  # activation dtype into the kernels (their fp32 path is ~10x slower)
# int4 only where it keeps what the file had: re-quantizing a GGUF 4-bit matrix costs ~0.5% (its
# scales rounded to bf16), an 8-bit one ~9% (SmolLM2's Q8_0 head moved top logits by 5); those
# stay int8.
INT4_MAX_ERROR = 0.02


def act_dtype(kind: str) -> torch.dtype:
    """The dtype a matrix of ``kind`` takes its activations in."""
    return torch.float32 if kind in _ON_INT8DOT else ACT


@functools.cache
def kernel_available(kind: str) -> bool:
    """Whether this torch build runs ``kind``'s kernel (probed once on a tiny matrix)."""
    if kind in _ON_INT8DOT:
        return int8dot.available()
    try:
        x = torch.ones(2, 32, dtype=ACT)
        if kind == "int8":
            torch.ops.aten._weight_int8pack_mm(x, torch.ones(16, 32, dtype=torch.int8), torch.ones(16, dtype=ACT))
        elif kind == "w8a8":
            torch._int_mm(torch.ones(1, 32, dtype=torch.int8), torch.ones(16, 32, dtype=torch.int8).t())
        elif kind == "int4":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.ones(16, 32, dtype=torch.int32), 1)
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, torch.ones(1, 16, 2, dtype=ACT))
        else:
            return False
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# -- quantize and dequantize (the plain reference the kernels are tested against) ----------------


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``w`` [out, in] -> (q int8 [out, in], scales bf16 [out])."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(ACT)
    q = (w / scales.float()[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 over groups of ``group`` inputs: (q uint8 0..15 [out, in], scale, zero bf16
    [out, in // group]); ``w ~= (q - 8) * scale + zero`` (torch's int4 kernel convention).

    A group whose values already lie on a grid of at most 16 levels (a GGUF Q4_0/Q4_1/Q4_K
    block, whose scales llama.cpp chooses by search, so its levels need not span min..max) keeps
    that grid exactly; other groups take min..max in 15 steps.
    """
    out, inp = w.shape
    g = w.float().reshape(out, inp // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    steps = _grid_steps(g, lo, hi - lo)
    scale = ((hi - lo) / steps).clamp(min=1e-12).to(ACT)
    zero = (lo + 8 * scale.float()).to(ACT)  # rounded first: q is chosen for the stored values
    q = ((g - zero.float()[..., None]) / scale.float()[..., None] + 8).round_().clamp_(0, 15)
    return q.reshape(out, inp).to(torch.uint8), scale, zero


def _grid_steps(g: torch.Tensor, lo: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Per group, a number of steps (1..15) from its min to its max that puts every value on the
    grid (to float32 rounding); 15 where none does.

    The first guess is span / smallest gap between the group's values (exact whenever two
    neighbouring levels occur); groups it misses search 15 down to 1, unless a sample of them
    shows no grid at all (a 5- to 8-bit source: no 16-level grid to find).
    """
    unit = ((g - lo[..., None]) / span.clamp(min=1e-30)[..., None]).reshape(-1, g.shape[-1])  # in [0, 1]
    gaps = unit.sort(-1).values.diff(dim=-1)
    smallest = torch.where(gaps > 1e-4, gaps, torch.ones_like(gaps)).amin(-1)
    steps = (1 / smallest).round().clamp(1, 15)
    left = (~_on_grid(unit, steps[:, None])).nonzero().squeeze(-1)
    if left.numel() and _has_grid(unit[left[:256]]):
        for j in range(15, 0, -1):
            ok = _on_grid(unit[left], j)
            steps[left[ok]] = j
            left = left[~ok]
    steps[left] = 15.0
    return steps.reshape(span.shape)


def _has_grid(sample: torch.Tensor) -> bool:
    """Whether these groups look 4-bit: half lie on 15 steps, or some lie on fewer."""
    return bool(_on_grid(sample, 15).float().mean() >= 0.5) or any(
        bool(_on_grid(sample, j).any()) for j in range(1, 15)
    )


def _on_grid(unit: torch.Tensor, steps: torch.Tensor | float) -> torch.Tensor:
    """Which groups (rows of ``unit``, in [0, 1]) lie on ``steps`` equal steps ([groups, 1] or one number)."""
    x = unit * steps
    return ((x - x.round()).abs() < 1e-3).all(-1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    n, groups = scale.shape
    g = q.view(n, groups, -1).float().sub_(8)  # [out, groups, group]; one temporary, scaled in place
    return g.mul_(scale.float()[..., None]).add_(zero.float()[..., None]).view(q.shape)


# -- matrices -----------------------------------------------------------------------------------


@dataclass(eq=False)
class QuantMatrix:
    """A quantized [out, in] matrix: ``m(x)`` multiplies bf16 rows ``x`` [n, in] -> bf16 [n, out]."""

    kind: str
    shape: tuple[int, int]  # (out, in)
    tensors: tuple[torch.Tensor, ...]
    plan: RowPlan = field(default_factory=RowPlan)
    # A oneDNN-packed bf16 copy of the dequantized matrix for prompt chunks (attach_prompt_copy):
    # at 64+ rows the int8dot kernels are compute-bound, and AMX/bf16 runs ~3x faster there.
    prompt_copy: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        act = act_dtype(self.kind)
        if x.dtype != act or not x.is_contiguous():  # no op at all in the common case (~1 us each)
            x = x.to(act).contiguous()
        chunks = self.plan.split(x.shape[0])
        if len(chunks) == 1:
            return self._mm(x)
        return torch.cat([self._mm(part) for part in x.split(chunks)])

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in DOT_KINDS:
            return self._dot(x)
        if self.kind == "w8a8":
            return _w8a8_mm(x, *self.tensors)
        if self.kind == "int8":
            q, scales = self.tensors
            return torch.ops.aten._weight_int8pack_mm(x, q, scales)
        packed, scale_zero = self.tensors
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scale_zero)

    def _dot(self, x: torch.Tensor) -> torch.Tensor:
        out, n_in = self.shape
        padded = _padded(out, self.kind)
        if self.kind == "w4a8":
            y = int8dot.u4_mm(x, self.tensors[0], (padded, n_in))
        else:
            packed, scale = self.tensors
            y = int8dot.u8_mm(x, packed, scale, (padded, n_in))
        return y if padded == out else y[:, :out]

    def dequantized(
        self, dtype: torch.dtype = torch.float32, block: int = 256, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The whole matrix [out, in] in ``dtype``, each value as :meth:`rows` reads it (float32,
        then rounded), made ``block`` rows at a time so the float32 temporaries stay in cache;
        written into the front of ``into`` (flat, ``dtype``) where given: a buffer reused for
        many matrices is faulted in once."""
        out, n_in = self.shape
        if self.kind not in DOT_KINDS:
            return self.rows(torch.arange(out)).to(dtype)
        result = torch.empty(out, n_in, dtype=dtype) if into is None else into[: out * n_in].view(out, n_in)
        flat = self.tensors[0].view(-1)
        per_row = flat.numel() // _padded(out, self.kind)  # tile bytes per output row
        for lo in range(0, out, block):  # block is a multiple of both tile heights
            n = min(block, out - lo)
            tiles = flat[lo * per_row : (lo + _padded(n, self.kind)) * per_row]
            if self.kind == "w4a8":
                part = dequantize_int4(*int8dot.unpack_u4(tiles, n, n_in))
            else:
                part = int8dot.unpack_u8(tiles, n, n_in).float().mul_(self.tensors[1][lo : lo + n, None])
            result[lo : lo + n] = part
        return result

    @property
    def has_rows(self) -> bool:
        """Whether :meth:`rows` can read single rows back (not from torch's opaque int4 layout)."""
        return self.kind != "int4"

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Output rows ``ids`` [n] dequantized to float32 [n, in], bitwise what the plain
        dequantize reference gives; reads only their tiles, so a tied model's embedding lookups
        can come from its quantized head instead of a second float copy of it."""
        ids = ids.reshape(-1)
        if self.kind in ("int8", "w8a8"):
            q, scales = self.tensors
            return dequantize_int8(q[ids], scales[ids])
        if self.kind == "w8a8g":
            packed, scales = self.tensors
            return int8dot.u8_rows(packed, ids, self.shape[1]).float() * scales[ids][:, None]
        if self.kind == "w4a8":
            return dequantize_int4(*int8dot.u4_rows(self.tensors[0], ids, self.shape[1]))
        raise ValueError(f"{self.kind} matrices keep no readable rows (torch's packed int4 layout)")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _w8a8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows quantized to int8 on the fly, each by its own absmax (so a row never depends on the
    others), an exact int32 matmul (``torch._int_mm``: oneDNN/AMX, flat in the number of rows),
    then both scales: ``x`` [n, in] bf16 -> [n, out] bf16."""
    xf = x.float()  # a copy (x is bf16), so it is rounded in place below
    row_scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)  # [n, 1]
    xq = xf.div_(row_scale).round_().clamp_(-127, 127).to(torch.int8)
    acc = torch._int_mm(xq, q.t())  # [n, out] int32, exact
    return torch.mul(acc, row_scale).mul_(scales).to(ACT)  # one float [n, out] temporary, not two


def int4_fits(shape: tuple[int, int]) -> bool:
    """torch's int4 packing needs out % 16 == 0 and whole groups along in."""
    return shape[0] % 16 == 0 and shape[1] % INT4_GROUP == 0


ROW_BLOCK = 4096  # rows quantized at a time: temporaries stay ~100 MB even for a 151,936-row head


def quantize_matrix(w: torch.Tensor, kind: str) -> QuantMatrix | torch.Tensor:
    """``w`` [out, in] as ``kind`` where its kernel runs here and the shape fits; int4 falls back to
    int8 (also where int4 would lose more than ``INT4_MAX_ERROR`` of the matrix), w8a8 to int8,
    int8 to a bf16 tensor (used with ``F.linear``), so a missing op never fails a load. w4a8 falls
    back to w8a8g the same way, and both to torch's int4 / int8 where their kernels cannot run.
    ``LOSSY`` is w4a8 with no error bound (torch's int4, bounded, where the kernels cannot run)."""
    shape = (int(w.shape[0]), int(w.shape[1]))
    if kind == LOSSY:
        if kernel_available(kind) and shape[1] % int8dot.GROUP == 0:
            return _try_int4(w, shape, _w4a8, max_error=float("inf"))
        kind = "int4"
    if kind in DOT_KINDS:
        if kernel_available(kind) and shape[1] % int8dot.GROUP == 0:
            int4 = _try_int4(w, shape, _w4a8) if kind == "w4a8" else None
            return int4 if int4 is not None else _w8a8g(shape, *_int8_rows(w))
        kind = "int4" if kind == "w4a8" else "int8"
    if kind == "int4" and int4_fits(shape) and kernel_available("int4"):
        int4 = _try_int4(w, shape)
        if int4 is not None:
            return int4
    w8a8 = kind == "w8a8" and kernel_available("w8a8")
    if w8a8 or (kind in KINDS and kernel_available("int8")):
        q, scales = _int8_rows(w)
        return QuantMatrix("w8a8", shape, (q, scales.float())) if w8a8 else QuantMatrix("int8", shape, (q, scales))
    return w.to(ACT).contiguous()


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = (torch.cat(t) for t in zip(*(quantize_int8(block) for block in w.split(ROW_BLOCK))))
    return q, scales


def _try_int4(
    w: torch.Tensor,
    shape: tuple[int, int],
    pack: Callable[..., QuantMatrix] | None = None,
    max_error: float = INT4_MAX_ERROR,
) -> QuantMatrix | None:
    """``w`` as int4 (packed by ``pack``, default torch's layout), or None where that would lose
    more than ``max_error`` of it (relative Frobenius error)."""
    blocks = w.split(ROW_BLOCK)
    parts = [quantize_int4(block) for block in blocks]
    if max_error < float("inf"):  # an unbounded ask (w4a8-lossy) need not dequantize to measure
        err2 = sum(float((dequantize_int4(*p) - b.float()).pow(2).sum()) for p, b in zip(parts, blocks))
        if (err2 / max(float(w.float().pow(2).sum()), 1e-30)) ** 0.5 > max_error:
            return None
    q, scale, zero = (torch.cat(t) for t in zip(*parts))
    return (pack or _int4)(shape, q, scale, zero)


def _int4(shape: tuple[int, int], q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QuantMatrix:
    packed = torch.cat(
        [torch.ops.aten._convert_weight_to_int4pack_for_cpu(b.to(torch.int32), 1) for b in q.split(ROW_BLOCK)]
    )
    scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [in / group, out, 2]
    return QuantMatrix("int4", shape, (packed, scale_zero))


def _padded(out: int, kind: str) -> int:
    """Output columns rounded up to whole int8dot tiles of ``kind``."""
    tile = int8dot.U4_TILE if kind == "w4a8" else int8dot.TILE
    return -(-out // tile) * tile


def _pad_rows(t: torch.Tensor, out: int, kind: str) -> torch.Tensor:
    extra = _padded(out, kind) - out
    return t if not extra else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _w4a8(shape: tuple[int, int], q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> QuantMatrix:
    """4-bit ``q`` with its scales and zeros in int8dot tiles (rows padded to whole tiles)."""
    out = shape[0]
    packed = int8dot.pack_u4(*(_pad_rows(t, out, "w4a8") for t in (q, scale, zero)))
    return QuantMatrix("w4a8", shape, (packed,))


def _w8a8g(shape: tuple[int, int], q: torch.Tensor, scales: torch.Tensor) -> QuantMatrix:
    """int8 ``q`` with per-row ``scales`` in int8dot tiles (rows padded to whole tiles)."""
    out = shape[0]
    packed = int8dot.pack_u8(_pad_rows(q, out, "w8a8g"))
    return QuantMatrix("w8a8g", shape, (packed, _pad_rows(scales.float(), out, "w8a8g").contiguous()))


def select_rows(m: QuantMatrix, ids: torch.Tensor) -> QuantMatrix | None:
    """``m`` cut to output rows ``ids`` with bitwise the same values (None for torch's opaque
    int4 layout, which callers read back instead)."""
    shape = (int(ids.numel()), m.shape[1])
    if m.kind in ("int8", "w8a8"):
        q, scales = m.tensors
        return QuantMatrix(m.kind, shape, (q[ids].contiguous(), scales[ids].contiguous()))
    if m.kind == "w8a8g":
        packed, scales = m.tensors
        return _w8a8g(shape, int8dot.u8_rows(packed, ids, m.shape[1]), scales[ids])
    if m.kind == "w4a8":
        return _w4a8(shape, *int8dot.u4_rows(m.tensors[0], ids, m.shape[1]))
    return None


def embed_rows(table: QuantMatrix | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The embedding of ``ids`` [...] as float32 [..., hidden], from a float table or a quantized
    (tied) head with readable rows."""
    if isinstance(table, QuantMatrix):
        return table.rows(ids).reshape(*ids.shape, table.shape[1])
    return torch.nn.functional.embedding(ids, table).float()


def can_embed(m: QuantMatrix | torch.Tensor) -> bool:
    """Whether a quantized head (or its bf16 fallback) can also serve a tied model's lookups."""
    return not isinstance(m, QuantMatrix) or m.has_rows


def quant_linear(x: torch.Tensor, w: QuantMatrix | torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The ``Weights.linear`` of a quantized model: ``x`` [n, in] by a quantized (or bf16) matrix."""
    if isinstance(w, QuantMatrix):
        y = w(x)
        return y if b is None else y + b
    return torch.nn.functional.linear(x.to(w.dtype), w, b)


def plan_rows(matrices: list[QuantMatrix]) -> dict[str, RowPlan]:
    """Measure (or read from the per-machine cache) each kind and shape's cheapest row split and
    give it to every matrix of that kind and shape; returns the plans by name. int8dot matrices
    keep the empty plan (all rows in one call: the kernel shares each weight tile among them)."""
    plans: dict[str, RowPlan] = {}
    for m in matrices:
        if m.kind in DOT_KINDS:  # blocks its rows itself, weights read once: one call always wins
            continue
        name = f"{m.kind}:{m.shape[0]}x{m.shape[1]}"
        if name not in plans:
            plans[name] = measure(name, m._mm, m.shape[1], act_dtype(m.kind))
        m.plan = plans[name]
    return plans


def attach_prompt_copy(m: QuantMatrix, staging: torch.Tensor | None = None) -> None:
    """Give ``m`` its bf16 prompt copy (2 bytes per weight on top of its 0.5-1), oneDNN-packed;
    ``staging`` (flat bf16, at least the matrix's size) holds the plain copy on its way."""
    m.prompt_copy = torch.ops.mkldnn._reorder_linear_weight(m.dequantized(torch.bfloat16, into=staging))
