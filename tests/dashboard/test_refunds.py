"""Refund records without a chain: what a refund's creation refuses, and how a refund shows in the API and on the
dashboard's intent page once its settlement confirmed it (the on-chain paths: tests/settlement/test_refunds*.py)."""

from __future__ import annotations

import json
import re
from decimal import Decimal

from sqlalchemy import select, update

from backend import clock
from backend.events.models import Event
from backend.extensions import db
from backend.intents import refunds
from backend.intents.models import Intent
from tests.dashboard.helpers import form_token, text
from tests.intents.helpers import create

BUYER = "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"
NETWORK = "eip155:84532"


def _paid(client, merchant, amount: str) -> str:
    intent = create(client, merchant, amount_usdc=Decimal(amount))
    db.session.execute(
        update(Intent)
        .where(Intent.id == intent["intent_id"])
        .values(status="paid", chain=NETWORK, paid_at=clock.now(), buyer_address=BUYER, tx_hash="0x" + "ab" * 32)
    )
    db.session.commit()
    return str(intent["intent_id"])


def requirement_pay_to(client, merchant, intent_id: str) -> str:
    intent = client.get(f"/api/v1/x402/intents/{intent_id}", headers=merchant.headers).get_json()["data"]
    return next(r["payTo"] for r in intent["payment_requirements"] if r["network"] == NETWORK)


def _refund(client, merchant, intent_id: str, **body):
    return client.post(f"/api/v1/x402/intents/{intent_id}/refunds", json=body, headers=merchant.headers)


def test_a_refund_is_created_only_for_a_paid_intent_and_within_what_was_paid(client, merchant, other_merchant):
    pending = create(client, merchant, amount_usdc=Decimal("2"))
    refused = _refund(client, merchant, pending["intent_id"])
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "INTENT_NOT_REFUNDABLE"
    intent_id = _paid(client, merchant, "2")
    assert _refund(client, other_merchant, intent_id).status_code == 404
    assert _refund(client, merchant, "not-an-id").status_code == 404
    over = _refund(client, merchant, intent_id, amount_usdc=2.000001)
    assert over.status_code == 409 and over.get_json()["error"]["code"] == "REFUND_EXCEEDS_PAYMENT"
    for bad in ({"amount_usdc": 0}, {"amount_usdc": "1"}, {"amount_usdc": 1.0000001}, {"surprise": 1}):
        answer = _refund(client, merchant, intent_id, **bad)
        assert answer.status_code == 400 and answer.get_json()["error"]["code"] == "VALIDATION_ERROR", bad
    created = _refund(client, merchant, intent_id)
    assert created.status_code == 201, created.data
    refund = created.get_json()["data"]
    assert refund["amount_usdc"] == 2 and refund["pay_to"] == BUYER and refund["status"] == "requires_signature"
    # A refund waiting for its signature reserves nothing: another can be created (only paying one decides).
    assert _refund(client, merchant, intent_id, amount_usdc=1).status_code == 201
    unknown = client.get("/api/v1/refunds/re_" + "0" * 32, headers=merchant.headers)
    assert unknown.status_code == 404 and unknown.get_json()["error"]["code"] == "NOT_FOUND"
    assert client.get("/api/v1/refunds/nope", headers=merchant.headers).status_code == 404


