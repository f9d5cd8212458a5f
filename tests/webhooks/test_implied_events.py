"""payment.duplicate reaches every endpoint that handles payment.completed (second review, L3).

An endpoint's `events` list is explicit, and payment.duplicate is newer than every endpoint registered
before it: a merchant that handles payments would never hear that a buyer was charged twice and must be
refunded. An endpoint subscribed to payment.completed now receives payment.duplicate as well.
"""

from __future__ import annotations

from sqlalchemy import select

from backend.events.services import record_event
from backend.extensions import db
from backend.webhooks.models import WebhookDelivery
from tests.webhooks.helpers import register

DUPLICATE = {"intent_id": "4b0c", "order_id": "o-1", "amount_usdc": 2, "tx_hash": "0x" + "ab" * 32,
             "buyer_address": "0x" + "cd" * 20, "chain": "eip155:84532", "settlement_id": "stl_1",
             "paid_tx_hash": "0x" + "ef" * 32, "detected_at": "2026-11-22T12:00:00Z"}  # fmt: skip


def _targets(event_id: str) -> set[str]:
    db.session.expire_all()
    rows = db.session.scalars(select(WebhookDelivery).where(WebhookDelivery.event_id == event_id))
    return {row.endpoint_id for row in rows}


def test_payment_duplicate_goes_to_endpoints_that_handle_payment_completed(client, merchant, other_merchant):
    completed = register(client, merchant, "https://shop.example/a", ["payment.completed"])
    named = register(client, merchant, "https://shop.example/b", ["payment.duplicate"])
    failed_only = register(client, merchant, "https://shop.example/c", ["payment.failed"])
    someone_else = register(client, other_merchant, "https://other.example/a", ["payment.completed"])

    duplicate = record_event(merchant.id, "payment.duplicate", DUPLICATE)
    db.session.commit()
    assert _targets(duplicate.id) == {completed["webhook_id"], named["webhook_id"]}

    # Only that one is implied: a payment.completed does not go to an endpoint of payment.duplicate alone.
    paid = record_event(merchant.id, "payment.completed", {"intent_id": "4b0c"})
    db.session.commit()
    assert _targets(paid.id) == {completed["webhook_id"]}
    assert failed_only["webhook_id"] not in _targets(duplicate.id) | _targets(paid.id)
    assert someone_else["webhook_id"] not in _targets(duplicate.id)
