"""``specdecode serve``: an OpenAI-compatible HTTP server on the batched speculative engine."""

from specdecode.serve.app import create_app
from specdecode.serve.state import ServerConfig

__all__ = ["ServerConfig", "create_app"]
