"""``specdecode serve``: the OpenAI-compatible server on uvicorn.

The port is bound at once; the model loads in a thread (``/health`` answers 503 until it is
ready). SIGTERM or Ctrl-C drains: new requests get 503, running ones finish (up to
``--drain-timeout`` seconds), then the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from specdecode.core.dtypes import DTYPE_CHOICES, DTYPE_HELP
from specdecode.engine import EngineConfig
from specdecode.errors import ConfigError
from specdecode.methods import method_names
from specdecode.models.catalog import CATALOG
from specdecode.serve.state import ModelSource, ServerConfig


class _Parser(argparse.ArgumentParser):
    """Usage errors as one ``error:`` line (ConfigError), like every other command."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ConfigError(f"serve: {message}")


def _k(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive(kind: type, allow_zero: bool = False):
    """An argparse type: a ``kind`` number above 0 (or at least 0 with ``allow_zero``)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > 0 or (allow_zero and value == 0)):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be {'>=' if allow_zero else '>'} 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specdecode serve", description="An OpenAI-compatible server on the batched speculative engine.")
    p.add_argument("--target", default=None, help="transformers folder or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default=None, help="draft model (method draft) or trained head folder")
    p.add_argument(
        "--draft-vocab",
        type=_positive(int),
        default=None,
        help="the draft model's head cut to its N most common tokens plus each request's context's "
        "(default 32768 for a draft over 65536 ids)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help=DTYPE_HELP,
    )
    p.add_argument("--backend", choices=["auto", "native", "transformers"], default="auto")
    p.add_argument("--threads", type=_positive(int), default=None, help="torch CPU threads (default: free cores)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the model file's name)")
    p.add_argument("--method", choices=list(method_names()), default="auto", help="default method of requests")
    p.add_argument("--k", type=_k, default=None, help="default drafts per round, or 'auto' (default 4 / measured)")
    p.add_argument("--k-max", type=_positive(int), default=8, help="upper bound of k 'auto'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=_positive(int), default=32, help="requests in one batch")
    p.add_argument("--kv-budget", type=_positive(int), default=None, help="cache positions over all requests")
    p.add_argument("--max-queue", type=_positive(int), default=256, help="waiting requests before 429")
    p.add_argument("--prefill-chunk", type=_positive(int), default=512, help="prompt tokens per step")
    p.add_argument(
        "--prefix-cache-mb",
        type=_positive(int, allow_zero=True),
        default=EngineConfig.prefix_cache_mb,
        help="memory for stored prompt prefixes that later prompts starting the same way (a system prompt, a "
        "conversation so far) reuse instead of prefilling; 0: off (default %(default)s)",
    )
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 routes")
    p.add_argument("--max-body-bytes", type=_positive(int), default=1 << 20)
    p.add_argument("--max-prompt-tokens", type=_positive(int), default=None, help="default: the model's window")
    p.add_argument("--max-tokens", type=_positive(int), default=4096, help="most new tokens per request")
    p.add_argument("--request-timeout", type=_positive(float), default=600.0, help="seconds per request")
    p.add_argument("--drain-timeout", type=_positive(float), default=30.0, help="seconds to finish on SIGTERM")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    ray = p.add_argument_group("Ray Serve (pip install 'specdecode[ray]')")
    ray.add_argument("--ray", action="store_true", help="serve as replicas of a Ray Serve deployment")
    ray.add_argument("--replicas", type=_positive(int), default=None, help="a fixed number of replicas (default 1)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (>= 0)")
    ray.add_argument("--max-replicas", type=_positive(int), default=None, help="autoscaling: most replicas")
    ray.add_argument(
        "--target-ongoing-requests", type=_positive(float), default=None, help="autoscaling: requests per replica"
    )
    ray.add_argument("--ray-address", default=None, help="join a cluster (ray start --head ...); default: local")
    return p


RAY_OPTIONS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "ray_address")


def server_config(args: argparse.Namespace):

    engine = EngineConfig(
        max_batch=args.max_batch,
        kv_budget=args.kv_budget,
        prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue,
        prefix_cache_mb=args.prefix_cache_mb,
    )
    return ServerConfig(
        model_name=args.model_name or (args.target if args.target in CATALOG else None),  # a catalog name as given
        method=args.method,
        k=args.k,
        k_max=args.k_max,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        drain_s=args.drain_timeout,
        engine=engine,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    ray_only = [f"--{n.replace('_', '-')}" for n in RAY_OPTIONS if getattr(args, n) is not None]
    if ray_only and not args.ray:
        raise ConfigError(f"{', '.join(ray_only)} need --ray")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.log_level != "error":  # say when the model is ready and under which id, whatever uvicorn logs
        logging.getLogger("specdecode.serve").setLevel(logging.INFO)
    config = server_config(args)
    source = ModelSource(args.target, args.draft, args.method, args.dtype, args.backend, args.draft_vocab)
    if args.ray:
        from specdecode.serve.ray_app import RayScaling, import_ray, run_on_ray

        import_ray()  # the one-line error before anything starts
        scaling = RayScaling(args.replicas, args.min_replicas, args.max_replicas, args.target_ongoing_requests)
        return run_on_ray(source, config, scaling, args)
    import torch

    from specdecode.runtime import free_cores
    from specdecode.serve.app import create_app

    torch.set_num_threads(args.threads or free_cores())
    app = create_app(source, config)
    uv = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(max(1, args.drain_timeout)),
        access_log=args.log_level in ("debug", "info"),
    )
    server = DrainingServer(uv, app.state.server)
    print(
        f"specdecode serve: http://{args.host}:{args.port}/v1 (loading the model; GET /health says when ready)",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    return 0


class DrainingServer(uvicorn.Server):
    """A uvicorn server that marks the app draining (503 for new requests) on SIGTERM / Ctrl-C."""

    def __init__(self, config: uvicorn.Config, state: Any) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.state.drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handlers for SIGINT/SIGTERM, restored afterwards; unlike uvicorn's own, the signal is
        not raised again after the drain, so a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
