"""Fuzzing the server with schemathesis against its own OpenAPI schema: whatever a client sends,
the answer is never a 5xx, every 4xx carries the OpenAI error JSON, and every answer is one the
schema lists: its status code, its content type and its body's shape (so /openapi.json tells the
truth), and a body the schema calls invalid is refused. A tiny random model with a 32-token context
keeps each generated request short."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from allocmoe import allocate, load_model
from allocmoe.serve.app import ServerConfig, create_app
from test_serve import serving

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def fuzzed_url(tiny_folder):
    model, tok = load_model(tiny_folder)
    config = ServerConfig(model_name="tiny", max_model_len=32, max_batch_size=4, max_queue=16, chat_template=TEMPLATE,
                          allocate=allocate)
    with serving(create_app(model, tok, config)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzzed_url):
    return schemathesis.openapi.from_url(f"{fuzzed_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error_and_every_answer_is_in_the_schema(case, fuzzed_url):
    response = case.call(base_url=fuzzed_url, timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                             response_schema_conformance, negative_data_rejection])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]
