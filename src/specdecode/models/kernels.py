"""Per-machine kernel choice: how a row-invariant matmul kernel should split its rows.

torch's CPU int4/int8 kernels cost a step, not a slope, in the number of rows (measured on a
2-core Xeon: int4 over a 17920x1536 matrix 1.4 ms for 1-4 rows, 7.1 ms for 5). Because each row's
result is independent of the others in the call, n rows may be sent as any sequence of chunks
with bitwise the same output; the cheapest split depends on the machine, so it is measured once
per machine, thread count and matrix shape, cached on disk, and used for 1 row and k+1 rows alike.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

CHUNKS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)  # call sizes measured
REPEATS = 3
PLAN_FORMAT = "cold"  # in the cache file's name: plans measured before caches were evicted are re-made


@dataclass(frozen=True)
class RowPlan:
    """Measured cost (ms) of one call per chunk size; ``split(n)`` is the cheapest chunking of n rows.

    An empty plan (not measured) sends all rows in one call.
    """

    costs: tuple[tuple[int, float], ...] = ()  # (rows per call, ms)

    def split(self, n: int) -> list[int]:
        if not self.costs or n <= 1:
            return [n]
        return list(_cheapest(self.costs, n))

    def cost(self, n: int) -> float:
        """Predicted ms for n rows under this plan (NaN when not measured)."""
        if not self.costs:
            return float("nan")
        table = dict(self.costs)
        return sum(table[c] if c in table else _extrapolate(self.costs, c) for c in self.split(n))


def _extrapolate(costs: tuple[tuple[int, float], ...], rows: int) -> float:
    top_rows, top_ms = costs[-1]
    return top_ms * rows / top_rows


@functools.lru_cache(maxsize=4096)
def _cheapest(costs: tuple[tuple[int, float], ...], n: int) -> tuple[int, ...]:
    """Dynamic programme over chunk sizes; beyond the largest measured size, cost grows linearly."""
    sizes = [c for c, _ in costs]
    best: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    for m in range(1, n + 1):
        options = [(best[m - c][0] + ms, best[m - c][1] + (c,)) for c, ms in costs if c <= m]
        if m > sizes[-1] or not options:
            options.append((_extrapolate(costs, m), (m,)))
        best.append(min(options))
    return best[n][1]


def cpu_info() -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo; the platform's processor name and no flags elsewhere."""
    fallback = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return fallback, ""
    field = lambda key, default: next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), default)  # noqa: E731
    return field("model name", fallback), field("flags", "")


def machine_key() -> str:
    """What a measurement depends on: CPU model and flags, torch version, thread count."""
    model, flags = cpu_info()
    cpu = f"{model}|{flags}" if flags else model
    raw = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _cache_file() -> Path:
    from specdecode.models.loading import cache_root

    return cache_root() / "kernels" / f"{machine_key()}-{PLAN_FORMAT}.json"


EVICT_BYTES = 64 << 20  # more than any x86 L3 we run on: weights come from memory, as in a real step


def _time_call(fn: Callable[[], object], evict: torch.Tensor | None = None) -> float:
    """Best of ``REPEATS`` calls, each after ``evict`` (larger than the caches) was overwritten: a
    model's matrices do not stay cached between two uses, so a warm-cache timing would price a
    second pass over the same weights as nearly free and split rows into calls that each stream
    the matrix again. Without ``evict``, warm calls (a compute-bound choice)."""
    fn()  # warm: first calls allocate
    best = float("inf")
    for _ in range(REPEATS):
        if evict is not None:
            evict.fill_(1.0)
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(name: str, value: object) -> None:
    path = _cache_file()
    cached = _read_cache()
    cached[name] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time


def measure(name: str, call: Callable[[torch.Tensor], torch.Tensor], n_in: int, dtype: torch.dtype) -> RowPlan:
    """The plan for kernel ``name`` (kind and shape): from the disk cache, else measured now."""
    cached = _read_cache()
    if name in cached:
        return RowPlan(tuple((int(c), float(ms)) for c, ms in cached[name]))
    evict = torch.empty(EVICT_BYTES // 4)
    costs = tuple((c, _time_call(lambda c=c: call(torch.randn(c, n_in).to(dtype)), evict)) for c in CHUNKS)
    _write_cache(name, [list(c) for c in costs])
    return RowPlan(costs)


def choose(name: str, options: tuple[str, ...], make: Callable[[], Callable[[str], object]]) -> str:
    """The fastest of ``options`` on this machine, from the disk cache, else measured now: ``make()``
    builds the inputs (only when measuring) and returns a call that runs one option; each option is
    timed best of ``REPEATS`` warm calls, so a compute-bound choice is timed without memory noise.
    A cached answer that is no longer an option is measured again."""
    cached = _read_cache().get(name)
    if isinstance(cached, dict) and cached.get("chosen") in options:
        return cached["chosen"]
    call = make()
    costs = {option: _time_call(lambda option=option: call(option)) for option in options}
    chosen = min(costs, key=costs.__getitem__)
    _write_cache(name, {"chosen": chosen, "ms": costs})
    return chosen
