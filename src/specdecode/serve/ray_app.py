"""``specdecode serve --ray``: the same FastAPI app and engine as replicas of a Ray Serve deployment.

Each replica is a :class:`Replica` actor that builds the app of ``specdecode serve`` (one engine,
one worker thread) once its model has loaded; Ray Serve's proxy routes requests to replicas and
passes streaming responses through. Scaling is Ray Serve's own: a fixed ``--replicas N`` or
autoscaling between ``--min-replicas`` and ``--max-replicas`` on ``--target-ongoing-requests``.
Every response names the replica that answered (``x-specdecode-replica``).

Metrics: each replica pushes its Prometheus registry to one small named actor (:class:`MetricsHub`)
every second and on every scrape; ``GET /metrics`` on any replica answers every live replica's
series with a ``replica`` label (the same metric names as the single server), so one Prometheus
scrape job through the proxy sees them all. Ray is an optional extra (``specdecode[ray]``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from specdecode.errors import ConfigError
from specdecode.serve.state import FAILED, ModelSource, ServerConfig, ServerState

log = logging.getLogger("specdecode.serve")
NAMESPACE = "specdecode"
HUB = "specdecode-metrics-hub"
APP = "specdecode"
PUSH_S = 1.0  # how often a replica pushes its metrics
STALE_S = 60.0  # a replica not heard from for this long is dropped from /metrics


def import_ray() -> tuple[Any, Any]:
    """(ray, ray.serve), or the one-line error naming the extra."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError("--ray needs Ray Serve, an optional extra: pip install 'specdecode[ray]'") from None
    return ray, serve


@dataclass(frozen=True)
class RayScaling:
    """A fixed number of replicas, or Ray Serve autoscaling (min, max, target ongoing requests)."""

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None

    def __post_init__(self) -> None:
        autoscale = (self.min_replicas, self.max_replicas, self.target_ongoing_requests) != (None, None, None)
        if self.replicas is not None and autoscale:
            raise ConfigError("--replicas is a fixed count; autoscaling takes --min-replicas/--max-replicas instead")
        if self.min_replicas is not None and self.min_replicas < 0:
            raise ConfigError(f"--min-replicas must be >= 0, got {self.min_replicas}")
        low, high = self.min_replicas or 0, self.max_replicas
        if high is not None and low > high:
            raise ConfigError(f"--min-replicas {low} exceeds --max-replicas {high}")

    @property
    def autoscaling(self) -> bool:
        return self.replicas is None and (self.min_replicas, self.max_replicas) != (None, None)

    def most(self) -> int:
        return self.replicas or self.max_replicas or max(self.min_replicas or 1, 1)

    def options(self, max_batch: int) -> dict[str, Any]:
        if not self.autoscaling:
            return {"num_replicas": self.replicas or 1}
        return {
            "autoscaling_config": {
                "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                "max_replicas": self.max_replicas or max(self.min_replicas or 1, 1),
                "target_ongoing_requests": self.target_ongoing_requests or max(1.0, max_batch / 2),
            }
        }


class MetricsHub:
    """A named actor holding each replica's latest exposition text (run with ``ray.remote``)."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def push(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.time(), text)

    def collect(self) -> dict[str, str]:
        now = time.time()
        self.texts = {r: (t, x) for r, (t, x) in self.texts.items() if now - t < STALE_S}
        return {r: x for r, (_, x) in self.texts.items()}


def merged_metrics(texts: dict[str, str]) -> bytes:
    """Every replica's series in one exposition, each sample labelled with its ``replica``
    (parsed and rendered by prometheus-client)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    class Relabelled:
        def collect(self):
            families: dict[str, Metric] = {}
            for replica, text in sorted(texts.items()):
                for fam in text_string_to_metric_families(text):
                    merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                    for s in fam.samples:
                        merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Relabelled())
    return generate_latest(registry)


