"""``specdecode bench-serve``: percentiles, seeded Poisson arrivals, closed-loop concurrency, the
batch-size k table on the engine, a tiny sweep through the CLI, and one-line option errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from helpers import run_cli, save_tiny_llama, tiny_native
from specdecode.bench.serve import (
    BatchTableK,
    LoadRequest,
    Progress,
    Trace,
    closed_loop,
    open_loop,
    parse_arm,
    parse_k_table,
    poisson_arrivals,
    sample_items,
)
from specdecode.bench.serve_report import (
    TARGETS,
    _target_lines,
    distribution,
    evaluate_targets,
    merge_repeats,
    percentile,
)
from specdecode.bench.workload import WorkItem
from specdecode.engine import Decoder, Engine, GenerationConfig, Speculation
from specdecode.errors import ConfigError
from specdecode.proposers import NgramProposer

WORKLOAD = [
    {"question_id": 1, "category": "alpha", "turns": ["the cat sat on the mat. the cat sat on the"]},
    {"question_id": 2, "category": "alpha", "prompt": "abc abc abc abc abc abc"},
    {"question_id": 3, "category": "beta", "prompt": "hello world, hello world, hello"},
]


pytestmark = pytest.mark.usefixtures("module_one_thread")


# -- statistics -------------------------------------------------------------------------------
def test_percentiles_match_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 5, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    d = distribution([0.001, 0.002, 0.003])
    assert d["n"] == 3 and d["p50"] == pytest.approx(2.0) and d["mean"] == pytest.approx(2.0)
    assert distribution([])["p99"] is None


def test_trace_latencies():
    t = Trace(0, 5, arrival=1.0, submitted=1.0, chunks=[(1.5, 1), (1.7, 3), (2.1, 2)], finished=2.1)
    assert t.tokens == 6
    assert t.ttft == pytest.approx(0.5)
    assert t.tpot == pytest.approx((2.1 - 1.5) / 5)
    assert t.itl == pytest.approx([0.2, 0.4])
    assert t.e2e == pytest.approx(1.1)
    assert Trace(1, 5, 0.0, 0.0, chunks=[(1.0, 1)]).tpot is None


# -- the load generator on a fake target -------------------------------------------------------
class FakeTarget:
    """Every request in flight gets one token per advance; a virtual clock moves ``dt`` per advance."""

    def __init__(self, dt: float = 0.01) -> None:
        self.t, self.dt = 0.0, dt
        self.active: dict[int, int] = {}
        self.log: list[tuple[int, int]] = []  # (in flight, submitted so far) at each advance
        self.submits: list[tuple[float, int]] = []
        self.skips = 0

    def now(self) -> float:
        return self.t

    def skip_to(self, t: float) -> None:
        assert not self.active, "skip_to only while idle"
        self.skips += 1
        self.t = max(self.t, t)

    def start_cell(self, arm, temperature, warmup) -> None:
        pass

    def submit(self, request: LoadRequest) -> None:
        self.active[request.index] = request.max_new_tokens
        self.submits.append((self.t, request.index))

    def advance(self) -> list[Progress]:
        assert self.active
        self.log.append((len(self.active), len(self.submits)))
        self.t += self.dt
        out = []
        for i in list(self.active):
            self.active[i] -= 1
            done = self.active[i] == 0
            if done:
                del self.active[i]
            out.append(Progress(i, 1, done, {"new_tokens": 0} if done else None, "length" if done else None))
        return out

    def end_cell(self) -> dict:
        return {}


def _requests(n: int, seed: int = 0) -> list[LoadRequest]:
    rng = random.Random(seed)
    return [LoadRequest(i, [1, 2, 3], rng.randint(1, 9), i) for i in range(n)]


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_closed_loop_keeps_exactly_n_in_flight(concurrency):
    reqs = _requests(20)
    target = FakeTarget()
    run = closed_loop(target, reqs, concurrency)
    assert [a for a, _ in target.log] == run.in_flight
    while_pending = [a for a, submitted in target.log if submitted < len(reqs)]
    assert while_pending and all(a == concurrency for a in while_pending)
    assert max(run.in_flight) == concurrency
    assert len(target.submits) == len(reqs) and not target.active
    for trace, req in zip(run.traces, reqs):
        assert trace.finished is not None and trace.tokens == req.max_new_tokens
        assert trace.arrival == trace.submitted  # closed loop: a request arrives when it is submitted
    # a replacement is submitted in the same instant its predecessor finishes, before the next step
    finishes = sorted(t.finished for t in run.traces)
    later = sorted(t.arrival for t in run.traces)[concurrency:]
    assert all(any(abs(a - f) < 1e-12 for f in finishes) for a in later)


def test_poisson_arrivals_are_seeded_and_exponential():
    a = poisson_arrivals(50, 5.0, seed=3)
    assert a == poisson_arrivals(50, 5.0, seed=3)
    assert a != poisson_arrivals(50, 5.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = np.diff(poisson_arrivals(20_000, 4.0, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert np.median(gaps) == pytest.approx(0.25 * np.log(2), rel=0.05)  # exponential, not uniform


def test_open_loop_submits_each_request_once_its_arrival_has_passed():
    reqs = _requests(30, seed=1)
    arrivals = poisson_arrivals(len(reqs), 20.0, seed=7)
    runs = []
    for _ in range(2):
        target = FakeTarget(dt=0.01)
        run = open_loop(target, reqs, arrivals)
        runs.append(target.submits)
        assert [s for _, s in target.submits] == list(range(len(reqs)))  # in arrival order, each once
        for trace, at in zip(run.traces, arrivals):
            assert trace.arrival == pytest.approx(run.t0 + at)
            assert trace.arrival - 1e-9 <= trace.submitted <= trace.arrival + target.dt + 1e-9
            assert trace.finished is not None
        assert target.skips > 0  # idle gaps are skipped, not slept
    assert runs[0] == runs[1]  # the whole schedule is reproducible


# -- arms and the k table on the engine --------------------------------------------------------
def test_k_table_parsing_and_lookup():
    table = parse_k_table("2:4,8:2,0")
    assert table == (((2, 4), (8, 2)), 0)
    policy = BatchTableK(*table)
    assert [policy.k_for(b) for b in (1, 2, 3, 8, 9, 64)] == [4, 4, 2, 2, 0, 0]
    assert policy.k_max == 4 and policy.describe() == "2:4,8:2,0"
    assert BatchTableK(*parse_k_table("4:3")).k_for(5) == 0
    for bad in ("x", "2:4,0,8:2", "8:2,2:4", "2:0,0", "0:3", "2:-1"):
        with pytest.raises(ConfigError):
            parse_k_table(bad)


def test_arm_names():
    assert parse_arm("none").base == "none"
    assert (parse_arm("ngram-k2").base, parse_arm("ngram-k2").k) == ("ngram", 2)
    assert parse_arm("early-exit").base == "early-exit"
    assert (parse_arm("best-k3").base, parse_arm("best-k3").k) == ("best", 3)
    assert (parse_arm("auto").kind, parse_arm("auto").base) == ("auto", "best")
    assert (parse_arm("table-suffix").kind, parse_arm("table-suffix").base) == ("table", "suffix")
    for bad in ("bogus", "xtok", "auto-none", "ngram-k0", "table-bogus"):
        with pytest.raises(ConfigError):
            parse_arm(bad)
    arm = parse_arm("auto-suffix:scored=false:max_spec_factor=1.5")
    assert (arm.name, arm.kind, arm.base) == ("auto-suffix:scored=false:max_spec_factor=1.5", "auto", "suffix")
    assert arm.options == (("scored", False), ("max_spec_factor", 1.5))
    for bad, says in (
        ("suffix:scord=false", "did you mean 'scored'"),
        ("none:k=2", "no proposer options"),
        ("suffix:scored", "name=value"),
    ):
        with pytest.raises(ConfigError, match=says):
            parse_arm(bad)


def test_best_runs_a_card_measured_at_k_auto_with_k_planned(tmp_path, monkeypatch):
    """A card recorded from a k=auto cell: ``best`` plans k as measured (an int() of "auto" was a
    crash); ``best-kN`` still pins k."""
    from types import SimpleNamespace

    from specdecode.bench.serve import parse_options, resolve_arm
    from specdecode.networks import storage

    monkeypatch.setattr(storage, "DRAFTERS_DIR", tmp_path)
    card = {"method": "suffix", "benchmark": {"speedup": 1.7, "ngram_speedup": 1.5, "settings": {"k": "auto"}}}
    (tmp_path / "tiny-chat" / "suffix").mkdir(parents=True)
    (tmp_path / "tiny-chat" / "suffix" / "card.json").write_text(json.dumps(card))
    target = SimpleNamespace(source="/models/Tiny-Chat.Q4_1-abc123")
    opts = parse_options(["--out", str(tmp_path / "o"), "--k-max", "6"])
    best = resolve_arm(parse_arm("best"), target, opts)
    assert (best.method, best.kind, best.policy, best.k, best.fixed_k) == ("suffix", "auto", "auto", 6, False)
    pinned = resolve_arm(parse_arm("best-k3"), target, opts)
    assert (pinned.method, pinned.policy, pinned.k) == ("suffix", "fixed", 3)


def test_best_runs_its_sampled_cells_on_what_the_cards_measured_best_when_sampling(tmp_path, monkeypatch):
    """A ``best`` arm whose cards pick another method for sampled requests runs that one in its
    T > 0 cells, as a server's ``auto`` does; its greedy cells are unchanged."""
    from types import SimpleNamespace

    from specdecode.bench.serve import parse_options, resolve_arm
    from specdecode.networks import storage

    monkeypatch.setattr(storage, "DRAFTERS_DIR", tmp_path)
    for method, greedy, sampled in (("hybrid", 1.3, 1.05), ("suffix", 1.25, 1.2)):
        card = {
            "method": method,
            "benchmark": {"speedup": greedy, "ngram_speedup": 1.0, "settings": {"k": "auto"}},
            "sampled_benchmark": {"speedup": sampled, "ngram_speedup": 1.0, "settings": {"k": "auto"}},
        }
        (tmp_path / "tiny-chat" / method).mkdir(parents=True)
        (tmp_path / "tiny-chat" / method / "card.json").write_text(json.dumps(card))
    target = SimpleNamespace(source="/models/Tiny-Chat.Q4_1-abc123")
    opts = parse_options(["--out", str(tmp_path / "o")])
    best = resolve_arm(parse_arm("best"), target, opts)
    best.sampled = resolve_arm(parse_arm("best"), target, opts, sampled=True)
    assert best.method == "hybrid" and best.at(0.0) is best
    assert best.at(0.7).method == "suffix" and best.at(0.7).name == "best"
    assert best.label.endswith("; at T > 0: best (suffix, k<=8 planned by the engine)")
    assert best.to_dict()["sampled"]["method"] == "suffix"


