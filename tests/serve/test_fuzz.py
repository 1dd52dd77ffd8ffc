"""Schemathesis against the server's own OpenAPI document: whatever the generated requests hold,
no 5xx, and every response matches the document (status code, content type, body schema).
Bounded: a few examples per operation in the fast tier, more in the slow tier.

Schemathesis' pytest plugin does not load under this pytest, so the operations' strategies are
run with hypothesis directly (the same checks ``call_and_validate`` runs)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serving import start_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ROUTES = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health", "GET /metrics"]


@pytest.fixture(scope="module")
def api_schema(tiny_loaded):
    # small limits so that generated requests stay cheap: long prompts and budgets are refused
    live = start_server(tiny_loaded, max_tokens=24, max_body_bytes=20_000)
    yield schemathesis.openapi.from_url(live.url + "/openapi.json")
    live.stop()


def fuzz(api_schema, label: str, examples: int) -> list[int]:
    """Run ``examples`` generated requests against ``label``; the status codes they got (each
    response already checked against the document)."""
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in the OpenAPI document"
    statuses: list[int] = []

    @given(case=operation.as_strategy())
    @settings(
        max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
    )
    def run(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = "tiny"  # reach the generation path, not only the unknown-model 404
        response = case.call()
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{label} answered {response.status_code}: {response.text[:300]}"
        case.validate_response(response, checks=CHECKS)

    run()
    return statuses


def assert_fuzzed(label: str, statuses: list[int]) -> None:
    assert statuses, f"no request reached {label}"
    assert all(code < 500 for code in statuses)
    if label.startswith("POST"):  # generated bodies got both answers: generation and refusal
        assert 200 in statuses and any(400 <= code < 500 for code in statuses), sorted(set(statuses))
    else:
        assert set(statuses) == {200}


@pytest.mark.parametrize("label", ROUTES)
def test_fuzz_fast(api_schema, label):
    assert_fuzzed(label, fuzz(api_schema, label, 15))


@pytest.mark.slow
@pytest.mark.parametrize("label", ROUTES[:2])
def test_fuzz_slow(api_schema, label):
    assert_fuzzed(label, fuzz(api_schema, label, 150))
