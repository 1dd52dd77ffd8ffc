"""The command line: bad input gives one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import save_tiny_llama


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdecode.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def assert_clean_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "hi", "--k", "0"], "--k: must be >= 1"),
        (["generate", "hi", "--k", "two"], "--k: expected an integer"),
        (["generate", "hi", "--max-new-tokens", "-3"], "--max-new-tokens: must be >= 1"),
        (["generate", "hi", "--temperature", "-1"], "--temperature: must be >= 0"),
        (["generate", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--method", "magic"], "invalid choice: 'magic'"),
        (["generate", "hi", "--target", "/no/such/model"], "model path not found: /no/such/model"),
        (["generate", "   "], "empty prompt"),
        (["generate", "hi", "--drafter", "eagle"], "use it with --method hybrid"),
        (["generate", "hi", "--draft-vocab", "8"], "--draft-vocab needs --draft"),
        (["generate", "hi", "--draft-vocab", "0"], "--draft-vocab"),
        (["generate", "hi", "--method", "ngram", "--set", "max_ngrm=2"], "did you mean 'max_ngram'"),
        (["generate", "hi", "--set", "max_ngram"], "--set: expected a proposer option as name=value"),
        (["generate", "hi", "--method", "hybrid", "--drafter", "eagle", "--set", "drafter=medusa"], "already given"),
        (["generate", "hi", "--method", "none", "--set", "max_ngram=2"], "does not take option 'max_ngram'"),
    ],
)
def test_bad_input_is_one_clear_line(args, needle):
    assert_clean_error(run_cli(*args), needle)


def test_not_a_model_folder(tmp_path):
    assert_clean_error(run_cli("generate", "hi", "--target", str(tmp_path)), "no config.json")


def test_set_passes_proposer_options_to_the_method(tmp_path):
    save_tiny_llama(tmp_path / "tiny")
    common = ["generate", "abcabcabc", "--target", str(tmp_path / "tiny"), "--no-chat", "--json"]
    plain = run_cli(*common, "--method", "none", "--max-new-tokens", "8")
    for option in ("max_ngram=2", "min_ngram=2"):
        proc = run_cli(*common, "--method", "ngram", "--set", option, "--max-new-tokens", "8")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    proc = run_cli(*common, "--method", "ngram", "--set", "max_ngram=1", "--set", "min_ngram=2")
    assert_clean_error(proc, "min_ngram")  # the proposer's own check of the values, one line


def test_tiny_model_json_output(tmp_path):
    save_tiny_llama(tmp_path / "tiny")
    proc = run_cli(
        "generate", "abcabc", "--target", str(tmp_path / "tiny"), "--no-chat", "--json", "--max-new-tokens", "8"
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert set(record) == {"text", "token_ids", "stats"}
    for key in (
        "method",
        "k",
        "new_tokens",
        "target_calls",
        "drafted_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "per_position_acceptance",
        "accepted_length_histogram",
        "draft_s",
        "verify_s",
        "overhead_s",
        "ttft_s",
        "tpot_s",
        "tokens_per_s",
        "peak_rss_mb",
    ):
        assert key in record["stats"], key
    assert record["stats"]["new_tokens"] == len(record["token_ids"]) <= 8


def test_method_draft_without_draft_path(tmp_path):
    save_tiny_llama(tmp_path / "tiny")
    proc = run_cli("generate", "abc", "--target", str(tmp_path / "tiny"), "--method", "draft")
    assert_clean_error(proc, "needs a draft model")


def test_oversized_request(tmp_path):
    save_tiny_llama(tmp_path / "tiny")  # max_position_embeddings = 256
    proc = run_cli("generate", "abc", "--target", str(tmp_path / "tiny"), "--no-chat", "--max-new-tokens", "1000")
    assert_clean_error(proc, "request too long")


@pytest.mark.slow
def test_incompatible_draft_vocabulary(tmp_path):
    save_tiny_llama(tmp_path / "bytes")  # byte-level tokenizer vs SmolLM2's BPE
    proc = run_cli("generate", "hi", "--method", "draft", "--draft", str(tmp_path / "bytes"))
    assert_clean_error(proc, "draft tokenizer")


@pytest.mark.slow
def test_demo_runs_the_default_method_and_matches_plain():
    proc = run_cli("demo", "--max-new-tokens", "24", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert "identical tokens: True" in proc.stdout and "k=4 output" in proc.stdout


def test_demo_takes_another_target_and_draft(tmp_path):
    save_tiny_llama(tmp_path / "tiny")
    tiny = str(tmp_path / "tiny")
    proc = run_cli(
        "demo", "--target", tiny, "--method", "draft", "--draft", tiny, "--prompt", "abc abc", "--max-new-tokens", "8"
    )
    assert proc.returncode == 0, proc.stderr
    assert tiny in proc.stdout and "identical tokens: True" in proc.stdout and "draft k=4 output" in proc.stdout


def test_a_draft_defaults_to_the_targets_dtype_with_w4a8_as_lossy():
    from specdecode.core.dtypes import draft_default

    assert draft_default("w4a8") == "w4a8-lossy"
    assert [draft_default(d) for d in ("auto", "float32", "int4", "w4a8-lossy")] == [
        "auto",
        "float32",
        "int4",
        "w4a8-lossy",
    ]