def test_table_policy_follows_the_batch_size_in_the_engine():
    model = tiny_native(vocab=8, seed=2)
    engine = Engine(model)
    spec = Speculation(NgramProposer(), k=3, policy=BatchTableK(((2, 3), (3, 1)), 0))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    lengths = (4, 8, 16, 24)  # the batch shrinks 4 -> 3 -> 2 -> 1 as requests finish
    reqs = [engine.submit(prompt, GenerationConfig(max_new_tokens=n), spec) for n in lengths]
    engine.run()
    k = engine.k_by_batch_size()
    assert k[4] == 0 and 0 < k[3] <= 1 and 1 < k[2] <= 3 and 1 < k[1] <= 3
    plain = Decoder(model, None)
    for r, n in zip(reqs, lengths):  # exact: the table only changes how many tokens are drafted
        assert r.result.token_ids == plain.generate(prompt, GenerationConfig(max_new_tokens=n)).token_ids


def test_sample_mixes_categories_and_repeats():
    items = [WorkItem(str(i), g, g, f"p{i}", i) for i, g in enumerate("aaaabbc")]
    s = sample_items(items, 10, seed=0)
    assert [x.group for x in s[:3]] == ["a", "b", "c"]
    assert len(s) == 10 and s[7:] == s[:3]
    assert s == sample_items(items, 10, seed=0) and s != sample_items(items, 10, seed=1)


