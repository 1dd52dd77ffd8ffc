"""``specdecode record-drafters``: a bench run's drafter figures land in the shipped cards."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.cards import COMPOSED_HOW, benchmark_blocks, record
from specdecode.cli import main
from specdecode.errors import InputError


def row(method: str, k, category: str, speedup: float, mal: float) -> dict:
    return {
        "cell": f"{method}|k={k}|T=0",
        "method": method,
        "k": k,
        "temperature": 0.0,
        "category": category,
        "speedup": speedup,
        "mean_accepted_length": mal,
    }


def results() -> dict:
    rows = []
    for method, k, speedups in [
        ("none", 0, (1.0, 1.0)),
        ("ngram", 4, (1.2, 1.4)),
        ("eagle", 4, (0.9, 1.1)),
        ("eagle+conf", 4, (1.3, 1.1)),
        ("eagle+tree", 4, (0.8, 0.7)),
        ("medusa", 4, (0.95, 1.0)),
    ]:
        rows += [row(method, k, "overall", speedups[0], 1.5), row(method, k, "qa", speedups[1], 1.6)]
    return {
        "config": {
            "target": "/models/Tiny-Chat.Q4_1-abc",
            "workload": "/w/spec_bench.jsonl",
            "dtype": "float32",
            "prompts_per_category": 2,
            "max_new_tokens": 96,
            "confidence": 0.4,
        },
        "command": ["specdecode", "bench", "--methods", "none,ngram,eagle,eagle+conf"],
        "aggregates": rows,
    }


def test_best_chain_cell_and_its_settings_are_recorded():
    blocks = benchmark_blocks(results())
    assert set(blocks) == {"eagle", "medusa"}
    eagle = blocks["eagle"]
    assert eagle["speedup"] == 1.3 and eagle["cell"] == "eagle+conf" and eagle["ngram_speedup"] == 1.2
    assert eagle["settings"] == {"k": 4, "policy": "confidence", "confidence": 0.4}
    assert eagle["per_category_speedup"] == {"qa": 1.1} and eagle["tree"]["speedup"] == 0.8
    assert blocks["medusa"]["settings"] == {"k": 4} and "tree" not in blocks["medusa"]


def test_a_cell_with_proposer_options_never_becomes_a_cards_setting():
    run = results()
    run["aggregates"] += [row("medusa:branch=2", 4, "overall", 1.9, 2.0), row("medusa:branch=2", 4, "qa", 1.9, 2.0)]
    assert benchmark_blocks(run)["medusa"]["speedup"] == 0.95  # the card's settings could not rebuild it


def test_record_updates_only_existing_cards(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(results()))
    card = tmp_path / "drafters" / "tiny-chat" / "eagle" / "card.json"
    card.parent.mkdir(parents=True)
    card.write_text(json.dumps({"method": "eagle", "steps": 3}))
    assert main(["record-drafters", str(tmp_path / "run"), "--drafters", str(tmp_path / "drafters")]) == 0
    assert "updated" in capsys.readouterr().out
    written = json.loads(card.read_text())
    assert written["steps"] == 3 and written["benchmark"]["speedup"] == 1.3
    assert not (tmp_path / "drafters" / "tiny-chat" / "medusa").exists()
    with pytest.raises(InputError, match="no results.json"):
        record(tmp_path / "nowhere")


def test_hybrid_gets_a_card_of_its_own_with_the_drafter_it_ran(tmp_path):
    run = results()
    run["aggregates"] += [row("hybrid+conf", 4, "overall", 1.35, 1.7), row("hybrid+conf", 4, "qa", 1.5, 1.9)]
    run["config"]["hybrid_drafter"] = "medusa"
    assert benchmark_blocks(run)["hybrid"]["settings"] == {
        "k": 4,
        "policy": "confidence",
        "confidence": 0.4,
        "drafter": "medusa",
        "lookup": "suffix",  # what a default hybrid cell ran
    }
    (tmp_path / "results.json").write_text(json.dumps(run))
    written = record(tmp_path / "results.json", tmp_path / "drafters")
    card = json.loads((tmp_path / "drafters" / "tiny-chat" / "hybrid" / "card.json").read_text())
    assert written == [tmp_path / "drafters" / "tiny-chat" / "hybrid" / "card.json"]  # trained cards must exist first
    assert card["method"] == "hybrid" and "lookup" in card["how"] and card["benchmark"]["speedup"] == 1.35
    card["how"] = "an older wording"  # re-recorded, the card says how the method now works
    (tmp_path / "drafters" / "tiny-chat" / "hybrid" / "card.json").write_text(json.dumps(card))
    record(tmp_path / "results.json", tmp_path / "drafters")
    card = json.loads((tmp_path / "drafters" / "tiny-chat" / "hybrid" / "card.json").read_text())
    assert card["how"] == COMPOSED_HOW["hybrid"]


def test_record_can_leave_other_cards_alone(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(results()))
    card = tmp_path / "drafters" / "tiny-chat" / "eagle" / "card.json"
    card.parent.mkdir(parents=True)
    card.write_text(json.dumps({"method": "eagle"}))
    args = ["record-drafters", str(tmp_path), "--drafters", str(tmp_path / "drafters"), "--methods"]
    assert main(args + ["medusa"]) == 0 and "benchmark" not in json.loads(card.read_text())
    assert main(args + ["eagle"]) == 0 and "benchmark" in json.loads(card.read_text())
    assert main(args + ["ngram"]) == 2 and "unknown ngram" in capsys.readouterr().err


def test_a_named_draft_model_and_suffix_get_cards_of_measurements_only(tmp_path):
    """On a target with no trained drafter (the Qwen 1.5B): the draft model it ran with is
    recorded by catalog name; a draft given by path is not recorded (auto could not load it)."""
    run = results()
    run["aggregates"] += [row("draft", 4, "overall", 1.9, 4.1), row("suffix", 8, "overall", 1.6, 3.0)]
    run["config"] |= {"draft": "/cache/models/q-0.5b-abc", "draft_name": "qwen2.5-coder-0.5b", "draft_dtype": "int4"}
    blocks = benchmark_blocks(run)
    assert blocks["draft"]["settings"] == {"k": 4, "draft": "qwen2.5-coder-0.5b", "draft_dtype": "int4"}
    assert blocks["suffix"]["settings"] == {"k": 8}
    (tmp_path / "results.json").write_text(json.dumps(run))
    written = record(tmp_path / "results.json", tmp_path / "drafters")
    folder = tmp_path / "drafters" / "tiny-chat"
    assert sorted(written) == [folder / "draft" / "card.json", folder / "suffix" / "card.json"]
    card = json.loads((folder / "suffix" / "card.json").read_text())
    assert card["method"] == "suffix" and "suffix" in card["how"] and card["benchmark"]["speedup"] == 1.6
    run["config"]["draft_name"] = "/home/me/my-draft"
    assert "draft" not in benchmark_blocks(run)


def test_several_runs_record_each_methods_cell_with_the_best_geometric_mean(tmp_path, capsys):
    """Two workloads on one target: suffix wins code by a hair and loses chat by far, so the hybrid
    is recorded as the better pick (geometric means), each run's own figure kept beside it."""

    def run(workload: str, category: str, figures: dict[tuple[str, object], float]) -> dict:
        rows = [row("none", 0, "overall", 1.0, 1.0), row("ngram", 4, "overall", 1.1, 1.5)]
        for (method, k), speedup in figures.items():
            rows += [row(method, k, "overall", speedup, 2.0), row(method, k, category, speedup, 2.0)]
        out = results() | {"aggregates": rows, "command": ["specdecode", "bench", "--workload", workload]}
        out["config"] = out["config"] | {"workload": workload}
        return out

    code = run("humaneval", "humaneval", {("suffix", "auto"): 1.71, ("hybrid", "auto"): 1.68, ("hybrid", 4): 1.72})
    chat = run("spec_bench.jsonl", "qa", {("suffix", "auto"): 1.12, ("hybrid", "auto"): 1.26, ("hybrid", 4): 1.05})
    blocks = benchmark_blocks(code, chat)
    hybrid, suffix = blocks["hybrid"], blocks["suffix"]
    assert hybrid["settings"]["k"] == "auto"  # k=4 wins code alone, auto wins both
    assert hybrid["speedup"] == pytest.approx((1.68 * 1.26) ** 0.5, abs=1e-3)
    assert hybrid["speedup"] > suffix["speedup"] == pytest.approx((1.71 * 1.12) ** 0.5, abs=1e-3)
    assert hybrid["ngram_speedup"] == pytest.approx(1.1)
    assert hybrid["per_category_speedup"] == {"humaneval": 1.68, "qa": 1.26}
    assert [r["speedup"] for r in hybrid["runs"]] == [1.68, 1.26] and "humaneval" in hybrid["runs"][0]["command"]
    assert benchmark_blocks(code)["hybrid"]["settings"]["k"] == 4 and "runs" not in benchmark_blocks(code)["hybrid"]
    assert benchmark_blocks(code, k="auto")["hybrid"]["speedup"] == 1.68  # only the cells at k = auto
    assert "hybrid" not in benchmark_blocks(code, k="8")
    for i, r in enumerate((code, chat)):
        (tmp_path / f"r{i}").mkdir()
        (tmp_path / f"r{i}" / "results.json").write_text(json.dumps(r))
    args = ["record-drafters", str(tmp_path / "r0"), str(tmp_path / "r1"), "--drafters", str(tmp_path / "d")]
    assert main(args) == 0 and capsys.readouterr().out.count("updated") == 2
    card = json.loads((tmp_path / "d" / "tiny-chat" / "hybrid" / "card.json").read_text())
    assert card["benchmark"]["speedup"] == hybrid["speedup"]
    other = chat | {"config": chat["config"] | {"target": "/models/Other"}}
    with pytest.raises(InputError, match="different targets"):
        benchmark_blocks(code, other)


