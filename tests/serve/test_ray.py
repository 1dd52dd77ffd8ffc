"""``specdecode serve --ray``: two replicas of the tiny model on a local Ray (started here with
``ray.init(num_cpus=2)``), driven by the openai client through Ray Serve's proxy. Greedy outputs
equal the single server's; requests spread over both replicas (the response header and the
per-replica metrics say which); a replica killed mid-run is replaced and the requests that were
not on it all complete."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving import http, openai_client, start_server

pytestmark = pytest.mark.slow  # starts a Ray cluster (about 20 s)

MESSAGES = [{"role": "user", "content": "Count: one two three one two"}]


class RayServe:
    def __init__(self, url: str) -> None:
        self.url = url


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_serve(tiny_model_dir):
    import ray
    from ray import serve

    from specdecode.serve.ray_app import APP, NAMESPACE, RayScaling, application, start_hub
    from specdecode.serve.state import ModelSource, ServerConfig

    ray.init(num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        hub = start_hub(ray)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServerConfig(model_name="tiny", method="ngram")
        serve.run(
            application(ModelSource(str(tiny_model_dir)), config, RayScaling(replicas=2), 1), name=APP, route_prefix="/"
        )
        yield RayServe(f"http://127.0.0.1:{port}")
        del hub
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def single(tiny_loaded):
    live = start_server(tiny_loaded, method="ngram")
    yield live
    live.stop()


def _complete(url_holder, body) -> tuple[int, dict, str | None]:
    code, answer, headers = http(url_holder, "POST", "/v1/completions", body)
    return code, answer, {k.lower(): v for k, v in headers.items()}.get("x-specdecode-replica")


def _waves_until_both_replicas(
    url_holder, body, size: int, pause_s: float = 0.0, max_requests: int | None = 60
) -> list:
    """Waves of ``size`` requests at once until two replicas have answered (at most 60 s, and
    ``max_requests`` unless None): the proxy's router learns of a replica through Ray's long
    poll, and until then it sends everything to the ones it knows. Every answer, in order."""
    results: list = []
    deadline = time.monotonic() + 60
    cap = max_requests if max_requests is not None else float("inf")
    while len({r for _, _, r in results}) < 2 and time.monotonic() < deadline and len(results) < cap:
        with ThreadPoolExecutor(size) as pool:
            results += pool.map(lambda _: _complete(url_holder, body), range(size))
        time.sleep(pause_s)
    return results


def test_replicas_serve_the_openai_client_like_the_single_server(ray_serve, single):
    for spec in (None, False, {"method": "suffix", "k": 3}):
        extra = {} if spec is None else {"speculative": spec}
        kw = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, extra_body=extra)
        served = openai_client(ray_serve).chat.completions.create(**kw).choices[0].message.content
        assert served == openai_client(single).chat.completions.create(**kw).choices[0].message.content
    stream = openai_client(ray_serve).completions.create(
        model="tiny", prompt="abc abc", max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert (
        streamed
        == openai_client(single)
        .completions.create(model="tiny", prompt="abc abc", max_tokens=16, temperature=0)
        .choices[0]
        .text
    )


def test_requests_spread_over_both_replicas_and_metrics_say_so(ray_serve):
    from prometheus_client.parser import text_string_to_metric_families

    body = {"model": "tiny", "prompt": "spread", "max_tokens": 12, "temperature": 0}
    results = _waves_until_both_replicas(ray_serve, body, 12)
    assert [code for code, _, _ in results] == [200] * len(results)
    assert len({r for _, _, r in results}) == 2  # both replicas answered
    assert len({a["choices"][0]["text"] for _, a, _ in results}) == 1
    time.sleep(1.5)  # a replica pushes its metrics every second
    _, text, _ = http(ray_serve, "GET", "/metrics")
    per_replica = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specdecode:request_success_total":
                per_replica[s.labels["replica"]] = per_replica.get(s.labels["replica"], 0) + s.value
    assert set(per_replica) >= {r for _, _, r in results} and all(v > 0 for v in per_replica.values())


def test_a_killed_replica_is_replaced_and_the_other_requests_complete(ray_serve):
    import ray
    from ray import serve

    body = {"model": "tiny", "prompt": "long one", "max_tokens": 200, "temperature": 0}
    results: list = []

    def run() -> None:
        results.append(_complete(ray_serve, body))

    first = [threading.Thread(target=run) for _ in range(6)]
    for t in first:
        t.start()
    time.sleep(0.3)
    names = sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")
    )
    victim = names[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed = victim.rsplit("#", 1)[-1]
    after = [threading.Thread(target=run) for _ in range(6)]
    for t in after:
        t.start()
    for t in first + after:
        t.join(180)
    assert len(results) == 12, "every request was answered (none hung)"
    failed = [(code, answer) for code, answer, _ in results if code != 200]
    assert all(code >= 500 for code, _ in failed), failed  # only requests caught on the dead replica
    assert len(failed) <= 6, "at most the first wave can have been on the killed replica"

    deadline = time.monotonic() + 120
    while True:  # the controller starts a replacement
        status = serve.status().applications["specdecode"].deployments["specdecode"]
        running = status.replica_states.get("RUNNING", 0)
        if running == 2:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {status}"
        time.sleep(0.5)
    # a replacement can take the proxy longer to learn of than a first start: bounded by time only
    waves = _waves_until_both_replicas(ray_serve, {**body, "max_tokens": 24}, 4, pause_s=0.5, max_requests=None)
    assert all(code == 200 for code, _, _ in waves)
    seen = {replica for _, _, replica in waves}
    assert killed not in seen and len(seen) == 2


def test_an_autoscaled_deployment_starts_at_its_minimum_and_serves(ray_serve, tiny_model_dir):
    from ray import serve

    from specdecode.serve.ray_app import APP, RayScaling, application
    from specdecode.serve.state import ModelSource, ServerConfig

    scaling = RayScaling(min_replicas=1, max_replicas=2, target_ongoing_requests=4)
    config = ServerConfig(model_name="tiny", method="ngram")
    serve.delete(APP)  # a fresh application starts at min_replicas (an updated one keeps its count)
    serve.run(application(ModelSource(str(tiny_model_dir)), config, scaling, 1), name=APP, route_prefix="/")
    status = serve.status().applications[APP].deployments[APP]
    assert status.replica_states.get("RUNNING", 0) == 1
    code, answer, replica = _complete(
        ray_serve, {"model": "tiny", "prompt": "scale", "max_tokens": 5, "temperature": 0}
    )
    assert code == 200 and replica and answer["usage"]["completion_tokens"] == 5
