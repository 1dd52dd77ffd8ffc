"""Process-level settings for the command line: how many CPU threads torch should use."""

from __future__ import annotations

import os

import torch


def free_cores() -> int:
    """Cores this process may use that other processes are not already keeping busy."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cores, round(cores - busy + 0.5)))


def set_threads(threads: int | None) -> int:
    """Use ``threads`` torch threads, or with None as many as there are free cores.

    On a small shared machine, OpenMP threads that outnumber free cores wait at every barrier
    for a descheduled sibling: a 2-thread decode measured ~10x slower than 1 thread next to a
    busy neighbour (BENCHMARKS.md), so the default counts only free cores.
    """
    n = threads if threads else free_cores()
    torch.set_num_threads(n)
    return n