def test_targets_are_computed_not_assumed():
    def cell(arm, c, tok_s, tpot, method="m", fixed=False):
        return {
            "arm": arm,
            "method": "none" if arm == "none" else method,
            "fixed_k": fixed,
            "mode": "closed",
            "concurrency": c,
            "temperature": 0.0,
            "load": {"label": f"c={c}"},
            "output_tok_s": tok_s,
            "tpot_ms": {"p50": tpot},
        }

    cells = [
        cell("none", 1, 10, 100),
        cell("auto", 1, 14.6, 65),
        cell("best", 1, 15, 60, fixed=True),
        cell("none", 16, 50, 300),
        cell("auto", 16, 49, 310),
        cell("best", 16, 40, 400, fixed=True),
    ]
    t = evaluate_targets(cells)
    assert t["auto_tpot_c1_le_0.7x_plain"]["met"] is True
    checks = t["auto_tok_s_ge_0.97x_best_of_plain_and_fixed_k"]["checks"]
    assert [x["rival"] for x in checks] == ["best", "none"] and [x["met"] for x in checks] == [True, True]
    assert t["auto_ge_plain_at_c_ge_16"]["met"] is False
    assert all(v["met"] is None for v in evaluate_targets(cells[:1]).values())
    lines = {target: (verdict, detail) for target, verdict, detail in _target_lines({"targets": t})}
    assert lines[TARGETS["auto_ge_plain_at_c_ge_16"]] == ("MISSED", "c=16 T=0: 0.98x (missed)")
    verdict, detail = lines[TARGETS["auto_tok_s_ge_0.97x_best_of_plain_and_fixed_k"]]
    assert verdict == "met" and "(missed)" not in detail


