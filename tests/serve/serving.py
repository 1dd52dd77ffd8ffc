"""Servers for the serve tests: real uvicorn servers on a free loopback port, in this process
(a tiny random model with a byte-level tokenizer, so every test runs in seconds)."""

from __future__ import annotations

import threading
import time

import uvicorn

from helpers import save_tiny_llama
from specdecode.engine import EngineConfig
from specdecode.serve import ServerConfig, create_app

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class LiveServer:
    """A uvicorn server in a thread; ``url`` once started; ``stop()`` shuts it down (lifespan too)."""

    def __init__(self, load, config: ServerConfig) -> None:
        self.app = create_app(load, config)
        self.state = self.app.state.server
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait_ready: bool = True) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if wait_ready:
            assert self.state.ready.wait(60)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def save_chat_model(folder) -> None:
    """The tiny random Llama with the byte-level tokenizer and a small chat template."""
    from transformers import AutoTokenizer

    save_tiny_llama(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)


def start_server(loaded, **overrides) -> LiveServer:
    engine = overrides.pop("engine", EngineConfig(max_batch=16, max_queue=256))
    config = ServerConfig(model_name="tiny", method=overrides.pop("method", "ngram"), engine=engine, **overrides)
    return LiveServer(lambda: (loaded, None), config).start()


SCRIPT = "héllo wörld, 你好 😀 — the end? ✓ "  # multi-byte characters split across byte tokens


class ScriptedLM:
    """A CausalLM whose greedy output at position p is token ``script[p % len(script)]`` (byte-level
    ids): deterministic text with multi-byte characters spread over several tokens. ``delay_s``
    per forward makes requests slow enough to queue, cancel or time out."""

    backend = "scripted"

    def __init__(self, script_ids: list[int], vocab: int, delay_s: float = 0.0, max_length: int = 4096) -> None:
        from specdecode.models.base import ModelCaps

        self.caps = ModelCaps()
        self.script, self.vocab_size, self.delay_s, self.max_length = script_ids, vocab, delay_s, max_length

    def new_cache(self, max_length: int):
        from specdecode.testing import TokenCache

        return TokenCache()

    def forward(self, input_ids, cache, positions=None, attn_mask=None, last_only=False):
        import torch

        if self.delay_s:
            time.sleep(self.delay_s)
        start = cache.length
        cache.tokens.extend(input_ids[0].tolist())
        n = input_ids.shape[1]
        logits = torch.zeros(n, self.vocab_size)
        for i in range(n):
            logits[i, self.script[(start + i + 1) % len(self.script)]] = 8.0
        return logits[None]


def scripted(delay_s: float = 0.0):
    """(LoadedModel over a ScriptedLM with the byte-level tokenizer, the script's token ids)."""
    from helpers import byte_tokenizer
    from specdecode.models.loading import LoadedModel

    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.encode(SCRIPT)
    return LoadedModel(model=ScriptedLM(ids, len(tok), delay_s), tokenizer=tok, source="scripted"), ids


def openai_client(live: LiveServer, api_key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def http(live: LiveServer, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
    """(status, parsed JSON or text, headers) of one plain HTTP request."""
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(live.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text), dict(resp.getheaders())
    except ValueError:
        return resp.status, text, dict(resp.getheaders())


def sse_frames(live: LiveServer, path: str, body: dict, headers=None) -> tuple[int, list[str]]:
    """(status, the raw ``data:`` payloads) of a streaming request, checking the SSE framing."""
    import http.client
    import json
    from urllib.parse import urlparse

    u = urlparse(live.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request(
        "POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    if resp.status != 200:
        return resp.status, [raw]
    assert resp.getheader("content-type", "").startswith("text/event-stream")
    assert raw.endswith("\n\n"), "every frame ends with a blank line"
    frames = raw[:-2].split("\n\n")
    assert all(f.startswith("data: ") for f in frames), frames
    return resp.status, [f[len("data: ") :] for f in frames]


def metric(live: LiveServer, name: str, **labels) -> float:
    """One sample of /metrics (prometheus text parsed with prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text, _ = http(live, "GET", "/metrics")
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specdecode:" + name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
