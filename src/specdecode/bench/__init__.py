"""Benchmarks: `specdecode bench` (workloads, reports) and `specdecode advise`."""
