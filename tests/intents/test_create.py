"""POST /api/v1/x402/intents: what a merchant gets back, and every way a request is refused."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from backend.extensions import db
from backend.intents.models import Intent
from tests.conftest import CHECKOUT_HOST, EVM_WALLET, SOLANA_WALLET, create_merchant

URL = "/api/v1/x402/intents"


def intent_count() -> int:
    return db.session.scalar(select(func.count()).select_from(Intent)) or 0


def post(client: Any, merchant: Any, body: Any = None, **kwargs: Any) -> Any:
    return client.post(URL, json=body, headers={**merchant.headers, **kwargs.pop("headers", {})}, **kwargs)


def test_create_returns_pending_intent_with_a_requirement_per_wallet(client, merchant, clock):
    response = post(client, merchant, {"amount_usdc": 10.5, "order_id": "ord_1", "description": "Two mugs"})
    assert response.status_code == 201
    body = response.get_json()
    assert body["success"] is True
    data = body["data"]
    assert str(uuid.UUID(data["intent_id"], version=4)) == data["intent_id"]
    assert data["status"] == "pending"
    assert response.data.count(b'"amount_usdc":10.5') == 1  # an exact JSON number, not a string
    assert data["order_id"] == "ord_1"
    assert data["checkout_url"] == f"{CHECKOUT_HOST}/pay/{data['intent_id']}"
    assert data["expires_at"] == (clock.current + timedelta(minutes=30)).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    requirements = {r["network"]: r for r in data["payment_requirements"]}
    assert set(requirements) == {
        "eip155:84532",
        "eip155:11155111",
        "eip155:5042002",
        "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1",
    }
    base = requirements["eip155:84532"]
    assert base["maxAmountRequired"] == "10500000"
    assert base["payTo"] == EVM_WALLET
    assert base["asset"] == "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
    assert base["usdcDomainName"] == "USDC"
    assert base["scheme"] == "exact"
    assert base["extra"] == {"name": "USDC", "version": "2"}
    assert base["resource"] == data["checkout_url"]
    assert base["description"] == "Two mugs"
    assert base["mimeType"] == "application/json"
    assert base["maxTimeoutSeconds"] > 0
    solana = requirements["solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"]
    assert solana["payTo"] == SOLANA_WALLET
    assert solana["asset"] == "4zMMC9srt5Ri5X14GAgXhaHii3GnPAEERYPJgZJDncDU"
    assert solana["extra"]["decimals"] == 6
    assert intent_count() == 1


def test_minimal_request_is_accepted(client, merchant):
    response = post(client, merchant, {"amount_usdc": 1})
    assert response.status_code == 201
    data = response.get_json()["data"]
    assert data["order_id"] is None
    assert data["payment_requirements"][0]["maxAmountRequired"] == "1000000"


def test_requirements_only_for_networks_with_a_wallet(client, app):
    shop = create_merchant(app, "one@example.com", wallets={"eip155:11155111": EVM_WALLET.lower()})
    data = post(client, shop, {"amount_usdc": 2}).get_json()["data"]
    assert [r["network"] for r in data["payment_requirements"]] == ["eip155:11155111"]
    assert data["payment_requirements"][0]["payTo"] == EVM_WALLET  # checksummed on save


def test_merchant_without_wallet_gets_a_clear_4xx_and_no_intent(client, app):
    shop = create_merchant(app, "nowallet@example.com", wallets={})
    response = post(client, shop, {"amount_usdc": 2})
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "NO_PAYOUT_WALLET"
    assert intent_count() == 0


@pytest.mark.parametrize("idempotency_key", [None, "order-1"])
def test_a_create_that_fails_building_its_answer_writes_no_intent(client, merchant, monkeypatch, idempotency_key):
    """Without an Idempotency-Key the INSERT commits by itself: it runs only once the answer is built, so a 500
    never leaves an intent behind (the client's retry would make a second payable one)."""
    from backend.intents import views

    def broken(value: Any) -> str:
        raise RuntimeError("serialising failed")

    monkeypatch.setattr(views, "dumps", broken)
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    response = post(client, merchant, {"amount_usdc": 1, "order_id": "o-1"}, headers=headers)
    assert response.status_code == 500
    assert response.get_json()["error"]["code"] == "INTERNAL_ERROR"
    db.session.rollback()
    assert intent_count() == 0


def test_wallet_change_applies_to_the_next_intent_only(client, app, merchant):
    from backend.merchants.services import set_wallet

    first = post(client, merchant, {"amount_usdc": 3}).get_json()["data"]
    new_address = "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"
    set_wallet(merchant.id, "eip155:84532", new_address, app.extensions["payintent.chains"])
    second = post(client, merchant, {"amount_usdc": 3}).get_json()["data"]
    pay_to = lambda d: next(r["payTo"] for r in d["payment_requirements"] if r["network"] == "eip155:84532")  # noqa: E731
    assert pay_to(second) == new_address
    reread = client.get(f"{URL}/{first['intent_id']}", headers=merchant.headers).get_json()["data"]
    assert pay_to(reread) == EVM_WALLET


def test_full_request_is_echoed_on_read(client, merchant):
    body = {
        "amount_usdc": 0.000001,
        "redirect_url": "https://shop.example/thanks?x=1",
        "cancel_url": "http://localhost:3000/cart",
        "description": "Tiny",
        "order_id": "A-1",
        "metadata": {"customer": "c_1", "qty": 2, "gift": True, "note": None, "price": 1.25, "name": "Zoë ✓"},
    }
    created = post(client, merchant, body).get_json()["data"]
    read = client.get(f"{URL}/{created['intent_id']}", headers=merchant.headers).get_json()["data"]
    for field in ("redirect_url", "cancel_url", "description", "order_id", "metadata"):
        assert read[field] == body[field]
    assert read["payment_requirements"][0]["maxAmountRequired"] == "1"
    assert read["created_at"].endswith("Z")
    # what was written (on PostgreSQL by the driver's cursor: extensions.insert_autocommit) reads back as answered
    for field in ("created_at", "expires_at", "payment_requirements", "status", "amount_usdc"):
        assert read[field] == created[field], field


BAD_BODIES = [
    pytest.param('{"amount_usdc": "10"}', "amount_usdc", id="string-amount"),
    pytest.param('{"amount_usdc": true}', "amount_usdc", id="boolean-amount"),
    pytest.param('{"amount_usdc": null}', "amount_usdc", id="null-amount"),
    pytest.param('{"amount_usdc": 0}', "amount_usdc", id="zero"),
    pytest.param('{"amount_usdc": -1}', "amount_usdc", id="negative"),
    pytest.param('{"amount_usdc": 1.0000001}', "amount_usdc", id="seven-decimals"),
    pytest.param('{"amount_usdc": 1000000.000001}', "amount_usdc", id="above-maximum"),
    pytest.param('{"amount_usdc": 1e400}', "amount_usdc", id="huge-exponent"),
    pytest.param('{"amount_usdc": 1e-400}', "amount_usdc", id="tiny-exponent"),
    pytest.param('{"amount_usdc": 1E999999999999}', "amount_usdc", id="overflowing-exponent"),
    pytest.param('{"amount_usdc": [1]}', "amount_usdc", id="list-amount"),
    pytest.param("{}", "amount_usdc", id="missing-amount"),
    pytest.param('{"amount_usdc": 1, "colour": "red"}', "colour", id="unknown-field"),
    pytest.param('{"amount_usdc": 1, "redirect_url": "javascript:alert(1)"}', "redirect_url", id="js-url"),
    pytest.param('{"amount_usdc": 1, "redirect_url": "ftp://x.example/a"}', "redirect_url", id="ftp-url"),
    pytest.param('{"amount_usdc": 1, "cancel_url": "not a url"}', "cancel_url", id="bad-cancel-url"),
    pytest.param(
        '{"amount_usdc": 1, "redirect_url": "https://a.example/' + "x" * 2100 + '"}', "redirect_url", id="long-url"
    ),
    pytest.param('{"amount_usdc": 1, "order_id": ""}', "order_id", id="empty-order"),
    pytest.param('{"amount_usdc": 1, "order_id": "' + "o" * 129 + '"}', "order_id", id="long-order"),
    pytest.param('{"amount_usdc": 1, "order_id": 12}', "order_id", id="numeric-order"),
    pytest.param('{"amount_usdc": 1, "description": "' + "d" * 501 + '"}', "description", id="long-description"),
    pytest.param('{"amount_usdc": 1, "metadata": {"a": {"b": 1}}}', "metadata", id="nested-metadata"),
    pytest.param('{"amount_usdc": 1, "metadata": {"a": [1]}}', "metadata", id="list-in-metadata"),
    pytest.param('{"amount_usdc": 1, "metadata": [1]}', "metadata", id="metadata-list"),
    pytest.param(
        '{"amount_usdc": 1, "metadata": {' + ",".join(f'"k{i}": 1' for i in range(51)) + "}}",
        "metadata",
        id="too-many-keys",
    ),
    pytest.param('{"amount_usdc": 1, "metadata": {"' + "k" * 41 + '": 1}}', "metadata", id="long-key"),
    pytest.param('{"amount_usdc": 1, "metadata": {"k": "' + "v" * 501 + '"}}', "metadata", id="long-value"),
    pytest.param("[1, 2]", "_schema", id="array-body"),
]


@pytest.mark.parametrize(("raw", "field"), BAD_BODIES)
def test_bad_input_is_a_400_naming_the_field_and_writes_nothing(client, merchant, raw, field):
    response = client.post(URL, data=raw, content_type="application/json", headers=merchant.headers)
    assert response.status_code == 400, response.data
    body = response.get_json()
    assert body["success"] is False
    assert body["error"]["code"] == "VALIDATION_ERROR"
    assert field in body["error"]["fields"]
    assert body["error"]["message"]
    assert intent_count() == 0


@pytest.mark.parametrize(
    "raw",
    [
        '{"amount_usdc": NaN}',
        '{"amount_usdc": Infinity}',
        '{"amount_usdc": -Infinity}',
        '{"amount_usdc": 1',
        '{"amount_usdc": 1' + "0" * 5000 + "}",
        "[" * 100000 + "]" * 100000,
        "",
    ],
    ids=["nan", "infinity", "minus-infinity", "truncated", "5000-digit-int", "deep-nesting", "empty"],
)
def test_malformed_json_is_invalid_json(client, merchant, raw):
    response = client.post(URL, data=raw, content_type="application/json", headers=merchant.headers)
    # The deep-nesting body is over the request size limit; either way it is refused cleanly.
    assert response.status_code in (400, 413), response.data
    assert response.get_json()["error"]["code"] in ("INVALID_JSON", "PAYLOAD_TOO_LARGE")
    assert intent_count() == 0


def test_body_must_be_json(client, merchant):
    response = client.post(
        URL, data="amount_usdc=1", content_type="application/x-www-form-urlencoded", headers=merchant.headers
    )
    assert response.status_code == 415
    assert response.get_json()["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"


def test_invalid_utf8_is_invalid_json(client, merchant):
    response = client.post(
        URL, data=b'{"amount_usdc": 1, "order_id": "\xff"}', content_type="application/json", headers=merchant.headers
    )
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "INVALID_JSON"


def test_amount_keeps_every_decimal(client, merchant):
    response = client.post(
        URL, data='{"amount_usdc": 123456.789012}', content_type="application/json", headers=merchant.headers
    )
    assert b'"amount_usdc":123456.789012' in response.data
    assert response.get_json()["data"]["payment_requirements"][0]["maxAmountRequired"] == "123456789012"