def test_cells_sampled_at_a_temperature_record_a_sampled_block_beside_the_greedy_one(tmp_path):
    """``auto`` picks per regime (a draft kept with probability min(1, p/q) fares unlike one that
    must equal the argmax), so a run's T > 0 cells go to ``sampled_benchmark`` and its greedy
    ones to ``benchmark``; a run with sampled cells only leaves the greedy block alone."""

    def at(temperature: float, figures: dict[str, float]) -> list[dict]:
        rows = []
        for method, speedup in {"none": 1.0, "ngram": 1.05, **figures}.items():
            r = row(method, "auto", "overall", speedup, 1.5) | {"temperature": temperature}
            rows.append(r | {"cell": f"{method}|k=auto|T={temperature:g}"})
        return rows

    both = results() | {
        "aggregates": at(0.0, {"hybrid": 1.3, "suffix": 1.25}) + at(0.7, {"hybrid": 1.05, "suffix": 1.2})
    }
    greedy, sampled = benchmark_blocks(both), benchmark_blocks(both, sampled=True)
    assert (greedy["hybrid"]["speedup"], sampled["hybrid"]["speedup"]) == (1.3, 1.05)
    assert sampled["suffix"]["speedup"] == 1.2 and sampled["suffix"]["decoding"].startswith("sampled (T=0.7) chain")
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "results.json").write_text(json.dumps(both))
    record(tmp_path / "both", tmp_path / "d")
    card = json.loads((tmp_path / "d" / "tiny-chat" / "suffix" / "card.json").read_text())
    assert (card["benchmark"]["speedup"], card["sampled_benchmark"]["speedup"]) == (1.25, 1.2)
    only = results() | {"aggregates": at(0.7, {"suffix": 1.4})}
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "results.json").write_text(json.dumps(only))
    assert record(tmp_path / "only", tmp_path / "d") == [tmp_path / "d" / "tiny-chat" / "suffix" / "card.json"]
    card = json.loads((tmp_path / "d" / "tiny-chat" / "suffix" / "card.json").read_text())
    assert (card["benchmark"]["speedup"], card["sampled_benchmark"]["speedup"]) == (1.25, 1.4)
