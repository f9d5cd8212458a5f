"""Idempotency-Key on create: retries get the first response; a reused key with new params is refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from backend.extensions import db
from backend.intents.models import Intent
from tests.intents.helpers import URL


def count() -> int:
    return db.session.scalar(select(func.count()).select_from(Intent)) or 0


def post(client, merchant, body, key):
    return client.post(URL, json=body, headers={**merchant.headers, "Idempotency-Key": key})


def test_retry_with_same_key_and_body_returns_the_first_response(client, merchant):
    first = post(client, merchant, {"amount_usdc": 7, "order_id": "A"}, "key-1")
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    again = post(client, merchant, {"order_id": "A", "amount_usdc": 7.0}, "key-1")  # same params, other spelling
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert count() == 1


def test_same_key_with_another_body_is_422(client, merchant):
    post(client, merchant, {"amount_usdc": 7}, "key-2")
    response = post(client, merchant, {"amount_usdc": 8}, "key-2")
    assert response.status_code == 422
    assert response.get_json()["error"]["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert count() == 1


def test_keys_are_scoped_per_merchant(client, merchant, other_merchant):
    a = post(client, merchant, {"amount_usdc": 7}, "shared")
    b = post(client, other_merchant, {"amount_usdc": 7}, "shared")
    assert a.status_code == b.status_code == 201
    assert a.get_json()["data"]["intent_id"] != b.get_json()["data"]["intent_id"]


def test_failed_requests_are_not_remembered(client, merchant):
    assert post(client, merchant, {"amount_usdc": "bad"}, "key-3").status_code == 400
    assert post(client, merchant, {"amount_usdc": 1}, "key-3").status_code == 201


def test_key_expires_after_24_hours(client, merchant, clock):
    first = post(client, merchant, {"amount_usdc": 7}, "key-4").get_json()["data"]["intent_id"]
    clock.advance(hours=24)
    second = post(client, merchant, {"amount_usdc": 7}, "key-4").get_json()["data"]["intent_id"]
    assert first != second


@pytest.mark.parametrize("key", ["", " ", "x" * 256, "caf\u00e9"])
def test_invalid_keys_are_400(client, merchant, key):
    response = client.post(
        URL, json={"amount_usdc": 1}, headers={**merchant.headers, "Idempotency-Key": key.encode().decode("latin-1")}
    )
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "INVALID_IDEMPOTENCY_KEY"
    assert count() == 0


def test_concurrent_retries_create_one_intent(app, merchant):
    def attempt(_: int):
        with app.test_client() as c:
            r = post(c, merchant, {"amount_usdc": 9, "order_id": "race"}, "race-key")
            return r.status_code, r.get_json()["data"]["intent_id"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(attempt, range(16)))
    assert {status for status, _ in results} == {201}
    assert len({intent_id for _, intent_id in results}) == 1
    db.session.expire_all()
    assert count() == 1
