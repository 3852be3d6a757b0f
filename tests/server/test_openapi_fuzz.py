"""Fuzzing driven by the served /openapi.json itself (schemathesis): every operation it declares is called with
requests generated from its declared schema, valid and not, and every answer is checked against what the document
declares for it: no 5xx, a declared status, a declared content type, a body that validates against the declared
schema, and each streamed event against the route's x-event-schema.

Deterministic (derandomized, no example database) and bounded: a few dozen examples per operation on the fuzz
server of conftest.py (a 16-token context keeps every answer short)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from pagellm.server.openapi import ROUTES

EXAMPLES = 40  # per operation
MODEL = "fuzz"  # the fuzz server's name: most bodies get past the model check to the rest of the route
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GET_ROUTES = ("/health", "/metrics", "/props", "/v1/models")
OPERATIONS = [(path, "POST", mode) for path in ROUTES for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
OPERATIONS += [(path, "GET", GenerationMode.POSITIVE) for path in GET_ROUTES]


@pytest.fixture(scope="module")
def served(fuzz_server):
    """The served /openapi.json: as schemathesis reads it, and as JSON."""
    return (schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json"),
            httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json())


def inlined(node, components: dict):
    """`node` with each "#/components/schemas/X" reference replaced by X's schema (the models are not recursive)."""
    if isinstance(node, dict):
        if "$ref" in node:
            target = components[node["$ref"].rsplit("/", 1)[1]]
            return inlined({**target, **{k: v for k, v in node.items() if k != "$ref"}}, components)
        return {key: inlined(value, components) for key, value in node.items()}
    if isinstance(node, list):
        return [inlined(value, components) for value in node]
    return node


def check_events(document: dict, path: str, method: str, response) -> None:
    """Each event of a stream validates against the operation's declared x-event-schema (schemathesis checks
    JSON bodies only)."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    content = document["paths"][path][method.lower()]["responses"][str(response.status_code)]["content"]
    event_schema = inlined(content["text/event-stream"]["x-event-schema"], document["components"]["schemas"])
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            jsonschema.validate(json.loads(line[len("data: "):]), event_schema)


def test_every_route_is_in_the_document(served):
    _, document = served
    assert {path for path, ops in document["paths"].items() if "post" in ops} == set(ROUTES)
    assert {path for path, ops in document["paths"].items() if "get" in ops} == set(GET_ROUTES)


@pytest.mark.parametrize("path, method, mode", OPERATIONS, ids=[f"{m} {p} {g.value}" for p, m, g in OPERATIONS])
def test_every_operation_answers_as_declared(served, path, method, mode):
    schema, document = served

    @settings(max_examples=EXAMPLES if method == "POST" else 3, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=schema[path][method].as_strategy(mode))
    def fuzz(case):
        if isinstance(case.body, dict) and "model" in case.body and len(case.body) % 4:
            case.body["model"] = MODEL  # else almost every body is a 404 for its unknown model
        check_events(document, path, method, case.call_and_validate(checks=CHECKS))

    fuzz()
