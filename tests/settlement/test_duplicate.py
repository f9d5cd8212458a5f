"""A buyer charged twice for one intent: the merchant hears it as `payment.duplicate` (and must refund).

A reverted EVM authorization stays executable until its validBefore, and its signature is out. If it
executes after another authorization paid the intent, the reconciler's watch records it; before, it
was only a `DUPLICATE_PAYMENT` mark on the settlement and a log line, which no merchant sees.
"""

from __future__ import annotations

import json
from typing import Any

from eth_account import Account
from sqlalchemy import select

from backend.events.models import Event
from backend.extensions import db
from backend.merchants.models import Merchant
from backend.settlement import services
from backend.settlement.models import Settlement
from backend.webhooks.models import WebhookDelivery
from payintent.eip3009 import sign_authorization
from tests.dashboard.helpers import log_in, text
from tests.settlement.conftest import stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, _send_as, _token, iso  # noqa: F401  (fixture)


def _events(kind: str, intent_id: str) -> list[Event]:
    db.session.expire_all()
    return list(db.session.scalars(select(Event).where(Event.type == kind, Event.intent_id == intent_id)))


def _execute(w3: Any, token: Any, payload: dict[str, str]) -> str:
    """Anyone can submit a buyer's signed authorization (it is public once sent): an outsider does."""
    sig = bytes.fromhex(payload["signature"][2:])
    call = token.functions.transferWithAuthorization(
        payload["from"], payload["to"], int(payload["value"]), int(payload["validAfter"]),
        int(payload["validBefore"]), bytes.fromhex(payload["nonce"][2:]), sig[64], sig[:32], sig[32:64],
    )  # fmt: skip
    return "0x" + bytes(_send_as(w3, Account.create(), call)["transactionHash"]).hex()


def test_an_authorization_executed_after_another_paid_the_intent_writes_one_payment_duplicate(iso):  # noqa: F811
    buyer, elsewhere = Account.create(), Account.create()
    w3, token = _token(iso.devnet, NETWORK)
    _send_as(w3, iso.devnet.buyer(1), token.functions.transfer(buyer.address, 2_000_000))
    hook = iso.client.post("/api/v1/webhooks", headers=iso.shop.headers,
                           json={"url": "https://shop.example/hooks", "events": ["payment.duplicate"]})  # fmt: skip
    assert hook.status_code == 201, hook.get_json()
    intent = create_intent(iso.client, iso.shop, 2)
    intent_id = intent["intent_id"]

    # First authorization: the buyer's USDC leaves before the relay sends it, so it reverts and is released.
    first = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, first).get_json()["error"]["code"] == "SETTLEMENT_PENDING"
    _send_as(w3, buyer, token.functions.transfer(elsewhere.address, 2_000_000))
    relayer = iso.relayer()
    try:
        iso.wait_settlement(intent_id, "failed")
        released = iso.settlement(intent_id)
        assert released.failure_code == "SETTLEMENT_FAILED"
        # The buyer has money again and pays with a second authorization: the intent is paid.
        _send_as(w3, elsewhere, token.functions.transfer(buyer.address, 2_000_000))
        _send_as(w3, iso.devnet.buyer(1), token.functions.transfer(buyer.address, 2_000_000))
        second = sign_authorization(buyer.key, requirement(intent, NETWORK))
        pay(iso.client, iso.shop, intent, NETWORK, second)
        paid = iso.wait_paid(intent_id)
    finally:
        stop_process(relayer)

    # Behind the service's back, the first (released, still valid) authorization executes too.
    duplicate_tx = _execute(w3, token, first)
    assert iso.devnet.balance(NETWORK, iso.payout) == 4_000_000  # the buyer was charged twice
    assert iso.reconcile_later()["late"] == 1

    row = iso.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == paid.tx_hash  # the intent keeps its payment
    db.session.expire_all()
    recorded = db.session.get(Settlement, released.id)
    assert recorded is not None
    assert recorded.status == "confirmed" and recorded.tx_hash == duplicate_tx
    assert recorded.failure_code == "DUPLICATE_PAYMENT"
    (event,) = _events("payment.duplicate", intent_id)
    data = json.loads(event.payload)["data"]
    assert data == {
        "intent_id": intent_id, "order_id": "o-1", "amount_usdc": 2, "tx_hash": duplicate_tx,
        "buyer_address": buyer.address, "chain": NETWORK, "settlement_id": released.id,
        "paid_tx_hash": paid.tx_hash, "detected_at": data["detected_at"],
    }  # fmt: skip
    assert data["detected_at"].endswith("Z")
    assert len(_events("payment.completed", intent_id)) == 1  # the first payment's only

    # Found twice, sent once: the watch again, and a second finish of the same settlement.
    assert iso.reconcile_later()["late"] == 0
    assert services.complete_settlement(released.id, duplicate_tx) is True
    assert services.complete_settlement(released.id, "") is True  # finished: no hash needed to say so
    assert services.complete_settlement("stl_" + "0" * 36, duplicate_tx) is False  # no such settlement
    assert len(_events("payment.duplicate", intent_id)) == 1
    deliveries = db.session.scalars(select(WebhookDelivery).where(WebhookDelivery.event_id == event.id)).all()
    assert len(deliveries) == 1 and deliveries[0].status == "pending"  # delivered like every event

    # The dashboard's intent page says so, with what a refund needs.
    merchant = db.session.get(Merchant, iso.shop.id)
    assert merchant is not None
    dashboard = iso.app.test_client()
    assert log_in(dashboard, merchant.email).status_code == 302
    page = text(dashboard.get(f"/dashboard/intents/{intent_id}"))
    assert "Charged more than once: refund needed" in page
    assert duplicate_tx in page and buyer.address in page and "2 USDC" in page
    assert iso.devnet.balance(NETWORK, iso.payout) == 4_000_000
