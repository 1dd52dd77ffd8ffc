"""Ray Serve options from the CLI's words (no cluster needed)."""

from __future__ import annotations

import pytest

from specdecode.errors import ConfigError
from specdecode.serve.ray_app import RayScaling, default_threads, merged_metrics


def test_fixed_and_autoscaled_replicas():
    assert RayScaling().options(32) == {"num_replicas": 1}
    assert RayScaling(replicas=3).options(32) == {"num_replicas": 3} and RayScaling(replicas=3).most() == 3
    auto = RayScaling(min_replicas=0, max_replicas=4, target_ongoing_requests=8).options(32)
    assert auto == {"autoscaling_config": {"min_replicas": 0, "max_replicas": 4, "target_ongoing_requests": 8}}
    assert RayScaling(max_replicas=2).options(32)["autoscaling_config"]["target_ongoing_requests"] == 16
    with pytest.raises(ConfigError, match="fixed count"):
        RayScaling(replicas=2, max_replicas=3)
    with pytest.raises(ConfigError, match="exceeds"):
        RayScaling(min_replicas=5, max_replicas=3)


def test_merged_metrics_label_each_replica_and_keep_the_names():
    from prometheus_client.parser import text_string_to_metric_families

    from specdecode.metrics import RequestMetrics
    from specdecode.serve.metrics import ServerMetrics

    texts = {}
    for replica, tokens in (("a", 5), ("b", 7)):
        m = ServerMetrics("tiny")
        m.finished(RequestMetrics(method="ngram", k=4, prompt_tokens=3, new_tokens=tokens), "length", 0.5)
        texts[replica] = m.render().decode()
    samples = [s for f in text_string_to_metric_families(merged_metrics(texts).decode()) for s in f.samples]
    tokens = {s.labels["replica"]: s.value for s in samples if s.name == "specdecode:generation_tokens_total"}
    assert tokens == {"a": 5.0, "b": 7.0}
    names = {s.name for s in samples}
    assert "specdecode:e2e_request_latency_seconds_bucket" in names and "specdecode:request_success_total" in names


def test_replicas_leave_a_core_to_ray():
    assert [default_threads(2, 1), default_threads(2, 2), default_threads(16, 2), default_threads(16, 20)] == [
        1,
        1,
        7,
        1,
    ]
