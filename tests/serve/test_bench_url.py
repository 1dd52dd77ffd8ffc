"""``bench-serve --url``: the load generator over HTTP against a live server (the same prompts,
as token ids; token counts from continuous usage stats; table arms skipped with a reason)."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli
from serving import start_server

WORKLOAD = [
    {"question_id": 1, "category": "alpha", "prompt": "the cat sat on the mat. the cat sat on the"},
    {"question_id": 2, "category": "beta", "prompt": "abc abc abc abc abc abc"},
]


@pytest.fixture(scope="module")
def url_run(tiny_loaded, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-url")
    workload = root / "work.jsonl"
    workload.write_text("\n".join(json.dumps(r) for r in WORKLOAD) + "\n")
    live = start_server(tiny_loaded, method="ngram")
    try:
        argv = [
            "bench-serve",
            "--quick",
            "--url",
            live.url,
            "--target",
            str(tiny_model_dir),
            "--workload",
            str(workload),
        ]
        argv += ["--out", str(root / "out"), "--methods", "none,ngram,auto,table", "--max-new-tokens", "10"]
        rc, stdout, stderr = run_cli(argv)
        assert rc == 0, stderr
    finally:
        live.stop()
    return json.loads((root / "out" / "results.json").read_text()), stdout


def test_every_request_completes_over_http_with_its_tokens_counted(url_run):
    results, stdout = url_run
    assert results["config"]["over"] == "http"
    assert [a["name"] for a in results["arms"]] == ["none", "ngram", "auto"]
    assert [s["name"] for s in results["skipped"]] == ["table"] and "HTTP" in results["skipped"][0]["reason"]
    for c in results["cells"]:
        assert c["completed"] == c["requests"] == 4
        assert c["new_tokens"] == 4 * 10  # continuous usage counts every token, speculated ones too
        assert c["ttft_ms"]["p50"] > 0 and c["goodput_req_s"] is not None
        if c["method"] != "none":
            assert c["target_calls"] > 0
        if c["kind"] == "fixed" and c["method"] != "none":  # auto drafts only where its measured costs pay
            assert c["drafted_tokens"] > 0
    assert json.loads(stdout.strip().splitlines()[-1])["command"] == "bench-serve"


def test_a_url_without_a_server_is_one_error_line(tmp_path, tiny_model_dir):
    rc, out, err = run_cli(
        [
            "bench-serve",
            "--quick",
            "--url",
            "http://127.0.0.1:9",
            "--target",
            str(tiny_model_dir),
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 2 and err.strip().startswith("error: --url") and len(err.strip().splitlines()) == 1