def test_repeats_pool_throughput_and_keep_the_median_runs_latencies():
    def run(arm, tokens, seconds, tpot):
        return {
            "key": f"{arm}|c=1|T=0",
            "arm": arm,
            "new_tokens": tokens,
            "completed": 4,
            "duration_s": seconds,
            "output_tok_s": tokens / seconds,
            "req_per_s": 4 / seconds,
            "goodput_req_s": 2 / seconds,
            "tpot_ms": {"p50": tpot},
        }

    runs = [run("none", 100, 10, 100), run("auto", 140, 10, 70), run("none", 120, 10, 90)]
    runs += [run("auto", 110, 10, 95), run("none", 110, 10, 80), run("auto", 130, 10, 75)]
    cells = merge_repeats(runs)
    assert [c["arm"] for c in cells] == ["none", "auto"]  # first-run order
    none, auto = cells
    assert none["output_tok_s"] == pytest.approx(330 / 30) and auto["output_tok_s"] == pytest.approx(380 / 30)
    assert none["req_per_s"] == pytest.approx(12 / 30) and none["goodput_req_s"] == pytest.approx(6 / 30)
    assert none["tpot_ms"]["p50"] == 80 and auto["tpot_ms"]["p50"] == 75  # the median run's latencies
    assert none["repeats"] == {"n": 3, "output_tok_s": [10, 12, 11], "tpot_p50_ms": [100, 90, 80]}
    even = merge_repeats([run("none", 100, 10, 1), run("none", 200, 10, 2)])
    assert even[0]["tpot_ms"]["p50"] == 1 and even[0]["output_tok_s"] == pytest.approx(15)  # lower middle
    alone = merge_repeats([run("none", 100, 10, 1)])[0]
    assert alone["repeats"]["n"] == 1 and alone["output_tok_s"] == 10


# -- the CLI --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    save_tiny_llama(root / "target")
    workload = root / "work.jsonl"
    workload.write_text("\n".join(json.dumps(r) for r in WORKLOAD) + "\n")
    out = root / "out"
    argv = [
        "bench-serve",
        "--quick",
        "--target",
        str(root / "target"),
        "--workload",
        str(workload),
        "--out",
        str(out),
        "--methods",
        "none,ngram,auto,table",
        "--concurrency",
        "1,4",
        "--arrival-rate",
        "40",
        "--max-new-tokens",
        "12",
        "--repeats",
        "2",
    ]
    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr
    return {"out": out, "stdout": stdout}


