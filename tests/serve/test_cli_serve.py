"""``specdecode serve`` as a user starts it: a separate process on a free loopback port.
SIGTERM drains (running requests finish, new ones are refused, exit 0); bad options are one
``error:`` line; on the real model, served greedy output equals ``specdecode generate``'s."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import run_cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "specdecode.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def wait_ready(self, timeout: float = 180) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):  # refused, reset, or timed out while starting
                pass
            time.sleep(0.1)
        raise AssertionError("the server did not become ready")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _stream(url: str, body: dict, first_chunk: threading.Event, out: dict) -> None:
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = b""
    while True:
        line = resp.readline()
        if not line:
            break
        data += line
        if line.startswith(b"data:"):
            first_chunk.set()
    out["raw"] = data.decode()


def test_sigterm_drains_running_requests_and_exits_0(tmp_path):
    from serving import save_chat_model

    save_chat_model(tmp_path)
    server = ServeProcess("--target", str(tmp_path), "--model-name", "tiny", "--method", "none", "--threads", "1")
    try:
        server.wait_ready()
        first, out = threading.Event(), {}
        # eight choices of 240 tokens: still running when the signal arrives
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": 240, "temperature": 0, "n": 8, "stream": True}
        client = threading.Thread(target=_stream, args=(server.url, body, first, out))
        client.start()
        assert first.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        client.join(120)
        assert server.proc.wait(60) == 0
        frames = [f for f in out["raw"].split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        choices = [c for f in frames[:-1] for c in json.loads(f[6:])["choices"]]
        finished = sorted(c["index"] for c in choices if c["finish_reason"] == "length")
        assert finished == list(range(8))  # the running request finished: every choice, all 240 tokens
        with pytest.raises(OSError):  # and the port no longer takes requests
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    finally:
        server.stop()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["serve", "--k", "0"], "--k"),
        (["serve", "--port", "99999"], "--port"),
        (["serve", "--method", "nope"], "--method"),
        (["serve", "--max-batch", "x"], "--max-batch"),
        (["serve", "--method", "ngram", "--draft-vocab", "8"], "--draft-vocab needs --draft"),
        (["serve", "--draft-vocab", "0"], "--draft-vocab"),
        (["serve", "--request-timeout", "nan"], "--request-timeout"),
        (["serve", "--prefix-cache-mb", "-1"], "--prefix-cache-mb"),
    ],
)
def test_bad_options_are_one_error_line(argv, needle):
    rc, out, err = run_cli(argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err


@pytest.mark.slow
def test_real_model_served_greedy_equals_generate():
    import openai

    prompt = "Write a Python function that returns the square of a number."
    server = ServeProcess("--method", "ngram")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": prompt}]
        outs = [
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=48, temperature=0, extra_body={"speculative": spec}
            )
            for spec in (None, False, {"method": "ngram", "k": 5}, {"method": "suffix", "k": "auto"})
        ]
        rc, stdout, _ = run_cli(["generate", prompt, "--method", "none", "--max-new-tokens", "48", "--json"])
        assert rc == 0
        expected = json.loads(stdout)["text"]
        assert [o.choices[0].message.content for o in outs] == [expected] * 4
        assert outs[2].usage.model_extra["speculative"]["method"] == "ngram"
        assert server.stop() == 0
    finally:
        server.stop()


def test_ray_without_ray_installed_is_one_error_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    rc, out, err = run_cli(["serve", "--ray", "--replicas", "2"])
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: --ray needs Ray Serve, an optional extra: pip install 'specdecode[ray]'"
    ]
    rc, _, err = run_cli(["serve", "--replicas", "2"])
    assert rc == 2 and "--replicas need --ray" in err


@pytest.mark.slow
def test_serve_ray_as_a_process_serves_and_exits_0_on_sigterm(tmp_path):
    import openai

    from serving import save_chat_model

    save_chat_model(tmp_path)
    server = ServeProcess(
        "--ray", "--replicas", "1", "--target", str(tmp_path), "--model-name", "tiny", "--threads", "1"
    )
    try:
        server.wait_ready(timeout=240)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(model="tiny", prompt="ray", max_tokens=6, temperature=0)
        assert out.usage.completion_tokens == 6
        assert server.stop() == 0
    finally:
        server.stop()
