"""Refunds on the real devnet: the merchant's payout wallet signs, the relay settles, balances checked on chain.

A refund of a paid intent is paid from the wallet the payment landed in to the buyer, exactly once, and the
refunds of one intent never exceed what was paid, sequential or concurrent.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
from eth_account import Account
from sqlalchemy import select

from backend.events.models import Event
from backend.extensions import db
from payintent.eip3009 import sign_authorization
from tests.conftest import create_merchant
from tests.settlement.test_pay import INTENTS, create_intent, pay, requirement
from tests.settlement.test_recovery import _send_as, _token

NETWORK = "eip155:84532"
REFUNDS = "/api/v1/refunds"


@pytest.fixture
def wallet_shop(pay_app: Any, devnet: Any) -> Any:
    """A merchant whose payout wallet (on every devnet chain) is a key the test holds: it signs the refunds."""
    wallet = Account.create()
    handle = create_merchant(pay_app, f"refunds-{wallet.address[-8:].lower()}@example.com",
                             {n: wallet.address for n in devnet.networks})  # fmt: skip
    handle.wallet = wallet  # type: ignore[attr-defined]
    return handle


def paid_intent(client: Any, shop: Any, devnet: Any, amount: float, buyer: Any, network: str = NETWORK) -> dict:
    intent = create_intent(client, shop, amount)
    answer = pay(client, shop, intent, network, sign_authorization(buyer.key, requirement(intent, network)))
    assert answer.status_code == 200, answer.data
    return intent


def create_refund(client: Any, shop: Any, intent_id: str, **body: Any) -> Any:
    return client.post(f"{INTENTS}/{intent_id}/refunds", json=body, headers=shop.headers)


def pay_refund(client: Any, shop: Any, refund: dict[str, Any], payload: dict[str, Any]) -> Any:
    (req,) = refund["payment_requirements"]
    body = {"payment_signature": {"scheme": "exact", "network": req["network"], "x402Version": 1, "payload": payload}}
    return client.post(f"{REFUNDS}/{refund['refund_id']}/pay", json=body, headers=shop.headers)


def pay_at_once(app: Any, shop: Any, signed: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[tuple[int, str]]:
    """Each (refund, signed payload) sent at the same time, each on its own client: (status, error code or OK)."""

    def attempt(item: tuple[dict[str, Any], dict[str, Any]]) -> tuple[int, str]:
        with app.test_client() as c:
            answer = pay_refund(c, shop, *item)
            return answer.status_code, (answer.get_json().get("error") or {}).get("code", "OK")

    with ThreadPoolExecutor(max_workers=len(signed)) as pool:
        return list(pool.map(attempt, signed))


def refund_events() -> list[dict[str, Any]]:
    db.session.expire_all()
    return [
        json.loads(e.payload)["data"] for e in db.session.scalars(select(Event).where(Event.type == "refund.issued"))
    ]


def test_a_partial_refund_lands_once_in_the_buyers_wallet_and_a_replay_moves_nothing(pay_client, wallet_shop, devnet):
    buyer = devnet.buyer(0)
    intent = paid_intent(pay_client, wallet_shop, devnet, 2, buyer)
    wallet = wallet_shop.wallet.address
    created = create_refund(pay_client, wallet_shop, intent["intent_id"], amount_usdc=0.75, reason="one item back")
    assert created.status_code == 201, created.data
    refund = created.get_json()["data"]
    assert refund["status"] == "requires_signature" and refund["amount_usdc"] == 0.75
    assert refund["pay_from"] == wallet and refund["pay_to"] == buyer.address and refund["network"] == NETWORK
    (req,) = refund["payment_requirements"]
    assert req["payTo"] == buyer.address and req["maxAmountRequired"] == "750000" and req["network"] == NETWORK
    assert (
        req["asset"] == requirement(intent, NETWORK)["asset"] and req["extra"] == requirement(intent, NETWORK)["extra"]
    )

    buyer_before, wallet_before = devnet.balance(NETWORK, buyer.address), devnet.balance(NETWORK, wallet)
    assert wallet_before == 2_000_000
    signed = sign_authorization(wallet_shop.wallet.key, req)
    answer = pay_refund(pay_client, wallet_shop, refund, signed)
    assert answer.status_code == 200, answer.data
    done = answer.get_json()["data"]
    assert done["status"] == "succeeded" and done["tx_hash"] and "payment_requirements" not in done
    assert devnet.w3(NETWORK).eth.get_transaction_receipt(done["tx_hash"])["status"] == 1
    assert devnet.balance(NETWORK, buyer.address) - buyer_before == 750_000
    assert wallet_before - devnet.balance(NETWORK, wallet) == 750_000

    read = pay_client.get(f"{INTENTS}/{intent['intent_id']}", headers=wallet_shop.headers).get_json()["data"]
    assert read["status"] == "paid" and read["refunded_usdc"] == 0.75
    assert [r["refund_id"] for r in read["refunds"]] == [refund["refund_id"]]
    assert read["refunds"][0]["reason"] == "one item back"
    assert refund_events() == [{
        "refund_id": refund["refund_id"], "intent_id": intent["intent_id"], "order_id": "o-1", "amount_usdc": 0.75,
        "tx_hash": done["tx_hash"], "chain": NETWORK, "buyer_address": buyer.address,
        "refunded_at": done["succeeded_at"],
    }]  # fmt: skip

    # A replay of the same signature, on the same refund or on a new one, moves nothing.
    again = pay_refund(pay_client, wallet_shop, refund, signed)
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "REFUND_NOT_PAYABLE"
    other = create_refund(pay_client, wallet_shop, intent["intent_id"], amount_usdc=0.75).get_json()["data"]
    replayed = pay_refund(pay_client, wallet_shop, other, signed)
    assert replayed.status_code == 409 and replayed.get_json()["error"]["code"] == "NONCE_ALREADY_USED"
    assert devnet.balance(NETWORK, buyer.address) - buyer_before == 750_000
    assert len(refund_events()) == 1
    read_refund = pay_client.get(f"{REFUNDS}/{other['refund_id']}", headers=wallet_shop.headers).get_json()["data"]
    assert read_refund["status"] == "requires_signature"  # the refused replay left it as it was


def test_an_over_refund_is_refused_at_creation_and_at_payment(pay_client, wallet_shop, devnet):
    buyer = devnet.buyer(1)
    intent = paid_intent(pay_client, wallet_shop, devnet, 1, buyer)
    intent_id = intent["intent_id"]
    too_much = create_refund(pay_client, wallet_shop, intent_id, amount_usdc=1.000001)
    assert too_much.status_code == 409 and too_much.get_json()["error"]["code"] == "REFUND_EXCEEDS_PAYMENT"
    # The wallet holds more than this payment (other sales): only the refund rule, not its balance, refuses.
    w3, token = _token(devnet, NETWORK)
    _send_as(w3, devnet.buyer(2), token.functions.transfer(wallet_shop.wallet.address, 3_000_000))
    # Two refunds of 0.6 can both be created (neither is signed yet); only the first paid can be paid.
    first, second = (create_refund(pay_client, wallet_shop, intent_id, amount_usdc=0.6).get_json()["data"]
                     for _ in range(2))  # fmt: skip
    buyer_before = devnet.balance(NETWORK, buyer.address)
    key = wallet_shop.wallet.key
    req = first["payment_requirements"][0]
    assert pay_refund(pay_client, wallet_shop, first, sign_authorization(key, req)).status_code == 200
    refused = pay_refund(pay_client, wallet_shop, second, sign_authorization(key, second["payment_requirements"][0]))
    assert refused.status_code == 409, refused.data
    error = refused.get_json()["error"]
    assert error["code"] == "REFUND_EXCEEDS_PAYMENT" and error["refundable_usdc"] == Decimal("0.4")
    assert devnet.balance(NETWORK, buyer.address) - buyer_before == 600_000
    # What is left is refundable, by default all of it; then nothing is.
    rest = create_refund(pay_client, wallet_shop, intent_id).get_json()["data"]
    assert rest["amount_usdc"] == Decimal("0.4")
    paid_rest = pay_refund(pay_client, wallet_shop, rest, sign_authorization(key, rest["payment_requirements"][0]))
    assert paid_rest.status_code == 200, paid_rest.data
    assert devnet.balance(NETWORK, buyer.address) - buyer_before == 1_000_000
    nothing = create_refund(pay_client, wallet_shop, intent_id)
    assert nothing.status_code == 409 and nothing.get_json()["error"]["code"] == "REFUND_EXCEEDS_PAYMENT"
    read = pay_client.get(f"{INTENTS}/{intent_id}", headers=wallet_shop.headers).get_json()["data"]
    assert read["refunded_usdc"] == 1 and len(refund_events()) == 2


def test_concurrent_refunds_never_exceed_what_was_paid(pay_app, wallet_shop, devnet):
    network = "eip155:5042002"
    client = pay_app.test_client()
    buyer = devnet.buyer(2)
    intent = paid_intent(client, wallet_shop, devnet, 1, buyer, network)
    w3, token = _token(devnet, network)  # the wallet holds more than this payment: only the refund rule refuses
    _send_as(w3, devnet.buyer(0), token.functions.transfer(wallet_shop.wallet.address, 5_000_000))
    refunds = [create_refund(client, wallet_shop, intent["intent_id"], amount_usdc=0.6).get_json()["data"]
               for _ in range(6)]  # fmt: skip
    signed = [(r, sign_authorization(wallet_shop.wallet.key, r["payment_requirements"][0])) for r in refunds]
    buyer_before = devnet.balance(network, buyer.address)

    results = pay_at_once(pay_app, wallet_shop, signed)
    assert sum(status == 200 for status, _ in results) == 1, results
    assert {code for status, code in results if status != 200} == {"REFUND_EXCEEDS_PAYMENT"}, results
    assert devnet.balance(network, buyer.address) - buyer_before == 600_000
    assert len(refund_events()) == 1


def test_one_refund_paid_twice_at_once_executes_once(pay_app, wallet_shop, devnet):
    network = "eip155:11155111"
    client = pay_app.test_client()
    buyer = devnet.buyer(0)
    intent = paid_intent(client, wallet_shop, devnet, 1, buyer, network)
    refund = create_refund(client, wallet_shop, intent["intent_id"]).get_json()["data"]
    # Two authorizations of the same refund (two nonces): both valid, only one may be claimed.
    signed = [(refund, sign_authorization(wallet_shop.wallet.key, refund["payment_requirements"][0])) for _ in "ab"]
    buyer_before = devnet.balance(network, buyer.address)

    results = sorted(pay_at_once(pay_app, wallet_shop, signed))
    assert results == [(200, "OK"), (409, "REFUND_NOT_PAYABLE")], results
    assert devnet.balance(network, buyer.address) - buyer_before == 1_000_000
    assert len(refund_events()) == 1


def test_a_refund_signed_by_another_wallet_is_refused_and_moves_nothing(pay_client, wallet_shop, devnet):
    buyer = devnet.buyer(0)
    intent = paid_intent(pay_client, wallet_shop, devnet, 1, buyer)
    refund = create_refund(pay_client, wallet_shop, intent["intent_id"], amount_usdc=0.5).get_json()["data"]
    req = refund["payment_requirements"][0]
    buyer_before = devnet.balance(NETWORK, buyer.address)
    # The buyer's own key, and a stranger's: both sign a valid authorization to the buyer, neither is the payTo.
    for key in (Account.create().key, devnet.buyer(1).key):
        answer = pay_refund(pay_client, wallet_shop, refund, sign_authorization(key, req))
        assert answer.status_code == 400, answer.data
        error = answer.get_json()["error"]
        assert error["code"] == "REFUND_SIGNER_MISMATCH" and error["pay_from"] == wallet_shop.wallet.address
    # A payload naming the wallet as from but signed by another key: the signature check refuses it.
    forged = sign_authorization(devnet.buyer(1).key, req)
    forged["from"] = wallet_shop.wallet.address
    answer = pay_refund(pay_client, wallet_shop, refund, forged)
    assert answer.status_code == 400 and answer.get_json()["error"]["code"] == "INVALID_SIGNATURE"
    # To someone other than the buyer, or another amount: refused by the requirement.
    elsewhere = sign_authorization(wallet_shop.wallet.key, {**req, "payTo": Account.create().address})
    assert pay_refund(pay_client, wallet_shop, refund, elsewhere).get_json()["error"]["code"] == "RECIPIENT_MISMATCH"
    more = sign_authorization(wallet_shop.wallet.key, {**req, "maxAmountRequired": "1000000"})
    assert pay_refund(pay_client, wallet_shop, refund, more).get_json()["error"]["code"] == "AMOUNT_MISMATCH"
    assert devnet.balance(NETWORK, buyer.address) == buyer_before
    read = pay_client.get(f"{REFUNDS}/{refund['refund_id']}", headers=wallet_shop.headers).get_json()["data"]
    assert read["status"] == "requires_signature"


def test_only_a_paid_intent_of_the_merchant_is_refunded(pay_app, pay_client, wallet_shop, devnet):
    pending = create_intent(pay_client, wallet_shop, 1)
    answer = create_refund(pay_client, wallet_shop, pending["intent_id"])
    assert answer.status_code == 409 and answer.get_json()["error"]["code"] == "INTENT_NOT_REFUNDABLE"
    intent = paid_intent(pay_client, wallet_shop, devnet, 1, devnet.buyer(0))
    refund = create_refund(pay_client, wallet_shop, intent["intent_id"]).get_json()["data"]
    stranger = create_merchant(pay_app, "stranger@example.com", {NETWORK: Account.create().address})
    for path, method in ((f"{INTENTS}/{intent['intent_id']}/refunds", "POST"),
                         (f"{INTENTS}/{intent['intent_id']}/refunds", "GET"),
                         (f"{REFUNDS}/{refund['refund_id']}", "GET")):  # fmt: skip
        other = pay_client.open(path, method=method, json={} if method == "POST" else None, headers=stranger.headers)
        assert other.status_code == 404, (path, other.data)
    signed = sign_authorization(wallet_shop.wallet.key, refund["payment_requirements"][0])
    assert pay_refund(pay_client, stranger, refund, signed).status_code == 404
    listed = pay_client.get(f"{REFUNDS}?intent_id={intent['intent_id']}", headers=stranger.headers).get_json()["data"]
    assert listed["refunds"] == [] and listed["total"] == 0
    own = pay_client.get(f"{REFUNDS}?intent_id={intent['intent_id']}", headers=wallet_shop.headers).get_json()["data"]
    assert [r["refund_id"] for r in own["refunds"]] == [refund["refund_id"]]