def test_a_succeeded_refund_shows_in_the_api_and_on_the_dashboard(client, merchant, dashboard):
    intent_id = _paid(client, merchant, "3")
    refund = _refund(client, merchant, intent_id, amount_usdc=1.25, reason="late delivery").get_json()["data"]
    waiting = _refund(client, merchant, intent_id, amount_usdc=0.5).get_json()["data"]
    # What a confirmed refund settlement does (settlement.services.complete_settlement), twice: once counts.
    tx_hash = "0x" + "cd" * 32
    for _ in range(2):
        refunds.mark_succeeded(refund["refund_id"], tx_hash, clock.now())
        db.session.commit()
    read = client.get(f"/api/v1/x402/intents/{intent_id}", headers=merchant.headers).get_json()["data"]
    assert read["refunded_usdc"] == Decimal("1.25")
    assert [(r["refund_id"], r["status"]) for r in read["refunds"]] == [
        (refund["refund_id"], "succeeded"), (waiting["refund_id"], "requires_signature")]  # fmt: skip
    events = db.session.scalars(select(Event).where(Event.type == "refund.issued")).all()
    assert len(events) == 1 and refund["refund_id"] in events[0].payload
    page = text(dashboard.get(f"/dashboard/intents/{intent_id}"))
    assert "Refunds" in page and refund["refund_id"] in page and waiting["refund_id"] in page
    assert tx_hash in page and "requires signature" in page and "1.25" in page
    listed = client.get("/api/v1/refunds", headers=merchant.headers).get_json()["data"]
    assert listed["total"] == 2 and {r["refund_id"] for r in listed["refunds"]} == {
        refund["refund_id"],
        waiting["refund_id"],
    }
    export = text(client.get("/api/v1/x402/intents/export.csv", headers=merchant.headers))
    assert export.splitlines()[1].endswith(",1.25")


def test_the_dashboard_creates_a_refund_and_its_page_carries_the_signer(client, merchant, dashboard):
    intent_id = _paid(client, merchant, "3")
    page = text(dashboard.get(f"/dashboard/intents/{intent_id}"))
    assert "Left to refund: 3 USDC" in page or "Left to refund: 3.00 USDC" in page, page
    csrf = form_token(page)
    bad = dashboard.post(f"/dashboard/intents/{intent_id}/refunds", data={"csrf_token": csrf, "amount_usdc": "1e3"})
    assert bad.status_code == 302 and "/dashboard/intents/" in bad.headers["Location"]
    over = dashboard.post(f"/dashboard/intents/{intent_id}/refunds", data={"csrf_token": csrf, "amount_usdc": "3.5"})
    assert over.status_code == 302 and "exceeds what is left" in text(dashboard.get(over.headers["Location"]))
    made = dashboard.post(f"/dashboard/intents/{intent_id}/refunds",
                          data={"csrf_token": csrf, "amount_usdc": "1.5", "reason": "broken"})  # fmt: skip
    assert made.status_code == 302 and "/dashboard/refunds/re_" in made.headers["Location"], made.data
    shown = dashboard.get(made.headers["Location"])
    assert shown.status_code == 200
    csp = shown.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe" not in csp
    body = text(shown)
    assert 'src="/dashboard/static/refund.js"' in body and "Sign with your payout wallet" in body
    signer = json.loads(re.search(r'id="refund-signer-data">(.*?)</script>', body, re.S).group(1))
    assert signer["requirement"]["payTo"] == BUYER and signer["requirement"]["maxAmountRequired"] == "1500000"
    assert signer["network"]["chain_id"] == 84532 and signer["pay_from"] == requirement_pay_to(
        client, merchant, intent_id
    )
    # Other dashboard pages run no script at all.
    assert "script-src" not in dashboard.get(f"/dashboard/intents/{intent_id}").headers["Content-Security-Policy"]
    # The JSON routes: the CSRF token in a header, or nothing is done.
    refund_id = signer["refund_id"]
    no_token = dashboard.post(f"/dashboard/refunds/{refund_id}/pay", json={"payment_signature": {}})
    assert no_token.status_code == 400 and "refund" not in no_token.headers.get("Content-Type", "json")
    headers = {"X-CSRF-Token": signer["csrf_token"]}
    empty = dashboard.post(f"/dashboard/refunds/{refund_id}/pay", json={"nope": 1}, headers=headers)
    assert empty.status_code == 400 and empty.get_json()["error"]["code"] == "INVALID_PAYLOAD"
    status = dashboard.get(f"/dashboard/refunds/{refund_id}/status").get_json()["data"]
    assert status["status"] == "requires_signature" and status["reason"] == "broken"
    # Another merchant's refund is no page and no route.
    client.post("/dashboard/logout", data={"csrf_token": signer["csrf_token"]})
    assert client.get(f"/dashboard/refunds/{refund_id}").status_code == 302  # logged out: to the log-in page
