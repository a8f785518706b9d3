"""Chapter 10: the HTTP API fuzzed from its own OpenAPI schema (issue 68, item 3).

schemathesis (on hypothesis) reads ``GET /openapi.json`` from a server on the tiny model and
generates requests for every operation: bodies that fit the schema (positive) and bodies that
break it (negative). For each answer: no 5xx; a status the schema lists; a content type it
lists; a body valid against the schema of that status (4xx: OpenAI's error shape); and a body
that breaks the schema must be refused with a 4xx. Examples are bounded and derandomized, so a
run is the same on every machine and takes well under a minute on two cores."""

from __future__ import annotations

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from server_helpers import running_server

from miniinfer.core.models import load_model


@schemathesis.check
def parsing_agrees_with_the_schema(ctx, response, case) -> None:
    """A body generated to fit the schema may be refused for what the schema cannot say (a
    prompt longer than the context, a token id past the vocabulary, a feature refused by
    name), never by the parser: a type or bounds error there means the schema and the
    server disagree (the fuzzer found ``8.0`` refused where the schema says ``integer``)."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return
    if response.status_code == 400 and "Input should be" in response.text:
        raise AssertionError(f"a body that fits the schema was refused by the parser: "
                             f"{response.text[:300]}")


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection, parsing_agrees_with_the_schema]
# Examples per operation and mode: the generation endpoints are the slow ones.
EXAMPLES = {"POST /v1/completions": 30, "POST /v1/chat/completions": 25}
DEFAULT_EXAMPLES = 20
CONTEXT = 128


@pytest.fixture(scope="module")
def short_tiny():
    """``tiny`` with a 128-token context (its own copy): a chat without max_tokens generates
    up to the context's end, and 128 tokens keep every example short on a slow CPU."""
    lm = load_model("tiny", device="cpu")
    lm.model.config.max_position_embeddings = CONTEXT
    return lm


@pytest.fixture(scope="module")
def server(short_tiny):
    with running_server(short_tiny) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def operations(api) -> list:
    return [result.ok() for result in api.get_all_operations()]


def test_the_schema_names_every_endpoint(api, server):
    labels = {op.label for op in operations(api)}
    assert labels >= {"GET /health", "GET /version", "GET /metrics", "GET /v1/models",
                      "POST /tokenize", "POST /detokenize", "POST /v1/completions",
                      "POST /v1/chat/completions"}, labels
    body = api.raw_schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert httpx.get(server.url + "/openapi.json").status_code == 200


def test_a_whole_float_is_an_integer(server):
    """What the fuzzer found: JSON Schema's ``integer`` includes 8.0, and so does the server;
    8.5 is still refused."""
    body = {"model": "tiny", "prompt": [1.0, 2], "max_tokens": 2.0, "n": 1.0}
    response = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    body["max_tokens"] = 2.5
    response = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_holds_to_its_schema(api, server, mode):
    session = requests.Session()
    for operation in operations(api):
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # no parameters, nothing to break

        @settings(max_examples=EXAMPLES.get(operation.label, DEFAULT_EXAMPLES),
                  derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case) -> None:
            case.call_and_validate(base_url=server.url, session=session, checks=CHECKS,
                                   timeout=120)

        check()
    assert httpx.get(server.url + "/health").status_code == 200
