"""The OpenAPI document is served and every response we send matches it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.intents.helpers import URL, create, mark_paid

DOC_URI = "urn:payintent:openapi"


@pytest.fixture
def spec(client) -> dict[str, Any]:
    response = client.get("/api/v1/openapi.json")
    assert response.status_code == 200
    return json.loads(response.data)


def check(spec: dict[str, Any], path: str, method: str, response: Any) -> None:
    """Validate a live response against the documented schema for its status code."""
    operation = spec["paths"][path][method]
    documented = operation["responses"].get(str(response.status_code)) or operation["responses"]["default"]
    if "$ref" in documented:
        documented = spec["components"]["responses"][documented["$ref"].rsplit("/", 1)[1]]
    schema = documented["content"]["application/json"]["schema"]
    registry = Registry().with_resource(DOC_URI, Resource.from_contents(spec, default_specification=DRAFT202012))
    ref = {"$ref": DOC_URI + "#" + schema["$ref"][1:]} if "$ref" in schema else schema
    errors = list(Draft202012Validator(ref, registry=registry).iter_errors(json.loads(response.data)))
    assert not errors, [e.message for e in errors]


def test_document_lists_every_intents_operation(spec):
    assert spec["openapi"].startswith("3.1")
    assert set(spec["paths"][URL]) >= {"get", "post"}
    assert set(spec["paths"][URL + "/{intent_id}"]) >= {"get", "delete"}
    assert spec["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


def test_docs_page_is_served(client):
    response = client.get("/api/v1/docs")
    assert response.status_code == 200
    assert b"swagger" in response.data.lower()


def test_responses_match_the_document(client, merchant, spec, clock):
    item = URL + "/{intent_id}"
    created = client.post(
        URL, json={"amount_usdc": 1.25, "order_id": "x", "metadata": {"k": 1}}, headers=merchant.headers
    )
    check(spec, URL, "post", created)
    intent_id = created.get_json()["data"]["intent_id"]
    check(spec, item, "get", client.get(f"{URL}/{intent_id}", headers=merchant.headers))
    check(spec, URL, "get", client.get(URL, headers=merchant.headers))
    check(spec, item, "delete", client.delete(f"{URL}/{intent_id}", headers=merchant.headers))
    paid = create(client, merchant)["intent_id"]
    mark_paid(paid)
    check(spec, item, "get", client.get(f"{URL}/{paid}", headers=merchant.headers))
    # Errors, too.
    check(spec, URL, "post", client.post(URL, json={"amount_usdc": "1"}, headers=merchant.headers))
    check(spec, URL, "post", client.post(URL, json={"amount_usdc": 1}))
    check(spec, URL, "get", client.get(URL + "?limit=0", headers=merchant.headers))
    check(spec, item, "get", client.get(f"{URL}/nope", headers=merchant.headers))
    check(spec, item, "delete", client.delete(f"{URL}/{intent_id}", headers=merchant.headers))


def test_unknown_routes_and_methods_get_the_error_envelope(client, merchant):
    response = client.get("/api/v1/nothing-here", headers=merchant.headers)
    assert response.status_code == 404
    assert response.get_json() == {
        "success": False,
        "error": {"code": "NOT_FOUND", "message": response.get_json()["error"]["message"]},
    }
    response = client.put(URL, headers=merchant.headers)
    assert response.status_code == 405
    assert response.get_json()["error"]["code"] == "METHOD_NOT_ALLOWED"


def test_oversized_body_is_413(client, merchant):
    response = client.post(URL, data="{" + " " * 70000 + "}", content_type="application/json", headers=merchant.headers)
    assert response.status_code == 413
    assert response.get_json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
