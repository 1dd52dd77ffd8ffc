"""Process-level settings for the command line: how many CPU threads torch should use."""

from __future__ import annotations

import os

import psutil
import torch

SAMPLE_S = 0.2  # long enough to see a busy neighbour, short enough not to delay start-up


def busy_cores(interval: float = SAMPLE_S) -> float:
    """How many cores other processes keep busy right now, measured over ``interval`` seconds.

    Read from the kernel's CPU time counters (psutil), not the 1-minute load average: that still
    counts a process that has just exited, so back-to-back runs halved their threads. Steal and
    I/O wait are not counted as busy (a core stolen by the hypervisor is still ours to use).
    """
    times = psutil.cpu_times_percent(interval=interval, percpu=False)
    busy = sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))
    return busy / 100.0 * (psutil.cpu_count() or 1)


def free_cores(interval: float = SAMPLE_S) -> int:
    """Cores this process may use that other processes are not already keeping busy."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, round(cores - busy_cores(interval) + 0.25)))


def set_threads(threads: int | None) -> int:
    """Use ``threads`` torch threads, or with None as many as there are free cores.

    On a small shared machine, OpenMP threads that outnumber free cores wait at every barrier
    for a descheduled sibling: a 2-thread decode measured ~10x slower than 1 thread next to a
    busy neighbour (BENCHMARKS.md), so the default counts only cores that are free now.
    """
    n = threads if threads else free_cores()
    torch.set_num_threads(n)
    return n
