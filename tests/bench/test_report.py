"""The bench report's speedups, from hand-made records (no model)."""

from __future__ import annotations

import pytest

from specdecode.bench import report


def _rec(cell: str, prompt: str, tokens: int, ttft: float, total: float) -> dict:
    stats = {"new_tokens": tokens, "ttft_s": ttft, "total_s": total, "target_calls": tokens}
    return {"cell": cell, "prompt_id": prompt, "group": "g", "token_ids": list(range(tokens)), "stats": stats}


def _results(temperature: float, runs: dict[str, list[tuple[str, int, float, float]]]) -> dict:
    cells = [
        {"key": f"{m}|k={k}|T={temperature:g}", "method": m, "k": k, "temperature": temperature}
        for m, k in (("none", 0), ("suffix", 4))
    ]
    keys = {c["method"]: c["key"] for c in cells}
    records = [_rec(keys[m], *run) for m, rs in runs.items() for run in rs]
    return {"cost_curve": {"forward_s": {}}, "records": records, "categories": ["g"], "cells": cells}


def _overall(results: dict, method: str) -> dict:
    return next(r for r in report.aggregate(results) if r["method"] == method and r["category"] == "overall")


def test_a_sampled_cell_is_compared_at_plains_output_length():
    """Plain made 20 tokens in 1 + 19 x 0.05 s; the method sampled a 112-token answer in 1 + 111 x 0.04 s.
    At its own length it would read as 3.9x plain's tokens/s; at plain's 20 tokens it is 1.95 / 1.76."""
    runs = {"none": [("p", 20, 1.0, 1.95)], "suffix": [("p", 112, 1.0, 1.0 + 111 * 0.04)]}
    row = _overall(_results(0.7, runs), "suffix")
    assert row["speedup"] == pytest.approx(1.95 / (1.0 + 19 * 0.04))
    assert row["tokens_per_s"] == pytest.approx(112 / (1.0 + 111 * 0.04))  # the cell's own figures stay


def test_a_greedy_cell_keeps_tokens_per_second_and_equal_lengths_agree():
    runs = {"none": [("p", 20, 1.0, 1.95), ("q", 8, 0.5, 0.85)], "suffix": [("p", 20, 1.0, 1.76), ("q", 8, 0.5, 0.7)]}
    greedy, sampled = (_overall(_results(t, runs), "suffix")["speedup"] for t in (0.0, 0.7))
    assert greedy == pytest.approx((28 / 2.46) / (28 / 2.8)) and sampled == pytest.approx(greedy)


def test_a_one_token_sample_keeps_its_own_time():
    runs = {"none": [("p", 20, 1.0, 1.95)], "suffix": [("p", 1, 0.9, 0.9)]}
    assert _overall(_results(0.7, runs), "suffix")["speedup"] == pytest.approx(1.95 / 0.9)


def test_a_sampled_cells_prediction_is_also_at_plains_output_length(monkeypatch):
    """The cost model's decode rates (here 50 and 20 tokens/s) with each run's prompt time: at
    plain's 20 tokens the method takes 1 + 20 / 50 s against plain's 1 + 20 / 20 s, whatever the
    length of its own sample (112 tokens would credit its prompt time over more tokens)."""
    monkeypatch.setattr(report, "_predicted_rate", lambda recs, curve, k: 20.0 if k == 0 else 50.0)
    runs = {"none": [("p", 20, 1.0, 1.95)], "suffix": [("p", 112, 1.0, 1.0 + 111 * 0.04)]}
    results = _results(0.7, runs)
    results["cost_curve"]["forward_s"] = {"1": 0.05}
    for rec in results["records"]:
        rec["stats"].update(prefill_s=1.0, draft_s=0.0, verify_s=rec["stats"]["total_s"] - 1.0, overhead_s=0.0)
    assert _overall(results, "suffix")["predicted_speedup"] == pytest.approx((1.0 + 20 / 20) / (1.0 + 20 / 50))
