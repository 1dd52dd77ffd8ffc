"""The wire: SSE framing, OpenAI's error schema and status codes, limits, the API key, loading
and queue-full answers, stop strings and UTF-8 across chunks, disconnects, metrics."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from serving import SCRIPT, LiveServer, http, metric, openai_client, scripted, sse_frames, start_server
from specdecode.engine import EngineConfig
from specdecode.serve import ServerConfig

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}


def assert_error(status: int, body, expected: int, param: str | None = None) -> None:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


# -- SSE -----------------------------------------------------------------------------------------
def test_sse_frames_end_with_done_and_the_usage_chunk_has_no_choices(server):
    status, frames = sse_frames(
        server, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200 and frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    status, frames = sse_frames(server, "/v1/completions", {**CHAT, "messages": None, "prompt": "ab", "stream": True})
    assert frames[-1] == "[DONE]" and all("usage" not in json.loads(f) for f in frames[:-1])
    assert all(json.loads(f)["object"] == "text_completion" for f in frames[:-1])


# -- errors --------------------------------------------------------------------------------------
BAD = [
    ({**CHAT, "max_tokens": "8"}, 400, "max_tokens"),
    ({**CHAT, "temperature": "hot"}, 400, "temperature"),
    ({**CHAT, "temperature": 3}, 400, "temperature"),
    ({**CHAT, "top_p": 0}, 400, "top_p"),
    ({**CHAT, "n": 0}, 400, "n"),
    ({**CHAT, "messages": "hi"}, 400, "messages"),
    ({**CHAT, "messages": []}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ({**CHAT, "stop": 5}, 400, "stop"),
    ({**CHAT, "speculative": {"k": 0}}, 400, None),
    ({**CHAT, "speculative": {"method": "ngarm"}}, 400, "speculative"),
    ({**CHAT, "speculative": {"mehtod": "ngram"}}, 400, None),
    ({**CHAT, "speculative": {"method": "draft"}}, 400, "speculative"),
    ({**CHAT, "speculative": True}, 400, "speculative"),
    ({**CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ({**CHAT, "model": "gpt-4o"}, 404, "model"),
    ({k: v for k, v in CHAT.items() if k != "model"}, 400, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_fields_are_openai_errors_with_a_4xx(server, body, status, param):
    code, answer, _ = http(server, "POST", "/v1/chat/completions", body)
    assert_error(code, answer, status, param)


def test_unknown_fields_are_ignored(server):
    code, answer, _ = http(
        server, "POST", "/v1/chat/completions", {**CHAT, "frequency_penalty": 0, "user": "u1", "x": [1]}
    )
    assert code == 200 and answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "raw,what",
    [(b"{not json", "malformed JSON"), (b"[1, 2]", ""), (b"", ""), (b'"a string"', "")],
    ids=["bad", "array", "empty", "string"],
)
def test_malformed_bodies_are_400(server, raw, what):
    code, answer, _ = http(server, "POST", "/v1/chat/completions", raw=raw)
    assert_error(code, answer, 400)
    assert what in answer["error"]["message"]


def test_unknown_routes_and_methods_are_openai_errors(server):
    code, answer, _ = http(server, "GET", "/v1/nothing")
    assert_error(code, answer, 404)
    code, answer, _ = http(server, "GET", "/v1/chat/completions")
    assert_error(code, answer, 405)


def test_size_limits_are_413(tiny_loaded):
    live = start_server(tiny_loaded, max_body_bytes=2000, max_prompt_tokens=40)
    try:
        code, answer, _ = http(live, "POST", "/v1/completions", {**CHAT, "prompt": "x" * 5000})
        assert_error(code, answer, 413)
        assert answer["error"]["code"] == "body_too_large"
        code, answer, _ = http(live, "POST", "/v1/completions", {"model": "tiny", "prompt": "y" * 100})
        assert_error(code, answer, 413, "prompt")
        assert answer["error"]["code"] == "prompt_too_long"
        code, answer, _ = http(
            live, "POST", "/v1/completions", {"model": "tiny", "prompt": "y" * 30, "max_tokens": 250}
        )
        assert_error(code, answer, 400, "max_tokens")
        assert answer["error"]["code"] == "context_length_exceeded"
        code, answer, _ = http(live, "POST", "/v1/completions", {"model": "tiny", "prompt": [999999]})
        assert_error(code, answer, 400, "prompt")
    finally:
        live.stop()


def test_api_key(tiny_loaded):
    import openai

    live = start_server(tiny_loaded, api_key="s3cret")
    try:
        code, answer, _ = http(live, "POST", "/v1/chat/completions", CHAT)
        assert_error(code, answer, 401)
        code, answer, _ = http(live, "POST", "/v1/chat/completions", CHAT, {"Authorization": "Bearer wrong"})
        assert_error(code, answer, 401)
        with pytest.raises(openai.AuthenticationError):
            openai_client(live, "wrong").models.list()
        assert openai_client(live, "s3cret").chat.completions.create(**CHAT).choices[0].message.content
        assert http(live, "GET", "/health")[0] == 200  # health and metrics stay open
    finally:
        live.stop()


def test_health_is_503_while_loading_then_200(tiny_loaded):
    gate = threading.Event()

    def slow_load():
        gate.wait(60)
        return tiny_loaded, None

    live = LiveServer(slow_load, ServerConfig(model_name="tiny")).start(wait_ready=False)
    try:
        code, answer, _ = http(live, "GET", "/health")
        assert_error(code, answer, 503)
        assert answer["error"]["code"] == "loading"
        assert_error(*http(live, "POST", "/v1/chat/completions", CHAT)[:2], 503)
        gate.set()
        assert live.state.ready.wait(60)
        assert http(live, "GET", "/health")[:2] == (200, {"status": "ok"})
    finally:
        gate.set()
        live.stop()


def test_draining_refuses_new_requests_with_503(tiny_loaded):
    live = start_server(tiny_loaded)
    try:
        live.state.drain()
        code, answer, _ = http(live, "POST", "/v1/chat/completions", CHAT)
        assert_error(code, answer, 503)
        assert answer["error"]["code"] == "shutting_down"
        assert http(live, "GET", "/health")[0] == 503
    finally:
        live.stop()


def test_a_full_queue_is_429_and_nothing_is_lost():
    loaded, _ = scripted(delay_s=0.02)
    live = start_server(loaded, method="none", engine=EngineConfig(max_batch=1, max_queue=1))
    results = {}
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 60, "temperature": 0}

        def run(name):
            results[name] = http(live, "POST", "/v1/completions", body)

        first = threading.Thread(target=run, args=("first",))
        first.start()
        _wait(lambda: live.state.worker.engine.running, "the first request to run")
        second = threading.Thread(target=run, args=("second",))
        second.start()
        _wait(lambda: live.state.worker.engine.waiting, "the second request to wait")
        code, answer, _ = http(live, "POST", "/v1/completions", body)
        assert_error(code, answer, 429)
        assert answer["error"]["type"] == "rate_limit_error"
        first.join(60)
        second.join(60)
        assert results["first"][0] == results["second"][0] == 200
        assert results["first"][1]["choices"][0]["text"] == results["second"][1]["choices"][0]["text"]
    finally:
        live.stop()


def test_timeout_is_an_error_not_a_hang():
    loaded, _ = scripted(delay_s=0.05)
    live = start_server(loaded, method="none", request_timeout_s=0.3)
    try:
        code, answer, _ = http(live, "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 200})
        assert_error(code, answer, 504)
        _wait(lambda: not live.state.worker.engine.busy, "the timed-out request to leave the engine")
    finally:
        live.stop()


# -- text across chunks --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted_server():
    loaded, _ = scripted()
    live = start_server(loaded, method="ngram")
    yield live
    live.stop()


def _stream_text(live, body) -> tuple[str, list[str], list[str]]:
    status, frames = sse_frames(live, "/v1/completions", {**body, "stream": True})
    assert status == 200 and frames[-1] == "[DONE]"
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    return "".join(c["text"] for c in chunks), [c["text"] for c in chunks], [c["finish_reason"] for c in chunks]


@pytest.mark.parametrize("spec", [False, {"method": "ngram", "k": 4}], ids=["plain", "ngram"])
def test_utf8_split_across_tokens_streams_whole_characters(scripted_server, spec):
    body = {"model": "tiny", "prompt": "h", "max_tokens": 120, "temperature": 0, "speculative": spec}
    text, pieces, _ = _stream_text(scripted_server, body)
    expected = (SCRIPT * 4).encode()[1:121].decode("utf-8", errors="ignore")
    assert text.startswith(expected[:40]) and "\ufffd" not in text
    assert all(p == "" or "\ufffd" not in p for p in pieces)
    code, answer, _ = http(scripted_server, "POST", "/v1/completions", body)
    assert answer["choices"][0]["text"] == text


@pytest.mark.parametrize("stop", ["ld, 你", "😀 —", "end? ✓ h"])
@pytest.mark.parametrize("spec", [False, {"method": "ngram", "k": 4}], ids=["plain", "ngram"])
def test_stop_strings_across_chunk_boundaries(scripted_server, stop, spec):
    body = {"model": "tiny", "prompt": "h", "max_tokens": 100, "temperature": 0, "stop": [stop], "speculative": spec}
    text, pieces, reasons = _stream_text(scripted_server, body)
    full = SCRIPT[1:] + SCRIPT
    assert text == full[: full.index(stop)]
    assert reasons[-1] == "stop"
    code, answer, _ = http(scripted_server, "POST", "/v1/completions", body)
    assert answer["choices"][0]["text"] == text and answer["choices"][0]["finish_reason"] == "stop"


# -- disconnects and metrics ---------------------------------------------------------------------
def test_a_disconnected_stream_is_cancelled_within_a_step():
    loaded, _ = scripted(delay_s=0.02)
    live = start_server(loaded, method="none")
    try:
        host, port = live.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2000, "stream": True}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        received = b""
        while b"data:" not in received:
            received += sock.recv(65536)
        assert metric(live, "num_requests_running") == 1
        sock.close()
        t = time.monotonic()
        _wait(lambda: not live.state.worker.engine.busy, "the cancelled request to leave the engine")
        assert time.monotonic() - t < 2.0
        _wait(lambda: metric(live, "request_success_total", finished_reason="cancelled") == 1, "the metrics")
        assert metric(live, "num_requests_running") == 0
        assert metric(live, "generation_tokens_total") < 2000
    finally:
        live.stop()


def test_metrics_agree_with_the_responses(tiny_loaded):
    live = start_server(tiny_loaded, method="ngram")
    try:
        client = openai_client(live)
        outs = [
            client.completions.create(
                model="tiny",
                prompt=f"p{i} abab",
                max_tokens=10 + i,
                temperature=0,
                extra_body={"speculative": {"k": 3}},
            )
            for i in range(4)
        ]
        outs.append(
            client.completions.create(model="tiny", prompt="plain", max_tokens=5, extra_body={"speculative": False})
        )
        assert metric(live, "generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
        assert metric(live, "prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
        spec = [o.usage.model_extra["speculative"] for o in outs[:4]]
        assert metric(live, "spec_decode_num_draft_tokens_total") == sum(s["drafted_tokens"] for s in spec)
        assert metric(live, "spec_decode_num_accepted_tokens_total") == sum(s["accepted_tokens"] for s in spec)
        assert metric(live, "spec_decode_num_accepted_tokens_per_pos_total") == sum(s["accepted_tokens"] for s in spec)
        assert metric(live, "request_success_total") == 5
        assert metric(live, "time_to_first_token_seconds_count") == 5
        assert metric(live, "e2e_request_latency_seconds_count") == 5
        assert metric(live, "num_requests_running") == 0 and metric(live, "num_requests_waiting") == 0
        _, text, headers = http(live, "GET", "/metrics")
        assert headers["content-type"].startswith("text/plain")
        for name in (
            "kv_cache_usage_perc",
            "inter_token_latency_seconds",
            "request_queue_time_seconds",
            "spec_decode_k",
        ):
            assert f"specdecode:{name}" in text
    finally:
        live.stop()


def test_openapi_document_lists_the_routes(server):
    code, doc, _ = http(server, "GET", "/openapi.json")
    assert code == 200
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])


def _wait(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_echo_and_several_prompts(scripted_server):
    body = {"model": "tiny", "prompt": ["h", "hé"], "max_tokens": 5, "temperature": 0, "echo": True, "n": 2}
    code, answer, _ = http(scripted_server, "POST", "/v1/completions", body)
    assert code == 200
    texts = [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
    assert texts[0] == texts[1] and texts[0].startswith("h") and texts[2].startswith("hé")
    streamed, _, _ = _stream_text(scripted_server, {**body, "prompt": "h", "n": 1})
    assert streamed == texts[0]
    code, answer, _ = http(scripted_server, "POST", "/v1/completions", {**body, "stop": [""]})
    assert_error(code, answer, 400, "stop")
