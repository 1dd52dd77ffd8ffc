"""The integer-dot kernels of ``csrc/int8dot.cpp`` (AVX-512 VNNI, or AVX2 + FMA), and the
row-by-row attention of ``csrc/attention.cpp`` built into the same extension, once per machine.

torch's own CPU int4/int8 kernels turn each weight back into a float before multiplying, so a
call over 5 rows costs about 3x a call over 1 (BENCHMARKS.md): a k-token verify then costs what
k plain steps cost and speculation cannot pay. These kernels round the activations to int8 in
groups of 32 instead (llama.cpp's scheme) and multiply in int32 with vpdpbusd, so extra rows cost
little next to reading the weights.

The extension is compiled with torch's ``cpp_extension`` (g++ and ninja) into the model cache the
first time it is asked for (about a minute; ``make kernels`` does it ahead), for the best
instruction set this CPU has (:func:`isa`; ``SPECDECODE_INT8DOT_ISA=avx2`` forces the AVX2 build,
to compare the two on one machine). Both give bitwise the same products. Where the CPU has
neither or the build fails, :func:`available` is False and callers fall back to torch's kernels,
with :func:`unavailable_reason` saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from specdecode.models.kernels import cpu_info

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("int8dot.cpp", "attention.cpp", "layers.cpp"))
# instruction set -> (the CPU flags it needs, the compiler flags), best first
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # -mavx512f implies AVX2 but not FMA or F16C, which the shared 8-lane code uses
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"),
    ),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
}
ISA_ENV = "SPECDECODE_INT8DOT_ISA"
GROUP = 32  # activations share one int8 scale per 32 inputs
TILE = 16  # output columns per packed u8 tile
U4_TILE = 32  # per packed u4 tile (two 16-column halves)
BLOCKS = (4, 8)  # rows that may share one pass over a tile (the accumulators live in registers): measured
CAUSAL = torch.empty(0, dtype=torch.bool)  # "no mask" to attend_rows: one tensor, not one per layer and token


def missing_flags(name: str) -> list[str]:
    """The CPU features instruction set ``name`` needs that this machine lacks."""
    flags = set(cpu_info()[1].split())
    return [f for f in ISAS[name][0] if f not in flags]


def isa() -> str | None:
    """The instruction set the kernels are built for here: the best one the CPU has, or the one
    ``SPECDECODE_INT8DOT_ISA`` names; None where the CPU has none of them."""
    forced = os.environ.get(ISA_ENV)
    if forced:
        return forced
    return next((name for name in ISAS if not missing_flags(name)), None)


@functools.cache  # every kernel call asks: never read /proc/cpuinfo twice
def _build() -> tuple[ModuleType | None, str | None]:
    name = isa()
    if name is None:
        return None, f"the CPU lacks {', '.join(missing_flags('avx2'))} (needs AVX2 + FMA or AVX-512 VNNI)"
    return _build_for(name)


@functools.cache
def _build_for(name: str) -> tuple[ModuleType | None, str | None]:
    if name not in ISAS:
        return None, f"{ISA_ENV}={name} is not one of {', '.join(ISAS)}"
    missing = missing_flags(name)
    if missing:
        return None, f"the CPU lacks {', '.join(missing)} (asked for {name})"
    cflags = _cflags(name)
    try:
        from torch.utils import cpp_extension

        from specdecode.models.loading import cache_root

        _ninja_on_path()

        tag = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(cflags).encode())
        tag.update(torch.__version__.encode())
        folder = cache_root() / "ext" / f"int8dot-{name}-{tag.hexdigest()[:12]}"
        folder.mkdir(parents=True, exist_ok=True)
        with _build_lock(folder):
            module = cpp_extension.load(
                name=f"specdecode_int8dot_{name}",
                sources=[str(p) for p in SOURCES],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: fall back
        lines = str(exc).strip().splitlines()
        errors = [ln.strip() for ln in lines if "error" in ln.lower()][1:2] or lines[:1]  # the compiler's own
        return None, f"the kernel did not build ({errors[0] if errors else type(exc).__name__})"
    return module, None


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One build at a time in ``folder``, under a lock the OS drops when its holder dies.

    torch's own build lock is a file (``folder/lock``) that a build killed part way (Ctrl-C, a
    stopped CI job) leaves behind, and every later load then waits on it forever. Under this
    lock no other process of ours is building, so such a file is a dead build's: removed."""
    with open(folder / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released on close, or when the process dies
        (folder / "lock").unlink(missing_ok=True)
        yield


def _cflags(name: str) -> list[str]:
    """What instruction set ``name`` is compiled with (the build and :func:`compile_error` alike)."""
    return ["-O3", "-fopenmp", *ISAS[name][1]]


def compile_error(name: str) -> str | None:
    """Compile (not link or load) the sources for instruction set ``name`` whatever this CPU has,
    so that a build for other machines is checked here too: the compiler's first error, or None."""
    import subprocess
    import sysconfig
    import tempfile

    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    with tempfile.TemporaryDirectory() as out:
        for source in SOURCES:
            cmd = ["g++", "-std=c++17", "-c", *_cflags(name), *includes, str(source), "-o", f"{out}/x.o"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
                return (errors or done.stderr.splitlines() or ["g++ failed"])[0]
    return None


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the ninja package's copy is there only when the
    venv is activated, so put it first."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def available() -> bool:
    """Whether the kernels run here (builds them on first call)."""
    return _build()[0] is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False, or None."""
    return _build()[1]


def _ext() -> ModuleType:
    module, reason = _build()
    if module is None:
        raise RuntimeError(f"int8dot kernels unavailable: {reason}")
    return module


def pack_u4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """4-bit ``q`` (uint8 0..15 [out, in], out a multiple of 32) with bf16 ``scale`` and ``zero``
    [out, in / 32] (``w = (q - 8) * scale + zero``, models.quant's int4 convention) -> flat uint8 tiles."""
    return _ext().pack_u4(q.to(torch.uint8), scale.to(torch.bfloat16), zero.to(torch.bfloat16))


def pack_u8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q`` [out, in] (``w = q * scale[out]``) -> flat uint8 tiles."""
    return _ext().pack_u8(q.to(torch.int8))


@functools.cache
def row_block() -> int:
    """How many rows share one pass over a weight tile on this machine: the faster of
    :data:`BLOCKS` over 8 rows (u4 and u8 tiles together), measured once and cached per machine.

    Each row's sums run in the same order whatever the block (the contract above), so the choice
    changes speed only. Eight rows keep 32 accumulators live in a u4 tile, all 32 AVX-512
    registers: on a 2-core Xeon 8 still won (a k=8 forward of the 1.5B at 1.38x a 1-token one, 1.56x
    with 4), where a CPU that spills more may not.
    """
    from specdecode.models.kernels import choose

    if not available():
        return BLOCKS[0]

    def make() -> Callable[[str], None]:
        # a gate/up-sized matrix (14 MB of tiles): past L2, so the timing sees each tile fetched while
        # the rows before it compute, as in a real step; tiles that fit L2 time the arithmetic alone (a tie)
        n_out, n_in = 17920, 1536
        x = torch.randn(8, n_in)
        groups = torch.rand(n_out, n_in // GROUP)
        q4 = pack_u4(torch.randint(0, 16, (n_out, n_in), dtype=torch.uint8), groups, groups)
        q8 = pack_u8(torch.randint(-127, 128, (n_out // 2, n_in), dtype=torch.int8))
        scale = torch.rand(n_out // 2)

        def run(block: str) -> None:
            _ext().u4_mm(x, q4, n_out, n_in, int(block))
            _ext().u8_mm(x, q8, scale, n_out // 2, n_in, int(block))

        return run

    return int(choose("int8dot-row-block", tuple(map(str, BLOCKS)), make))


def u4_mm(x: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int], block: int | None = None) -> torch.Tensor:
    """``x`` float32 [n, in] by a :func:`pack_u4` matrix of ``shape`` (out, in) -> float32 [n, out]."""
    return _ext().u4_mm(x, packed, shape[0], shape[1], block or row_block())


def u8_mm(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], block: int | None = None
) -> torch.Tensor:
    """``x`` float32 [n, in] by a :func:`pack_u8` matrix with float32 ``scale`` [out] -> float32 [n, out]."""
    return _ext().u8_mm(x, packed, scale, shape[0], shape[1], block or row_block())


def attend_rows(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """One sequence's attention for its new rows, each row alone: ``qkv`` float32 [n, (heads +
    2 kv_heads) * d] (the fused projection), ``cos``/``sin`` [n, d] (rotate-half RoPE at the
    rows' positions), ``keys``/``values`` float32 [kv_heads, capacity, d] (one layer's cache; the
    rows' rotated keys and values are written at ``start``..``start + n``), ``mask`` bool
    [n, start + n] or None (causal). Returns float32 [n, heads * d]."""
    return _ext().attend_rows(qkv, cos, sin, keys, values, start, CAUSAL if mask is None else mask, heads, kv_heads)


def layer_stack(layers: list[dict[str, Any]], heads: int, kv_heads: int, eps: float) -> Any:
    """A ``LayerStack`` (csrc/layers.cpp) over ``layers``: per layer ``ln1``, ``ln2`` (float32
    [hidden]) and the matrices ``qkv``, ``o``, ``gu``, ``down``, each a dict of ``kind`` ("w4a8"
    or "w8a8g"), ``packed``, ``scale`` (w8a8g, float32 [out]), ``bias`` (float32 [out] or None),
    ``out``, ``in``. Its ``forward(x, cos, sin, keys, values, starts, los, his, masks, block)``
    runs every layer as ``native._decoder``'s loop does with these kernels: RMSNorm, fused QKV,
    :func:`attend_rows` per sequence, output projection, RMSNorm, gate/up, :func:`silu_mul`,
    down projection, both residual adds."""
    return _ext().LayerStack(layers, heads, kv_heads, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 ``x`` [n, h] by float32 ``weight`` [h], row by row, in one call
    (``F.rms_norm`` runs ~10 ops on CPU; ~50 us each time on a slow host). -> float32 [n, h]."""
    return _ext().rms_norm_rows(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up projection's float32 output [n, 2 i] -> [n, i]."""
    return _ext().silu_mul(gate_up)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own rounding of ``x`` float32 [n, in]: (xq int8 [n, in], scale float32
    [n, in / 32], sum of xq int32 [n, in / 32]); exposed for the reference tests."""
    return tuple(_ext().quantize_activations(x))


def reference_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch rounding of ``x`` [n, in] to int8 per group of 32: (xq [n, in], scale [n, in / 32])."""
    g = x.float().reshape(x.shape[0], -1, GROUP)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = (g * inv[..., None]).round().clamp(-128, 127)
    return xq.reshape(x.shape).to(torch.int8), amax / 127.0


def unpack_u4(packed: torch.Tensor, out: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_u4` (plain torch, no kernel): (q uint8 [out, in], scale and zero
    bf16 [out, in / 32]) for the first ``out`` columns of the tiles."""
    tiles, groups = -(-out // U4_TILE) * 2, n_in // GROUP  # 16-column halves
    t = packed.view(tiles // 2, groups, 2, 320).transpose(1, 2).reshape(tiles, groups, 320)
    nib = t[:, :, :256].reshape(tiles, groups, 4, TILE, 4)  # [tile, group, chunk, column, byte]
    lo, hi = nib & 0x0F, nib >> 4
    q = torch.stack((lo, hi), dim=3)  # [tile, group, chunk, half, column, byte]: input 8c + 4h + b
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, n_in)
    scales = t[:, :, 256:].contiguous().view(torch.bfloat16).reshape(tiles, groups, 2, TILE)
    scale = scales[:, :, 0].permute(0, 2, 1).reshape(tiles * TILE, groups)
    zero = scales[:, :, 1].permute(0, 2, 1).reshape(tiles * TILE, groups)
    return q[:out].contiguous(), scale[:out].contiguous(), zero[:out].contiguous()


def unpack_u8(packed: torch.Tensor, out: int, n_in: int) -> torch.Tensor:
    """Inverse of :func:`pack_u8` (plain torch): int8 q [out, in] for the first ``out`` columns."""
    tiles, groups = -(-out // TILE), n_in // GROUP
    t = packed.view(tiles, groups, 8, TILE, 4)  # [tile, group, chunk, column, byte]: input 4c + b
    q = (t.to(torch.int16) - 128).to(torch.int8)
    return q.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, n_in)[:out].contiguous()


def u4_rows(packed: torch.Tensor, ids: torch.Tensor, n_in: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``ids`` [n] of a :func:`pack_u4` matrix, read from their tiles alone (plain torch):
    (q uint8 [n, in], scale and zero bf16 [n, in / 32]), as :func:`unpack_u4` gives them."""
    groups, n = n_in // GROUP, int(ids.numel())
    every = torch.arange(n)
    sel = packed.view(-1, groups, 2, 320)[ids // U4_TILE, :, (ids % U4_TILE) // TILE]  # [n, group, 320]
    nib = sel[:, :, :256].reshape(n, groups, 4, TILE, 4)[every, :, :, ids % TILE]  # [n, group, chunk, byte]
    q = torch.stack((nib & 0x0F, nib >> 4), dim=3).reshape(n, n_in)  # input 8 chunk + 4 nibble + byte
    scales = sel[:, :, 256:].contiguous().view(torch.bfloat16).reshape(n, groups, 2, TILE)
    return q, scales[every, :, 0, ids % TILE], scales[every, :, 1, ids % TILE]


def u8_rows(packed: torch.Tensor, ids: torch.Tensor, n_in: int) -> torch.Tensor:
    """Rows ``ids`` [n] of a :func:`pack_u8` matrix from their tiles alone: int8 q [n, in]."""
    sel = packed.view(-1, n_in // GROUP, 8, TILE, 4)[ids // TILE, :, :, ids % TILE]  # [n, group, chunk, byte]
    return (sel.to(torch.int16) - 128).to(torch.int8).reshape(int(ids.numel()), n_in)


def build_report() -> str:
    """Build now if needed (``make kernels``) and say how it went, in one line."""
    return f"int8dot kernels ready ({isa()})" if available() else f"int8dot kernels unavailable: {unavailable_reason()}"
