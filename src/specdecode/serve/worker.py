"""The engine's own thread: the HTTP event loop never blocks on a forward.

Handlers talk to the worker through a command queue (submit, cancel); the worker applies the
commands between steps, steps the engine while anything runs, and hands each job's events to
its asyncio queue with ``call_soon_threadsafe``. The engine is touched by this thread only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from specdecode.engine import Engine, GenerationConfig, GenerationResult, Speculation, StreamEvent
from specdecode.engine.request import Request
from specdecode.errors import SpecDecodeError
from specdecode.serve.metrics import ServerMetrics

log = logging.getLogger("specdecode.serve")


@dataclass(frozen=True)
class Finished:
    """The last item of a job's stream."""

    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    """The engine failed while running the job (a bug, never bad input): the request is lost."""

    message: str


@dataclass(eq=False)
class Job:
    """One generation (one choice of an HTTP request); its items arrive on ``queue`` as
    ``(index, StreamEvent | Finished | Failed)``, shared by the choices of one HTTP request."""

    index: int
    prompt_ids: list[int]
    config: GenerationConfig
    spec: Speculation
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    submitted: Future = field(default_factory=Future)
    request: Request | None = None
    last_emit: float | None = None
    done: bool = False


class EngineWorker:
    """Runs one engine in a daemon thread; ``submit``/``cancel`` are safe from any thread."""

    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: list[Job] = []
        self._thread = threading.Thread(target=self._main, name="specdecode-engine", daemon=True)
        self._stopping = threading.Event()
        self.idle = threading.Event()
        self.idle.set()

    def start(self) -> None:
        self._thread.start()

    # -- from the event loop ---------------------------------------------------------------------
    async def submit(self, job: Job) -> Job:
        """Queue ``job``; raises what the engine refuses it with (InputError, QueueFullError...)."""
        self._commands.put(("submit", job))
        await asyncio.wrap_future(job.submitted)
        return job

    def cancel(self, job: Job) -> None:
        """Stop ``job``; its cache is freed before the engine's next forward."""
        if not job.done:
            self._commands.put(("cancel", job))

    def stop(self, drain_s: float) -> bool:
        """Let running jobs finish for up to ``drain_s`` seconds, cancel the rest, stop the thread.
        True when everything finished in time."""
        drained = self.idle.wait(drain_s)
        self._commands.put(("stop", None))
        self._thread.join(timeout=max(5.0, drain_s))
        return drained

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    # -- the worker thread -----------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            if not self.engine.busy:
                self.idle.set()  # before blocking for the next command (drain waits on it)
            if not self._apply(block=not self.engine.busy):
                return
            if not self.engine.busy:
                continue
            self.idle.clear()
            try:
                self.engine.step()
            except Exception:  # a bug: fail this batch's jobs, keep serving the next ones
                log.exception("engine step failed")
                self._fail_all("internal error: the engine failed on this batch (see the server log)")
                continue
            self._deliver()

    def _apply(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when ``block``); False once told to stop."""
        while True:
            try:
                cmd, job = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd == "stop":
                self._fail_all("the server is shutting down")
                return False
            if cmd == "submit":
                self._submit(job)
            elif cmd == "cancel" and job.request is not None and not job.done:
                self.engine.cancel(job.request)

    def _submit(self, job: Job) -> None:
        try:
            job.request = self.engine.submit(job.prompt_ids, job.config, job.spec)
        except SpecDecodeError as exc:
            job.done = True
            job.submitted.set_exception(exc)
            return
        self._jobs.append(job)
        job.submitted.set_result(job)

    def _deliver(self) -> None:
        """Each job's new events, then its result when it finished."""
        now = time.perf_counter()
        engine = self.engine
        last = engine.steps[-1].ks if engine.steps else None
        self.metrics.step(len(engine.running), len(engine.waiting), engine.kv_usage()["usage"], last)
        still = []
        for job in self._jobs:
            r = job.request
            events, r.events = r.events, []
            for event in events:
                self._emit(job, event, now)
            if r.result is None:
                still.append(job)
                continue
            job.done = True
            self.metrics.finished(r.metrics, r.result.finish_reason, now - job.arrival)
            self._put(job, Finished(r.result))
        self._jobs = still

    def _emit(self, job: Job, event: StreamEvent, now: float) -> None:
        if job.last_emit is None:
            self.metrics.first_token(now - job.arrival)
        else:
            self.metrics.inter_token(now - job.last_emit)
        job.last_emit = now
        self._put(job, event)

    def _put(self, job: Job, item: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, (job.index, item))
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
            pass

    def _fail_all(self, message: str) -> None:
        for job in self._jobs:
            if job.request is not None and job.request.result is None:
                self.engine.cancel(job.request)
            job.done = True
            self._put(job, Failed(message))
        self._jobs = []
        self.engine.abort_all()
