"""Per-machine kernel choice: the cheapest row split, measured once and cached per machine."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.models import kernels
from specdecode.models.kernels import RowPlan


def test_split_takes_the_cheapest_chunks():
    # A kernel that costs a step at 5 rows (as torch's int4 CPU kernel measured here).
    plan = RowPlan(((1, 1.4), (2, 1.7), (3, 2.1), (4, 3.1), (5, 7.1), (8, 7.2)))
    assert plan.split(1) == [1]
    assert sorted(plan.split(5)) == [2, 3]  # 3.8 ms, not 7.1 in one call or 4.5 as 4 + 1
    assert sum(plan.split(9)) == 9
    assert plan.cost(5) == 1.7 + 2.1
    assert sum(plan.split(100)) == 100  # beyond the largest measured size, cost grows linearly


def test_an_unmeasured_plan_sends_one_call():
    assert RowPlan().split(7) == [7]


def test_measure_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    w = torch.randn(32, 16)

    def call(x):
        calls.append(x.shape[0])
        return x @ w.t()

    first = kernels.measure("test:32x16", call, 16, torch.float32)
    assert {c for c, _ in first.costs} == set(kernels.CHUNKS) and calls
    files = list((tmp_path / "specdecode" / "kernels").glob("*.json"))
    assert len(files) == 1 and "test:32x16" in json.loads(files[0].read_text())
    calls.clear()
    again = kernels.measure("test:32x16", call, 16, torch.float32)
    assert again == first and calls == []


def test_the_machine_key_follows_the_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.machine_key()
        torch.set_num_threads(2)
        assert kernels.machine_key() != one
    finally:
        torch.set_num_threads(before)


def test_choose_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built, ran = [], []

    def make():
        built.append(1)
        return lambda option: (ran.append(option), sum(range(200_000 if option == "slow" else 10)))

    assert kernels.choose("test-choice", ("slow", "fast"), make) == "fast" and built and ran
    built.clear(), ran.clear()
    assert kernels.choose("test-choice", ("slow", "fast"), make) == "fast" and built == [] and ran == []
    # a cached answer that is no longer offered is measured again
    assert kernels.choose("test-choice", ("slow", "quick"), make) == "quick" and built


def test_the_int8dot_row_block_is_a_measured_candidate():
    from specdecode.models import int8dot

    if not int8dot.available():
        pytest.skip(int8dot.unavailable_reason())
    assert int8dot.row_block() in int8dot.BLOCKS
