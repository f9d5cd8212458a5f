"""payment.failed cannot be used to flood a merchant: anyone with an intent id can make attempts fail.

The public checkout route is rate-limited per client IP, so the attack comes from many addresses
(``REMOTE_ADDR`` here). Every attempt is refused offline (no chain is asked); the cap is per intent:
at most one payment.failed per error code and FAILED_EVENTS_PER_WINDOW in all per FAILED_EVENT_WINDOW.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from eth_account import Account
from sqlalchemy import select

from backend.events.models import Event
from backend.extensions import db
from backend.settlement import services
from payintent.eip3009 import sign_authorization
from tests.conftest import make_settings, truncate_all
from tests.intents.helpers import create

CHECKOUT = "/api/v1/checkout/intents"
NETWORK = "eip155:84532"
BUYER = Account.create()
CAP = 5  # payment.failed per intent per hour (docs/webhooks.md; services.FAILED_EVENTS_PER_WINDOW)


@pytest.fixture
def app(db_url: str, redis_url: str, chains: Any) -> Any:
    """The service with Redis (the settlement queue /pay needs) and the public testnets (no chain is reached)."""
    from backend.app import create_app

    truncate_all(db_url)
    application = create_app(make_settings(db_url, redis_url=redis_url), chains=chains)
    with application.app_context():
        yield application
        db.session.remove()
        db.engine.dispose()


def _requirement(intent: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in intent["payment_requirements"] if r["network"] == NETWORK)


def _tampered(field: str, value: str) -> Any:
    def make(intent: dict[str, Any]) -> dict[str, Any]:
        return {**sign_authorization(BUYER.key, _requirement(intent)), field: value}

    return make


# Bad payments that fail for different reasons (each a 4xx before any chain read).
ATTEMPTS = [
    ("INVALID_SIGNATURE", _tampered("signature", "0x" + "11" * 65)),
    ("AMOUNT_MISMATCH", _tampered("value", "1")),
    ("RECIPIENT_MISMATCH", _tampered("to", "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC")),
    ("AUTHORIZATION_EXPIRED", _tampered("validBefore", "1000")),
    ("AUTHORIZATION_NOT_YET_VALID", _tampered("validAfter", "99999999999")),
    ("INVALID_PAYLOAD", _tampered("nonce", "0x1234")),
    ("AUTHORIZATION_TOO_LONG", lambda i: sign_authorization(BUYER.key, _requirement(i), valid_for=7200)),
]


def _attempt(client: Any, intent: dict[str, Any], payload: dict[str, Any], ip: str) -> Any:
    body = {"payment_signature": {"scheme": "exact", "network": NETWORK, "x402Version": 1, "payload": payload}}
    return client.post(f"{CHECKOUT}/{intent['intent_id']}/pay", json=body, environ_base={"REMOTE_ADDR": ip})


def _failed_events(intent_id: str) -> list[dict[str, Any]]:
    db.session.expire_all()
    rows = db.session.scalars(
        select(Event).where(Event.type == "payment.failed", Event.intent_id == intent_id).order_by(Event.created_at)
    )
    return [json.loads(row.payload)["data"] for row in rows]


def test_the_cap_is_the_documented_one():
    assert services.FAILED_EVENTS_PER_WINDOW == CAP and timedelta(hours=1) == services.FAILED_EVENT_WINDOW


def test_fifty_attempts_with_one_reason_send_one_event(client, merchant):
    intent = create(client, merchant)
    for i in range(50):
        response = _attempt(client, intent, ATTEMPTS[0][1](intent), f"203.0.113.{i}")
        assert response.status_code == 400 and response.get_json()["error"]["code"] == "INVALID_SIGNATURE"
    (event,) = _failed_events(intent["intent_id"])
    assert event["code"] == "INVALID_SIGNATURE" and event["intent_id"] == intent["intent_id"]


def test_fifty_attempts_with_rotating_reasons_send_at_most_the_cap(client, merchant):
    intent = create(client, merchant)
    other = create(client, merchant)
    for i in range(50):
        code, make = ATTEMPTS[i % len(ATTEMPTS)]
        response = _attempt(client, intent, make(intent), f"198.51.100.{i}")
        assert response.status_code == 400 and response.get_json()["error"]["code"] == code  # the buyer still hears why
    events = _failed_events(intent["intent_id"])
    assert len(events) == CAP
    assert [e["code"] for e in events] == [code for code, _ in ATTEMPTS[:CAP]]
    # The cap is per intent: another intent's first failure is still told.
    assert _attempt(client, other, ATTEMPTS[0][1](other), "192.0.2.1").status_code == 400
    assert len(_failed_events(other["intent_id"])) == 1


def test_the_window_passes_and_failures_are_told_again(client, merchant, clock, monkeypatch):
    monkeypatch.setattr(services, "FAILED_EVENT_WINDOW", timedelta(minutes=10), raising=False)
    intent = create(client, merchant)
    for i in range(10):
        _attempt(client, intent, ATTEMPTS[0][1](intent), f"203.0.113.{i}")
    assert len(_failed_events(intent["intent_id"])) == 1
    clock.advance(minutes=11)
    for i in range(10):
        _attempt(client, intent, ATTEMPTS[0][1](intent), f"203.0.113.{i}")
    assert len(_failed_events(intent["intent_id"])) == 2


def test_concurrent_attempts_cannot_slip_past_the_cap(app, merchant):
    client = app.test_client()
    intent = create(client, merchant)
    payloads = [ATTEMPTS[i % len(ATTEMPTS)][1](intent) for i in range(40)]

    def attempt(i: int) -> int:
        with app.app_context(), app.test_client() as c:
            return int(_attempt(c, intent, payloads[i], f"198.51.100.{i}").status_code)

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(attempt, range(len(payloads))))
    assert set(statuses) == {400}
    events = _failed_events(intent["intent_id"])
    assert len(events) <= CAP
    assert len({e["code"] for e in events}) == len(events)  # never the same reason twice