class Replica:
    """One replica of the deployment: the single server's app over its own engine."""

    def __init__(self, source: ModelSource, config: ServerConfig, threads: int) -> None:
        import ray
        import torch
        from ray import serve

        from specdecode.serve.app import create_app

        torch.set_num_threads(threads)
        _undo_worker_niceness()
        self.replica = serve.get_replica_context().replica_tag
        try:
            self.hub = ray.get_actor(HUB, namespace=NAMESPACE)
        except ValueError:  # deployed without the hub: each replica reports only itself
            self.hub = None
        self._asgi = create_app(source, config, background_load=False, metrics_view=self._metrics, replica=self.replica)
        self.state: ServerState = self._asgi.state.server
        threading.Thread(target=self._push_loop, name="specdecode-metrics-push", daemon=True).start()

    def __serve_build_asgi_app__(self) -> Any:
        return self._asgi

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose model failed to load."""
        if self.state.status == FAILED:
            raise RuntimeError(self.state.error)

    def _text(self) -> str:
        return self.state.metrics.render().decode() if self.state.metrics is not None else ""

    def _push_loop(self) -> None:
        while True:
            time.sleep(PUSH_S)
            if self.hub is not None and self.state.metrics is not None:
                self.hub.push.remote(self.replica, self._text())

    async def _metrics(self, state: ServerState) -> bytes:
        if self.hub is None:
            return merged_metrics({self.replica: self._text()})
        await self.hub.push.remote(self.replica, self._text())
        return merged_metrics(await self.hub.collect.remote())


def _undo_worker_niceness() -> None:
    """Ray starts workers at niceness 15: Ray's own daemons (niceness 0) then preempt the engine's
    OpenMP threads, which stall at every barrier (measured: 2.7x slower decoding on 2 cores).
    A replica is the serving process, not background work: back to 0 where allowed."""
    import os

    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except (OSError, AttributeError):
        log.warning("replica runs at niceness %d; start Ray with RAY_worker_niceness=0 for full speed", os.nice(0))


def start_hub(ray: Any) -> Any:
    """The metrics hub (one per cluster: an existing one is reused). Keep the handle: the hub is
    owned by this driver and goes when the handle does."""
    try:
        return ray.get_actor(HUB, namespace=NAMESPACE)
    except ValueError:
        return ray.remote(MetricsHub).options(name=HUB, namespace=NAMESPACE, num_cpus=0).remote()


def application(source: ModelSource, config: ServerConfig, scaling: RayScaling, threads: int) -> Any:
    """The Ray Serve application: ``threads`` CPUs per replica, so replicas never oversubscribe
    the cores Ray was given (each replica's torch uses exactly its share)."""
    _, serve = import_ray()
    deployment = serve.deployment(
        name=APP,
        ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=config.engine.max_batch + (config.engine.max_queue or config.engine.max_batch),
        graceful_shutdown_timeout_s=config.drain_s,
        health_check_period_s=5,
        **scaling.options(config.engine.max_batch),
    )(serve.ingress()(Replica))
    return deployment.bind(source, config, threads)


def run_on_ray(source: ModelSource, config: ServerConfig, scaling: RayScaling, args: argparse.Namespace) -> int:
    """``specdecode serve --ray``: start (or join) Ray, deploy, serve until SIGTERM / Ctrl-C."""
    import os

    ray, serve = import_ray()
    os.environ.setdefault("RAY_worker_niceness", "0")  # workers a local Ray starts run at full priority
    if args.ray_address:
        ray.init(address=args.ray_address, namespace=NAMESPACE)
    else:
        ray.init(namespace=NAMESPACE, include_dashboard=False)
    cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    threads = args.threads or default_threads(cpus, scaling.most())
    stop = threading.Event()  # ours, set before deploying: a SIGTERM mid-deploy still drains, exit 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    hub = start_hub(ray)  # noqa: F841  (held for the server's lifetime)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(application(source, config, scaling, threads), name=APP, route_prefix="/")
    log.info(
        "ready on Ray: http://%s:%d/v1 (%s, %d threads per replica)", args.host, args.port, _describe(scaling), threads
    )
    stop.wait()
    log.info("shutting down: draining the replicas (up to %.0f s)", config.drain_s)
    serve.shutdown()
    ray.shutdown()
    return 0


def default_threads(cpus: int, replicas: int) -> int:
    """Torch threads per replica: the cluster's CPUs shared by the replicas, less one core for
    Ray's proxy and daemons. Measured on 2 cores: one replica with 2 threads decoded 2.4x slower
    than with the core left free (its OpenMP threads stall whenever Ray's threads run)."""
    return max(1, (cpus - 1) // max(replicas, 1))


def _describe(scaling: RayScaling) -> str:
    if scaling.autoscaling:
        opts = scaling.options(0)["autoscaling_config"]
        return f"autoscaling {opts['min_replicas']}..{opts['max_replicas']} replicas"
    return f"{scaling.replicas or 1} replicas"
