"""The OpenAI-compatible HTTP API (FastAPI) over one batched engine.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` (503 while loading or draining), ``GET /metrics`` (Prometheus) and the
generated OpenAPI document at ``/openapi.json``. Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (503 while loading or
shutting down); bad input never gives a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.api import encode_chat, encode_prompt
from specdecode.engine import StreamEvent
from specdecode.errors import ConfigError, InputError, QueueFullError, SpecDecodeError
from specdecode.serve.responses import LogprobFormatter, finish_reason, sse, usage
from specdecode.serve.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelList,
    _Generation,
    error_body,
)
from specdecode.serve.state import DRAINING, FAILED, LOADING, Loader, ServerConfig, ServerState
from specdecode.serve.worker import Failed, Finished, Job

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503, 504)}
STREAM = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks when stream is true"}}


class ApiError(Exception):
    """An error answered in OpenAI's schema."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def create_app(
    load: Loader,
    config: ServerConfig | None = None,
    *,
    background_load: bool = True,
    metrics_view: Callable[[ServerState], Awaitable[bytes]] | None = None,
    replica: str | None = None,
) -> FastAPI:
    """The app; ``load()`` -> (target, draft or None) runs at startup: in a thread while the
    server already answers (``background_load``; /health is 503 meanwhile), or before it does
    (a Ray replica is ready only once loaded). ``metrics_view`` renders /metrics instead of this
    server's own registry (Ray: every replica's); ``replica`` names this copy of the server in an
    ``x-specdecode-replica`` header on every response."""
    state = ServerState(load, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if background_load:
            threading.Thread(target=state.load, name="specdecode-load", daemon=True).start()
        else:
            await asyncio.to_thread(state.load)
        yield
        await asyncio.to_thread(state.shutdown)

    from specdecode import __version__

    app = FastAPI(title="specdecode", version=__version__, lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodyLimit, max_bytes=state.config.max_body_bytes)
    if replica is not None:
        app.add_middleware(ReplicaHeader, replica=replica)
    _install_error_handlers(app)
    auth = [Depends(_auth(state.config.api_key))]

    @app.get("/health", response_model=Health, responses={503: {"model": ErrorResponse}})
    async def health() -> Any:
        _ready(state)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        if metrics_view is not None:
            return Response(await metrics_view(state), media_type="text/plain; version=0.0.4; charset=utf-8")
        if state.metrics is None:
            return Response(b"", media_type="text/plain")
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models", response_model=ModelList, dependencies=auth, responses=ERRORS)
    async def models() -> Any:
        _ready(state)
        card = {
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "specdecode",
            "methods": state.methods(),
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", response_model=ChatCompletion, dependencies=auth, responses={**ERRORS, **STREAM})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        _check(state, body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = encode_chat(state.target.tokenizer, messages)
        except InputError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except Exception as exc:  # the model's template refused these messages (e.g. role order)
            raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
        return await _run(state, request, body, [ids], chat=True)

    @app.post("/v1/completions", response_model=Completion, dependencies=auth, responses={**ERRORS, **STREAM})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check(state, body)
        prompts = _prompt_ids(state, body)
        echo = None
        if body.echo:  # the prompt's text ahead of each choice's completion
            if isinstance(body.prompt, str):
                echo = [body.prompt]
            elif all(isinstance(p, str) for p in body.prompt):
                echo = list(body.prompt)
            else:  # token ids
                echo = [state.target.tokenizer.decode(ids) for ids in prompts]
        return await _run(state, request, body, prompts, chat=False, echo=echo)

    return app


# -- checks --------------------------------------------------------------------------------------
def _ready(state: ServerState) -> None:
    if state.status == LOADING:
        raise ApiError(503, "the model is loading; try again shortly", "service_unavailable", code="loading")
    if state.status == DRAINING:
        raise ApiError(503, "the server is shutting down", "service_unavailable", code="shutting_down")
    if state.status == FAILED:
        raise ApiError(503, state.error, "service_unavailable", code="load_failed")


def _check(state: ServerState, body: _Generation) -> None:
    _ready(state)
    if body.model != state.model_id:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {state.model_id!r}",
            param="model",
            code="model_not_found",
        )


def _auth(key: str | None):
    async def check(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    return check


def _prompt_ids(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt of a completions request (text is encoded without a template)."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    vocab = state.target.model.vocab_size
    out = []
    for p in prompts:
        try:
            ids = encode_prompt(state.target.tokenizer, p, chat=False)
        except InputError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        out.append(ids)
    return out


def _max_tokens(state: ServerState, body: _Generation, prompt_len: int) -> int:
    """The request's token budget, checked against the server's limits and the model's window."""
    if prompt_len > state.max_prompt_tokens:
        raise ApiError(
            413,
            f"prompt too long: {prompt_len} tokens; this server accepts at most {state.max_prompt_tokens}",
            param="messages" if hasattr(body, "messages") else "prompt",
            code="prompt_too_long",
        )
    asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
    room = state.window - prompt_len
    if asked is None:
        return max(1, min(state.config.max_tokens, room))
    if asked > state.config.max_tokens:
        raise ApiError(
            400, f"max_tokens is {asked}; this server allows at most {state.config.max_tokens}", param="max_tokens"
        )
    if asked > room:
        raise ApiError(
            400,
            f"{prompt_len} prompt tokens + {asked} new tokens exceed the model's window of {state.window}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked


# -- running a request ---------------------------------------------------------------------------
async def _run(
    state: ServerState,
    request: Request,
    body: _Generation,
    prompts: list[list[int]],
    chat: bool,
    echo: list[str] | None = None,
) -> Any:
    budgets = [_max_tokens(state, body, len(ids)) for ids in prompts]
    try:
        spec = await asyncio.to_thread(state.default_speculation, body.speculative, state.sampled(body))
    except SpecDecodeError as exc:
        raise ApiError(400, str(exc), param="speculative") from None
    loop, items = asyncio.get_running_loop(), asyncio.Queue()
    jobs = []
    try:
        for p, (ids, budget) in enumerate(zip(prompts, budgets)):
            for j in range(body.n):
                config = state.generation(body, budget, j)
                jobs.append(await state.worker.submit(Job(p * body.n + j, ids, config, spec, loop, items)))
    except SpecDecodeError as exc:
        for job in jobs:
            state.worker.cancel(job)
        raise _submit_error(exc) from None
    call = _Call(state, request, body, jobs, items, chat, sum(map(len, prompts)))
    if echo is not None:
        call.echo = {job.index: echo[job.index // body.n] for job in jobs}
    if body.stream:
        return StreamingResponse(call.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(await call.collect())


def _submit_error(exc: SpecDecodeError) -> ApiError:
    if isinstance(exc, QueueFullError):
        return ApiError(429, str(exc), "rate_limit_error", code="queue_full")
    if isinstance(exc, ConfigError):
        return ApiError(400, str(exc), param="speculative")
    return ApiError(400, str(exc))


class _Call:
    """One HTTP request's choices in flight: collected into one body, or streamed as chunks."""

    def __init__(self, state, request, body, jobs, items, chat: bool, prompt_tokens: int) -> None:
        self.state, self.request, self.body, self.jobs, self.items = state, request, body, jobs, items
        self.chat, self.prompt_tokens = chat, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.deadline = time.monotonic() + state.config.request_timeout_s
        self.format = LogprobFormatter(state.target.tokenizer)
        logprobs = getattr(body, "top_logprobs", None) if chat else getattr(body, "logprobs", None)
        self.top = int(logprobs or 0)
        self.want_logprobs = jobs[0].config.logprobs is not None
        self.offsets = {job.index: 0 for job in jobs}  # completions' text_offset, per choice
        self.emitted, self.continuous = 0, False  # tokens streamed so far (all choices)
        self.echo: dict[int, str] = {}  # completions' echo: prompt text per choice

    def cancel(self) -> None:
        for job in self.jobs:
            self.state.worker.cancel(job)

    async def _watch(self) -> None:
        """Cancel every choice as soon as the client goes away."""
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return

    async def _next(self) -> tuple[int, Any]:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return await asyncio.wait_for(self.items.get(), left)

    def _timeout(self) -> ApiError:
        s = self.state.config.request_timeout_s
        return ApiError(504, f"the request did not finish within {s:g} s", "timeout_error", code="timeout")

    # -- one JSON body ---------------------------------------------------------------------------
    async def collect(self) -> dict[str, Any]:
        watcher = asyncio.create_task(self._watch())
        events: dict[int, list[StreamEvent]] = {job.index: [] for job in self.jobs}
        results = {}
        try:
            while len(results) < len(self.jobs):
                index, item = await self._next()
                if isinstance(item, Failed):
                    raise ApiError(503, item.message, "service_unavailable", code="engine_failed")
                if isinstance(item, Finished):
                    results[index] = item.result
                else:
                    events[index].append(item)
        except TimeoutError:
            raise self._timeout() from None
        finally:
            watcher.cancel()
            self.cancel()
        choices = [self._choice(i, results[i], events[i]) for i in sorted(results)]
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.state.model_id}
        return {**body, "choices": choices, "usage": usage(self.prompt_tokens, [results[i] for i in sorted(results)])}

    def _choice(self, index: int, result: Any, events: list[StreamEvent]) -> dict[str, Any]:
        logprobs = None
        if self.chat:
            if self.want_logprobs:
                logprobs = {"content": [e for ev in events for e in self.format.chat(ev, self.top)]}
            message = {"role": "assistant", "content": result.text}
            return {"index": index, "message": message, "finish_reason": finish_reason(result), "logprobs": logprobs}
        prefix = self.echo.get(index, "")
        if self.want_logprobs:
            logprobs = self.format.completion(events, len(prefix), self.top)
        text = prefix + result.text
        return {"index": index, "text": text, "finish_reason": finish_reason(result), "logprobs": logprobs}

    # -- Server-Sent Events ----------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[bytes]:
        watcher = asyncio.create_task(self._watch())
        results = {}
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        self.continuous = bool(options and options.continuous_usage_stats)
        try:
            for job in self.jobs:
                if self.chat:
                    yield self._chunk(job.index, {"role": "assistant", "content": ""}, None)
                elif job.index in self.echo:
                    self.offsets[job.index] = len(self.echo[job.index])
                    yield self._chunk(job.index, self.echo[job.index], None)
            while len(results) < len(self.jobs):
                try:
                    index, item = await self._next()
                except TimeoutError:
                    yield sse(self._timeout().body)
                    break
                if isinstance(item, Failed):
                    yield sse(error_body(item.message, "service_unavailable", code="engine_failed"))
                    break
                if isinstance(item, Finished):
                    results[index] = item.result
                    yield self._chunk(index, {} if self.chat else "", finish_reason(item.result))
                    continue
                self.emitted += len(item.token_ids)
                if item.text or self.want_logprobs or self.continuous:
                    yield self._chunk(index, {"content": item.text} if self.chat else item.text, None, item)
            else:
                if include_usage:
                    done = [results[i] for i in sorted(results)]
                    yield sse(self._frame([], usage=usage(self.prompt_tokens, done)))
            yield sse("[DONE]")
        finally:
            watcher.cancel()
            self.cancel()

    def _chunk(self, index: int, delta: Any, reason: str | None, event: StreamEvent | None = None) -> bytes:
        logprobs = None
        if event is not None and self.want_logprobs:
            if self.chat:
                logprobs = {"content": self.format.chat(event, self.top)}
            else:
                logprobs = self.format.completion([event], self.offsets[index], self.top)
                self.offsets[index] += sum(len(t) for t in logprobs["tokens"])
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        if self.continuous:  # vLLM's extension: every chunk says how many tokens have come so far
            n = self.emitted
            return sse(
                self._frame(
                    [choice],
                    usage={
                        "prompt_tokens": self.prompt_tokens,
                        "completion_tokens": n,
                        "total_tokens": self.prompt_tokens + n,
                    },
                )
            )
        return sse(self._frame([choice]))

    def _frame(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model_id,
            "choices": choices,
            **extra,
        }


# -- errors and limits ---------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = _field_path(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        elif first.get("type") == "missing" and not loc:
            message = "the request body must be a JSON object"
        else:
            where = ".".join(loc) or "body"
            message = f"{where}: {first.get('msg', 'invalid value')}"
        return JSONResponse(error_body(message, "invalid_request_error", ".".join(loc) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(
            error_body(message, "invalid_request_error", code=str(exc.status_code)), status_code=exc.status_code
        )


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "body"})


def _field_path(loc: tuple) -> list[str]:
    """The field names and list indices of a validation error's location, without pydantic's
    union-member tags (``SpeculativeSettings``, ``literal[False]``, ``list[str]``...)."""
    path = []
    for part in loc:
        if isinstance(part, int):
            path.append(str(part))
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in TYPE_TAGS:
            path.append(part)
        elif part != "body":
            break  # a union member's tag: what follows describes that member, not the field
    return path


class ReplicaHeader:
    """ASGI middleware: ``x-specdecode-replica`` on every response (which copy answered)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (b"x-specdecode-replica", replica.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is refused with 413 before parsing
    (whether or not it declares its length)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            chunks.append(message)
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any) -> None:
        payload = JSONResponse(
            error_body(
                f"request body too large (limit {self.max_bytes} bytes)", "invalid_request_error", code="body_too_large"
            ),
            status_code=413,
        )
        await send({"type": "http.response.start", "status": 413, "headers": payload.raw_headers})
        await send({"type": "http.response.body", "body": payload.body})
