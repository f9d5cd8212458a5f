"""Refund records without a chain: what a refund's creation refuses, and how a refund shows in the API and on the
dashboard's intent page once its settlement confirmed it (the on-chain paths: tests/settlement/test_refunds*.py)."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import select, update

from backend import clock
from backend.events.models import Event
from backend.extensions import db
from backend.intents import refunds
from backend.intents.models import Intent
from tests.dashboard.helpers import text
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
