"""Servers for the serve tests: real uvicorn servers on a free loopback port, in this process
(a tiny random model with a byte-level tokenizer, so every test runs in seconds)."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn

from helpers import save_tiny_llama
from specdecode.engine import EngineConfig
from specdecode.models.loading import load_model
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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-serve")
    save_tiny_llama(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


def start_server(loaded, **overrides) -> LiveServer:
    engine = overrides.pop("engine", EngineConfig(max_batch=16, max_queue=256))
    config = ServerConfig(model_name="tiny", method=overrides.pop("method", "ngram"), engine=engine, **overrides)
    return LiveServer(lambda: (loaded, None), config).start()


@pytest.fixture(scope="module")
def server(tiny_loaded):
    live = start_server(tiny_loaded)
    yield live
    live.stop()