def test_quick_sweep_writes_every_output_and_ends_with_one_json_line(tiny_run):
    out = tiny_run["out"]
    for name in (
        "results.json",
        "summary.md",
        "report.html",
        "tok_s_vs_concurrency.png",
        "tpot_vs_concurrency.png",
        "k_vs_batch.png",
        "tok_s_vs_rate.png",
        "tpot_vs_rate.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert results["command"][:2] == ["specdecode", "bench-serve"]
    assert {"cpu", "cores", "torch_threads"} <= set(results["host"]) and results["config"]["torch_threads"] == 1
    assert [a["name"] for a in results["arms"]] == ["none", "ngram", "auto", "table"]
    assert len(results["cells"]) == 4 * 3  # methods x (c=1, c=4, rate=40/s) x T=0
    for c in results["cells"]:
        assert c["completed"] == c["requests"] == 4 and c["new_tokens"] > 0
        assert c["output_tok_s"] > 0 and c["req_per_s"] > 0 and c["ttft_ms"]["p50"] > 0
        assert len(c["request_records"]) == 4
        runs = c["repeats"]["output_tok_s"]
        assert c["repeats"]["n"] == 2 and min(runs) <= c["output_tok_s"] <= max(runs)
        if c["mode"] == "closed":
            assert c["in_flight"]["max"] == c["concurrency"]
        if c["method"] != "none":
            assert c["engine"]["k_by_batch_size"] and c["vs_plain"]["output_tok_s"] > 0
    assert set(results["targets"]) == {
        "auto_tpot_c1_le_0.7x_plain",
        "auto_tok_s_ge_0.97x_best_of_plain_and_fixed_k",
        "auto_ge_plain_at_c_ge_16",
    }
    assert results["targets"]["auto_ge_plain_at_c_ge_16"]["met"] is None  # no concurrency >= 16 in this run
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5 and "<script" not in page.lower()
    assert "## Targets" in (out / "summary.md").read_text()

    lines = [line for line in tiny_run["stdout"].splitlines() if line.strip()]
    last = json.loads(lines[-1])
    assert sum(1 for line in lines if line.lstrip().startswith("{")) == 1
    assert last["command"] == "bench-serve" and len(last["cells"]) == 12
    assert last["host"]["torch_threads"] == 1 and last["host"]["cpu"]
    assert all(v is None or isinstance(v, bool) for v in last["targets"].values())
    assert "auto c=1 T=0" in last["ratios"]
    assert all(len(c["tok_s_runs"]) == 2 for c in last["cells"]) and results["config"]["repeats"] == 2
    assert "bench-serve, T=0" in tiny_run["stdout"]  # the human-readable table precedes the JSON line


def test_a_draft_model_given_once_serves_the_draft_and_hybrid_cells(tmp_path):
    """``--draft`` loads a second model once; the draft cells run on it (every request completes,
    drafts are accepted), the hybrid takes it as its second source, and the config names it."""
    save_tiny_llama(tmp_path / "target")
    save_tiny_llama(tmp_path / "draft", seed=1, layers=1)
    workload = tmp_path / "work.jsonl"
    workload.write_text("\n".join(json.dumps(r) for r in WORKLOAD) + "\n")
    out = tmp_path / "out"
    argv = ["bench-serve", "--quick", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
    argv += ["--workload", str(workload), "--out", str(out), "--methods", "none,draft-k2,hybrid-k2"]
    argv += ["--concurrency", "2", "--requests", "2", "--max-new-tokens", "8"]
    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["draft"]["source"].endswith("draft") and not results["skipped"]
    cells = {c["arm"]: c for c in results["cells"]}
    assert set(cells) == {"none", "draft-k2", "hybrid-k2"}
    assert all(c["completed"] == 2 for c in cells.values())
    assert sum(r["drafted_tokens"] or 0 for r in cells["draft-k2"]["request_records"]) > 0
    sources = cells["hybrid-k2"]["sources"]  # what each of the hybrid's sources drafted
    assert set(sources) == {"lookup", "drafter"} and cells["draft-k2"]["sources"] is None
    assert sum(f["drafted"] for f in sources.values()) == cells["hybrid-k2"]["drafted_tokens"]
    assert "drafting rounds by source" in stdout and "hybrid-k2 c=2 T=0: lookup" in stdout
    assert "## Drafting rounds by source" in (out / "summary.md").read_text()


def test_sampled_cells_send_the_top_p_asked_for(tmp_path, monkeypatch):
    """``--top-p`` reaches every sampled request (greedy ones ignore it), and the results and the
    summary name it."""
    from specdecode.engine import Engine

    seen, submit = [], Engine.submit

    def spy(self, prompt, config, *args, **kwargs):
        seen.append((config.sampling.temperature, config.sampling.top_p))
        return submit(self, prompt, config, *args, **kwargs)

    monkeypatch.setattr(Engine, "submit", spy)
    save_tiny_llama(tmp_path / "target")
    workload = tmp_path / "work.jsonl"
    workload.write_text("\n".join(json.dumps(r) for r in WORKLOAD) + "\n")
    out = tmp_path / "out"
    argv = ["bench-serve", "--quick", "--target", str(tmp_path / "target"), "--workload", str(workload)]
    argv += ["--out", str(out), "--methods", "none,ngram", "--concurrency", "1", "--requests", "2"]
    argv += ["--max-new-tokens", "6", "--temperatures", "0,0.8", "--top-p", "0.5"]
    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr
    assert {top_p for t, top_p in seen if t > 0} == {0.5} and any(t == 0 for t, _ in seen)
    assert json.loads((out / "results.json").read_text())["config"]["top_p"] == 0.5
    assert "sampled with top-p 0.5" in (out / "summary.md").read_text()


def test_url_refuses_a_draft_model(tmp_path):
    rc, stdout, stderr = run_cli(
        ["bench-serve", "--url", "http://127.0.0.1:9", "--draft", "x", "--out", str(tmp_path / "o")]
    )
    assert rc == 2 and stderr.strip().startswith("error: ") and "--draft" in stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--concurrency", "0"],
        ["--concurrency", "2,x"],
        ["--arrival-rate", "-1"],
        ["--methods", "bogus"],
        ["--methods", "xtok"],
        ["--k-table", "8:2,2:4"],
        ["--temperatures", "warm"],
        ["--requests", "0"],
        ["--max-new-tokens", "0"],
        ["--no-such-flag"],
        ["--k", "two"],
        ["--repeats", "0"],
        ["--top-p", "0"],
        ["--top-p", "1.5"],
    ],
)
def test_bad_options_are_one_error_line(argv, tmp_path):
    rc, stdout, stderr = run_cli(["bench-serve", "--out", str(tmp_path / "o"), *argv])
    assert rc == 2 and not stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert not Path(tmp_path / "o").exists()


@pytest.mark.slow
def test_real_model_best_auto_and_table_cells_run(tmp_path):
    """The embedded model: best = the shipped best method with its card's settings; auto and the
    table run over the same drafter; every request completes."""
    from real_model import default_target
    from specdecode.api import benchmarked_settings, best_method

    target = default_target()
    best = best_method(target)
    argv = [
        "bench-serve",
        "--out",
        str(tmp_path / "o"),
        "--methods",
        "none,best,auto,table",
        "--concurrency",
        "2",
        "--requests",
        "2",
        "--max-new-tokens",
        "8",
        "--max-prompt-tokens",
        "64",
        "--temperatures",
        "0",
        "--threads",
        "1",
    ]
    rc, _, stderr = run_cli(argv)
    assert rc == 0, stderr
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    arms = {a["name"]: a for a in results["arms"]}
    settings = benchmarked_settings(target, best)
    assert {arms[n]["method"] for n in ("best", "auto", "table")} == {best}
    assert arms["best"]["k"] == settings.get("k", 4) and arms["auto"]["policy"] == "auto"
    assert all(c["completed"] == 2 for c in results["cells"])
    assert all(p["truncated"] == (p["tokens"] > 64) for p in results["prompts"])
