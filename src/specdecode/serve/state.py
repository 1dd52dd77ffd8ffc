"""What a server holds: its settings, the loaded model, the engine worker, its metrics, and the
shared proposer prototypes (built once per method and options, shared by every request).

Per-request state lives in the engine's requests and in each handler; nothing here is written
by a request except the bounded cache of prototypes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.api import make_proposer, measured_draft, resolve_speculation
from specdecode.core.sampling import SamplingConfig, is_greedy
from specdecode.engine import Engine, EngineConfig, GenerationConfig, Speculation
from specdecode.errors import ConfigError
from specdecode.methods import method_names
from specdecode.models.loading import LoadedModel
from specdecode.proposers.base import Proposer
from specdecode.serve.metrics import ServerMetrics
from specdecode.serve.schemas import SpeculativeSettings, _Generation
from specdecode.serve.worker import EngineWorker

log = logging.getLogger("specdecode.serve")
LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
PROTOTYPES = 16  # proposer prototypes kept (method x options); more are rebuilt on demand


@dataclass(frozen=True)
class ServerConfig:
    """Server-wide settings and limits (per-request settings come in each request's body)."""

    model_name: str | None = None  # the id clients send as ``model``; default: the model file's name
    method: str = "auto"
    k: int | str | None = None  # None: 4, or what the auto-chosen drafter was measured with
    k_max: int = 8
    confidence: float | None = None
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: the model's window less one token
    max_tokens: int = 4096  # the most new tokens one request may ask for
    request_timeout_s: float = 600.0
    drain_s: float = 30.0
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if not self.request_timeout_s > 0 or not self.drain_s >= 0:
            raise ConfigError("request_timeout_s must be > 0 and drain_s >= 0")


Loader = Callable[[], tuple[LoadedModel, Any]]  # -> (target, draft model or None)


@dataclass(frozen=True)
class ModelSource:
    """Where a server's models come from (a picklable loader: Ray ships it to every replica)."""

    target: str | None = None  # None: the embedded default model
    draft: str | None = None  # a draft model (methods draft, xtok) or a trained head folder
    method: str = "auto"
    dtype: str = "float32"
    backend: str = "auto"
    draft_vocab: int | None = None  # the draft model's head cut to its N most common tokens

    def __post_init__(self) -> None:
        if self.draft_vocab is not None and (self.method == "xtok" or (self.draft is None and self.method != "auto")):
            raise ConfigError(
                "--draft-vocab needs --draft (methods draft, hybrid) or method auto measured with a draft"
            )

    def __call__(self) -> tuple[LoadedModel, Any]:
        from specdecode.models.loading import load_draft, load_model
        from specdecode.models.native import with_draft_vocab

        target = load_model(self.target, dtype=self.dtype, backend=self.backend)
        draft: Any = self.draft
        if self.draft is not None and self.method in ("draft", "xtok"):
            draft = load_draft(self.draft, self.dtype)
        elif self.draft is None and self.method == "auto" and (measured := measured_draft(target)):
            draft = load_model(measured[0], dtype=measured[1])  # once, shared by every request
        if self.draft_vocab is not None:
            if isinstance(draft, str):  # hybrid's second source, loaded here to be cut once
                draft = load_draft(draft, self.dtype)
            if not isinstance(draft, LoadedModel):
                raise ConfigError("--draft-vocab needs a draft model (--draft, or method auto measured with one)")
            draft = with_draft_vocab(draft, self.draft_vocab)
        return target, draft


class ServerState:
    """One server's model, worker and metrics; ``status`` moves loading -> ready -> draining."""

    def __init__(self, load: Loader, config: ServerConfig) -> None:
        self.config = config
        self._load = load
        self.status = LOADING
        self.error = ""
        self.created = int(time.time())
        self.target: LoadedModel | None = None
        self.draft: Any = None
        self.worker: EngineWorker | None = None
        self.metrics: ServerMetrics | None = None
        self.model_id = config.model_name or ""
        self._prototypes: OrderedDict[tuple, Proposer | None] = OrderedDict()
        self._lock = threading.Lock()
        self.ready = threading.Event()

    # -- start and stop --------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model and start the engine (in a thread: /health answers 503 meanwhile)."""
        try:
            self.target, self.draft = self._load()
            self.model_id = self.config.model_name or model_id(self.target.source)
            self.metrics = ServerMetrics(self.model_id)
            for sampled in (False, True):  # build the default method's proposers before serving
                self.default_speculation(None, sampled)
            engine = Engine(
                self.target.model,
                eos_token_ids=self.target.eos_token_ids,
                tokenizer=self.target.tokenizer,
                config=self.config.engine,
            )
            self.worker = EngineWorker(engine, self.metrics)
            self.worker.start()
            self.status = READY
            log.info("ready: serving %r (default method %s)", self.model_id, self.config.method)
        except Exception as exc:  # reported by /health and the log; the process keeps answering
            log.exception("loading the model failed")
            self.status, self.error = FAILED, f"loading the model failed: {exc}"
        finally:
            self.ready.set()

    def drain(self) -> None:
        """Stop taking requests (503); running ones go on."""
        if self.status == READY:
            self.status = DRAINING

    def shutdown(self) -> None:
        self.drain()
        if self.worker is not None:
            drained = self.worker.stop(self.config.drain_s)
            if not drained:
                log.warning(
                    "drain timed out after %.0f s; the requests still running were cancelled", self.config.drain_s
                )

    # -- per request -----------------------------------------------------------------------------
    @property
    def window(self) -> int:
        return self.target.model.max_length

    @property
    def max_prompt_tokens(self) -> int:
        limit = self.window - 1
        return min(limit, self.config.max_prompt_tokens or limit)

    def default_speculation(self, settings: SpeculativeSettings | bool | None, sampled: bool = False) -> Speculation:
        """The request's ``speculative`` object over the server's defaults (``False``: plain);
        ``sampled``: the request samples (``auto`` picks what was measured best on sampled requests)."""
        cfg = self.config
        if settings is False:
            return Speculation()
        settings = settings or SpeculativeSettings()
        method = settings.method or cfg.method
        k = settings.k if settings.k is not None else (cfg.k if method == cfg.method else None)
        confidence = settings.confidence if settings.confidence is not None else cfg.confidence
        policy = "confidence" if settings.confidence is not None else None
        return resolve_speculation(
            self.target,
            method,
            k,
            self.draft,
            policy=policy,
            k_max=cfg.k_max,
            confidence=confidence,
            factory=self._prototype,
            sampled=sampled,
        )

    def _prototype(self, method: str, options: dict[str, Any]) -> Proposer | None:
        """The shared proposer prototype for ``method`` with ``options`` (built once, LRU-bounded)."""
        key = (method, tuple(sorted(options.items())))
        with self._lock:
            if key in self._prototypes:
                self._prototypes.move_to_end(key)
                return self._prototypes[key]
            proposer = make_proposer(method, self.target, self.draft, **options)
            self._prototypes[key] = proposer
            if len(self._prototypes) > PROTOTYPES:
                self._prototypes.popitem(last=False)
            return proposer

    def generation(self, body: _Generation, max_tokens: int, index: int) -> GenerationConfig:
        """One choice's settings; OpenAI's defaults (temperature 1) where the body is silent."""
        sampling = SamplingConfig(
            temperature=_temperature(body),
            top_k=max(body.top_k or 0, 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
        )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        seed = None if body.seed is None else body.seed + index
        logprobs = _logprobs_wanted(body)
        return GenerationConfig(
            max_new_tokens=max_tokens,
            sampling=sampling,
            stop_strings=stop,
            seed=seed,
            logprobs=logprobs,
            cache_salt=body.cache_salt,
        )

    def sampled(self, body: _Generation) -> bool:
        """Whether the request samples (a bad temperature is refused later, with its own error)."""
        return not is_greedy(_temperature(body))

    def methods(self) -> list[str]:
        return list(method_names())


def _temperature(body: _Generation) -> float:
    """The body's temperature, OpenAI's default 1 where it is silent."""
    return 1.0 if body.temperature is None else body.temperature


def _logprobs_wanted(body: _Generation) -> int | None:
    value = getattr(body, "logprobs", None)
    if value is True:
        return getattr(body, "top_logprobs", None) or 0
    if value is False or value is None:
        return None
    return int(value)


def model_id(source: str) -> str:
    """A model's id from where it was loaded: the file or folder name, without .gguf or the
    content hash a converted GGUF's cache folder carries."""
    name = Path(source).name
    if name.lower().endswith(".gguf"):
        return name[: -len(".gguf")]
    return re.sub(r"-[0-9a-f]{12}$", "", name)
