"""``bench-serve --url``: the same load generator against a running server, over HTTP, streaming.

Each in-flight request is one streaming ``POST /v1/completions`` (the prompt as token ids, so the
server sees exactly the tokens the engine bench feeds) on its own thread; ``advance`` returns the
chunks that arrived, timestamped on arrival. Token counts come from vLLM's
``stream_options.continuous_usage_stats`` (every chunk carries the tokens so far), so a chunk of
several speculated tokens counts as several. Each arm becomes the request's ``speculative``
field; a batch-size table is an engine policy and cannot be asked for per request.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from typing import Any
from urllib.parse import urlparse

from specdecode.bench.serve import Arm, LoadRequest, Progress
from specdecode.errors import ConfigError, InputError


class HttpTarget:
    """A server at ``url`` (``http://host:port``, with or without ``/v1``) as a serving target."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0, top_p: float = 1.0) -> None:
        parsed = urlparse(url if "://" in url else "http://" + url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ConfigError(f"--url: expected http://HOST:PORT, got {url!r}")
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.base = parsed.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s, self.top_p = timeout_s, top_p
        self.events: queue.Queue = queue.Queue()
        self.model = self._model_id()

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def _model_id(self) -> str:
        try:
            conn = self._connection()
            conn.request("GET", self.base + "/v1/models", headers=self.headers)
            resp = conn.getresponse()
            body = json.loads(resp.read() or b"{}")
        except (OSError, ValueError) as exc:
            raise InputError(f"--url: no OpenAI-compatible server at {self.host}:{self.port} ({exc})") from None
        if resp.status != 200 or not body.get("data"):
            message = (body.get("error") or {}).get("message", "")
            raise InputError(f"--url: GET /v1/models answered {resp.status} {message}".rstrip())
        return body["data"][0]["id"]

    # -- the ServeTarget protocol -----------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter()

    def skip_to(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))  # a real server's clock cannot be skipped

    def start_cell(self, arm: Arm, temperature: float, warmup: int) -> None:
        self.speculative = speculative_field(arm)
        self.temperature = temperature
        self.in_flight = 0
        warm = [LoadRequest(-1 - i, [1, 2, 3, 4], 4, i) for i in range(warmup)]
        for request in warm:
            self.submit(request)
        done = 0
        while done < len(warm):
            done += sum(p.finished for p in self.advance())

    def submit(self, request: LoadRequest) -> None:
        body = {
            "model": self.model,
            "prompt": request.prompt_ids,
            "max_tokens": request.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": request.seed,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "speculative": self.speculative,
        }
        self.in_flight += 1
        threading.Thread(target=self._stream, args=(request.index, body), daemon=True).start()

    def advance(self) -> list[Progress]:
        if not self.in_flight:
            raise RuntimeError("advance() with nothing in flight")
        out = [self.events.get()]
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                break
        for item in out:
            if isinstance(item, Exception):
                raise item
        self.in_flight -= sum(p.finished for p in out)
        return out

    def end_cell(self) -> dict[str, Any]:
        return {"over": "http", "url": f"http://{self.host}:{self.port}{self.base}"}

    # -- one request ------------------------------------------------------------------------------
    def _stream(self, index: int, body: dict[str, Any]) -> None:
        try:
            conn = self._connection()
            conn.request("POST", self.base + "/v1/completions", body=json.dumps(body), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise InputError(f"the server answered {resp.status}: {resp.read()[:300].decode(errors='replace')}")
            seen, reason, stats = 0, None, None
            for chunk in _sse(resp):
                usage = chunk.get("usage") or {}
                for choice in chunk.get("choices", []):
                    reason = choice.get("finish_reason") or reason
                if not chunk.get("choices"):  # the final usage chunk
                    stats = {**(usage.get("speculative") or {}), "new_tokens": usage.get("completion_tokens")}
                    continue
                tokens = int(usage.get("completion_tokens", seen)) - seen
                seen += tokens
                if tokens:
                    self.events.put(Progress(index, tokens))
            conn.close()
            self.events.put(Progress(index, 0, True, stats or {}, reason))
        except Exception as exc:  # handed to the load generator's thread, which raises it
            self.events.put(exc if isinstance(exc, InputError) else InputError(f"request {index} failed: {exc}"))


def _sse(resp: http.client.HTTPResponse):
    """The JSON payloads of an SSE stream, up to ``[DONE]``."""
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            raise InputError(f"the server sent an error: {payload['error'].get('message')}")
        yield payload


def speculative_field(arm: Arm) -> dict[str, Any] | bool:
    """The request's ``speculative`` object for an arm (ConfigError for what HTTP cannot ask)."""
    if arm.method == "none":
        return False
    if arm.kind == "table":
        raise ConfigError("a batch-size table is an engine policy; a request cannot ask for it over HTTP")
    field: dict[str, Any] = {"method": arm.method, "k": "auto" if arm.kind == "auto" or arm.policy == "auto" else arm.k}
    if "confidence_threshold" in arm.options:
        field["confidence"] = arm.options["confidence_threshold"]
    return field  # other options (the hybrid's drafter) are the server's own choice
