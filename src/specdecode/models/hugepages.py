"""Weights in transparent huge pages (Linux), copied there once at load.

A decode step streams every weight once. With 4 KiB pages the 1.5B's 1.1 GB are ~280,000 pages a
token: a TLB miss at each, and the hardware prefetcher stops at every page boundary. On a 2-core
Xeon, 550 MB of u4 tiles streamed at 19 GB/s from 4 KiB pages and at 22 GB/s from huge pages,
and a 1-token forward of the Qwen 1.5B took 52 ms against 48 (BENCHMARKS.md, "Huge pages"). torch's allocator asks for huge pages only when
``THP_MEM_ALLOC_ENABLE`` is set before torch starts, which a library cannot arrange, so
:func:`place` copies tensors into one anonymous mapping advised ``MADV_HUGEPAGE`` and returns
views of it. The bytes are the same, so every output is bitwise unchanged.

``SPECDECODE_HUGE_PAGES=0`` keeps the weights where they were loaded (to compare). Where the OS
has no transparent huge pages (not Linux, or ``never``), nothing is copied.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

ENV = "SPECDECODE_HUGE_PAGES"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each tensor starts on a cache line (the kernels' loads)
TRIM_EVERY = 64 << 20  # bytes copied between handing the originals' freed heap pages back


def mode() -> str | None:
    """The OS's transparent-huge-page mode ("always", "madvise", "never"), None if it has none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def available() -> bool:
    """Whether weights go into huge pages here (:meth:`Arena.sized_for` gives no arena otherwise)."""
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and mode() in ("always", "madvise")


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Within the block, :func:`available` is False (models loaded there stay on 4 KiB pages)."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def _span(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def placeable(t: object) -> bool:
    """A dense, contiguous CPU tensor (not oneDNN's opaque packed layout) worth moving."""
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel() > 0
    )


class Arena:
    """One anonymous mapping advised ``MADV_HUGEPAGE``; :meth:`take` copies a tensor into it.

    Callers swap each original for its copy as they go (dropping the original), so the peak is the
    weights once plus the largest tensor, not twice the weights.
    """

    def __init__(self, nbytes: int) -> None:
        region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        self._raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` mapped while any view lives
        self._at = -self._raw.data_ptr() % HUGE  # huge pages map whole 2 MiB-aligned spans
        self._end = self._at + nbytes
        self._untrimmed = 0

    @classmethod
    def sized_for(cls, tensors: Iterable[torch.Tensor | None]) -> "Arena | None":
        """An arena holding the :func:`placeable` ones of ``tensors``, or None where huge pages are
        off or there is nothing to hold."""
        total = sum(_span(t) for t in tensors if placeable(t))
        return cls(total) if total and available() else None

    def take(self, t: torch.Tensor | None, drop_source: bool = False) -> torch.Tensor | None:
        """A contiguous copy of ``t`` in the arena (same dtype, shape and bytes); ``t`` itself when
        it is not :func:`placeable` (None, empty, oneDNN-packed).

        ``drop_source`` then drops ``t``'s whole pages from this process (``MADV_DONTNEED``), for a
        ``t`` read from a file mapping (``torch.load(mmap=True)``): those pages re-read from the
        file if touched again, and the peak stays the weights once. Never for anonymous memory,
        whose dropped pages would read back as zeros."""
        if not placeable(t):
            return t
        n = t.numel() * t.element_size()
        if self._at + _span(t) > self._end:
            raise ValueError("hugepages.Arena: more bytes taken than it was sized for")
        view = self._raw[self._at : self._at + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._at += _span(t)
        self._untrimmed += n
        if drop_source:
            _drop_pages(t)
        if self._untrimmed >= TRIM_EVERY:  # the tensors swapped out so far are freed by now
            release_freed()
            self._untrimmed = 0
        return view


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the process's own symbols: the C library's madvise and malloc_trim


def _drop_pages(t: torch.Tensor) -> None:
    page = mmap.PAGESIZE
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo, hi = -(-start // page) * page, end // page * page  # whole pages only
    if hi > lo:
        _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(mmap.MADV_DONTNEED))


def release_freed() -> None:
    """Hand freed heap pages back to the OS: glibc keeps frees under its (dynamic, up to 32 MB)
    mmap threshold in its heap, so without this the originals a move frees would stay resident
    beside their copies and the peak would be the weights twice."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # glibc only; other allocators manage on their own
        trim(0)


def resident_huge_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s mapping backed by huge pages now (from /proc/self/smaps; 0 if unknown)."""
    start = t.untyped_storage().data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0
