"""POST /api/v1/x402/pay on the real devnet: money moves once, balances checked on chain."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from backend.events.models import Event
from backend.extensions import db
from payintent.eip3009 import sign_authorization

INTENTS = "/api/v1/x402/intents"
PAY = "/api/v1/x402/pay"


def create_intent(client: Any, shop: Any, amount: float = 1.5) -> dict[str, Any]:
    response = client.post(INTENTS, json={"amount_usdc": amount, "order_id": "o-1"}, headers=shop.headers)
    assert response.status_code == 201, response.data
    return response.get_json()["data"]


def requirement(intent: dict[str, Any], network: str) -> dict[str, Any]:
    return next(r for r in intent["payment_requirements"] if r["network"] == network)


def pay(client: Any, shop: Any, intent: dict[str, Any], network: str, payload: dict[str, Any]) -> Any:
    body = {
        "intent_id": intent["intent_id"],
        "payment_signature": {"scheme": "exact", "network": network, "x402Version": 1, "payload": payload},
    }
    return client.post(PAY, json=body, headers=shop.headers)


def events(kind: str) -> list[dict[str, Any]]:
    return [json.loads(e.payload) for e in db.session.scalars(select(Event).where(Event.type == kind))]


@pytest.mark.parametrize("network", ["eip155:84532", "eip155:11155111", "eip155:5042002"])
def test_happy_path_moves_exactly_the_amount_once(pay_client, shop, devnet, network):
    buyer = devnet.buyer(0)
    intent = create_intent(pay_client, shop, 1.5)
    payload = sign_authorization(buyer.key, requirement(intent, network))
    buyer_before = devnet.balance(network, buyer.address)
    response = pay(pay_client, shop, intent, network, payload)
    assert response.status_code == 200, response.data
    data = response.get_json()["data"]
    assert data["network"] == network and data["amount_usdc"] == 1.5
    receipt = devnet.w3(network).eth.get_transaction_receipt(data["tx_hash"])
    assert receipt["status"] == 1
    assert devnet.balance(network, shop.payout) == 1_500_000
    assert buyer_before - devnet.balance(network, buyer.address) == 1_500_000
    read = pay_client.get(f"{INTENTS}/{intent['intent_id']}", headers=shop.headers).get_json()["data"]
    assert read["status"] == "paid"
    assert read["tx_hash"] == data["tx_hash"] and read["chain"] == network and read["buyer_address"] == buyer.address
    assert read["paid_at"] == data["settled_at"]
    completed = events("payment.completed")
    assert len(completed) == 1
    assert completed[0]["data"] == {
        "intent_id": intent["intent_id"], "status": "paid", "amount_usdc": 1.5, "order_id": "o-1",
        "tx_hash": data["tx_hash"], "buyer_address": buyer.address, "chain": network, "paid_at": read["paid_at"],
    }  # fmt: skip


def test_already_paid_with_the_same_or_a_new_signature(pay_client, shop, devnet):
    network = "eip155:84532"
    intent = create_intent(pay_client, shop)
    first = sign_authorization(devnet.buyer(1).key, requirement(intent, network))
    assert pay(pay_client, shop, intent, network, first).status_code == 200
    for payload in (first, sign_authorization(devnet.buyer(1).key, requirement(intent, network))):
        response = pay(pay_client, shop, intent, network, payload)
        assert response.status_code == 409
        assert response.get_json()["error"]["code"] == "ALREADY_PAID"
    assert devnet.balance(network, shop.payout) == 1_500_000


def _tamper(field: str, value: Any):
    return lambda payload: {**payload, field: value}


@pytest.mark.parametrize(
    ("mutate", "status", "code"),
    [
        (_tamper("value", "1"), 400, "AMOUNT_MISMATCH"),
        (_tamper("to", "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"), 400, "RECIPIENT_MISMATCH"),
        (_tamper("validBefore", "1000"), 400, "AUTHORIZATION_EXPIRED"),
        (_tamper("validAfter", "99999999999"), 400, "AUTHORIZATION_NOT_YET_VALID"),
        (_tamper("signature", "0x" + "11" * 65), 400, "INVALID_SIGNATURE"),
        (_tamper("nonce", "0x1234"), 400, "INVALID_PAYLOAD"),
        (_tamper("from", "not-an-address"), 400, "INVALID_PAYLOAD"),
        (lambda p: {k: v for k, v in p.items() if k != "signature"}, 400, "INVALID_PAYLOAD"),
    ],
    ids=["amount", "recipient", "expired", "not-yet-valid", "bad-signature", "short-nonce", "bad-from", "no-sig"],
)
def test_refused_authorizations_move_nothing_and_leave_the_intent_payable(
    pay_client, shop, devnet, mutate, status, code
):
    network = "eip155:84532"
    intent = create_intent(pay_client, shop)
    payload = mutate(sign_authorization(devnet.buyer(2).key, requirement(intent, network)))
    response = pay(pay_client, shop, intent, network, payload)
    assert response.status_code == status, response.data
    assert response.get_json()["error"]["code"] == code
    failed = events("payment.failed")
    assert len(failed) == 1 and failed[0]["data"]["intent_id"] == intent["intent_id"]
    assert failed[0]["data"]["reason"] and failed[0]["data"]["order_id"] == "o-1"
    assert devnet.balance(network, shop.payout) == 0
    # Still payable with a good authorization.
    good = sign_authorization(devnet.buyer(2).key, requirement(intent, network))
    assert pay(pay_client, shop, intent, network, good).status_code == 200


def test_unknown_network_and_scheme(pay_client, shop, devnet):
    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, "eip155:84532"))
    response = pay(pay_client, shop, intent, "eip155:1", payload)
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "UNSUPPORTED_NETWORK"
    body = {
        "intent_id": intent["intent_id"],
        "payment_signature": {"scheme": "upto", "network": "eip155:84532", "x402Version": 1, "payload": payload},
    }
    response = pay_client.post(PAY, json=body, headers=shop.headers)
    assert response.status_code == 400 and response.get_json()["error"]["code"] == "UNSUPPORTED_SCHEME"


def test_insufficient_balance_is_settlement_failed_with_a_reason(pay_client, shop, devnet):
    from eth_account import Account

    network = "eip155:11155111"
    poor = Account.create()
    intent = create_intent(pay_client, shop, 3)
    response = pay(pay_client, shop, intent, network, sign_authorization(poor.key, requirement(intent, network)))
    assert response.status_code == 402
    error = response.get_json()["error"]
    assert error["code"] == "SETTLEMENT_FAILED" and "insufficient balance" in error["reason"]
    assert pay_client.get(f"{INTENTS}/{intent['intent_id']}", headers=shop.headers).get_json()["data"]["status"] == (
        "pending"
    )


def test_cancelled_intent_accepts_no_signed_authorization(pay_client, shop, devnet):
    network = "eip155:84532"
    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, network))  # signed before the cancel
    assert pay_client.delete(f"{INTENTS}/{intent['intent_id']}", headers=shop.headers).status_code == 200
    response = pay(pay_client, shop, intent, network, payload)
    assert response.status_code == 409 and response.get_json()["error"]["code"] == "INTENT_CANCELLED"
    assert devnet.balance(network, shop.payout) == 0


def test_another_merchants_intent_is_404(pay_client, shop, pay_app, devnet):
    from tests.conftest import create_merchant

    other = create_merchant(pay_app, "other-pay@example.com", {"eip155:84532": shop.payout})
    intent = create_intent(pay_client, other)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, "eip155:84532"))
    assert pay(pay_client, shop, intent, "eip155:84532", payload).status_code == 404


def test_twenty_concurrent_payments_move_money_once(pay_app, shop, devnet):
    network = "eip155:5042002"
    client = pay_app.test_client()
    intent = create_intent(client, shop, 2)
    payloads = [sign_authorization(devnet.buyer(i % 3).key, requirement(intent, network)) for i in range(20)]

    def attempt(payload: dict[str, Any]) -> tuple[int, str]:
        with pay_app.test_client() as c:
            r = pay(c, shop, intent, network, payload)
            return r.status_code, (r.get_json().get("error") or {}).get("code", "OK")

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(attempt, payloads))
    assert sum(status == 200 for status, _ in results) == 1, results
    assert {code for status, code in results if status != 200} <= {"ALREADY_PAID", "PAYMENT_IN_PROGRESS"}
    assert devnet.balance(network, shop.payout) == 2_000_000
    assert len(events("payment.completed")) == 1


def test_domain_name_is_read_from_the_chain_when_the_chains_file_omits_it(db_url, redis_server_url, devnet, tmp_path):
    from backend.app import create_app
    from backend.chains.registry import ChainRegistry
    from tests.conftest import make_settings, truncate_all

    document = json.loads(Path(devnet.info["chains_file"]).read_text())
    for network in document["networks"]:
        network.pop("usdc_domain_name", None)
    path = tmp_path / "chains.json"
    path.write_text(json.dumps(document))
    registry = ChainRegistry.load(path)
    assert all(n.usdc_domain_name is None for n in registry)
    truncate_all(db_url)
    app = create_app(make_settings(db_url, redis_url=redis_server_url), chains=registry)
    with app.app_context():
        from tests.conftest import create_merchant

        shop = create_merchant(app, "domain@example.com", {n: devnet.buyer(0).address for n in devnet.networks})
        intent = create_intent(app.test_client(), shop)
        for req in intent["payment_requirements"]:
            assert req["usdcDomainName"] == "USDC" and req["extra"] == {"name": "USDC", "version": "2"}
        db.session.remove()
        db.engine.dispose()


def test_expired_intent_and_reused_nonce(pay_client, shop, devnet):
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from backend.intents.models import Intent

    network = "eip155:84532"
    paid = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(0).key, requirement(paid, network))
    assert pay(pay_client, shop, paid, network, payload).status_code == 200
    # The same signed authorization presented for another intent with the same terms: nonce already used.
    other = create_intent(pay_client, shop)
    response = pay(pay_client, shop, other, network, payload)
    assert response.status_code == 409 and response.get_json()["error"]["code"] == "NONCE_ALREADY_USED"
    # An expired intent refuses a fresh, valid authorization.
    db.session.execute(
        update(Intent)
        .where(Intent.id == other["intent_id"])
        .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    )
    db.session.commit()
    fresh = sign_authorization(devnet.buyer(0).key, requirement(other, network))
    response = pay(pay_client, shop, other, network, fresh)
    assert response.status_code == 410 and response.get_json()["error"]["code"] == "INTENT_EXPIRED"
    assert devnet.balance(network, shop.payout) == 1_500_000


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"intent_id": "x"},
        {"intent_id": "x", "payment_signature": "nope"},
        {
            "intent_id": "x",
            "payment_signature": {"scheme": "exact", "network": "eip155:84532", "x402Version": "1", "payload": {}},
        },
    ],
)
def test_malformed_pay_bodies_are_validation_errors(pay_client, shop, body):
    response = pay_client.post(PAY, json=body, headers=shop.headers)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "VALIDATION_ERROR"


def test_pay_responses_match_the_openapi_document(pay_client, shop, devnet):
    from tests.test_openapi import check

    spec = json.loads(pay_client.get("/api/v1/openapi.json").data)
    network = "eip155:11155111"
    intent = create_intent(pay_client, shop)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, network))
    check(spec, PAY, "post", pay(pay_client, shop, intent, network, payload))  # 200
    check(spec, PAY, "post", pay(pay_client, shop, intent, network, payload))  # 409 ALREADY_PAID
    check(spec, PAY, "post", pay_client.post(PAY, json={}, headers=shop.headers))  # 400


def test_unreachable_chain_is_chain_unavailable_and_claims_nothing(db_url, redis_server_url, devnet, tmp_path):
    from backend.app import create_app
    from backend.chains.registry import ChainRegistry
    from backend.intents.models import Intent
    from tests.conftest import create_merchant, free_port, make_settings, truncate_all

    document = json.loads(Path(devnet.info["chains_file"]).read_text())
    for network in document["networks"]:
        network["rpc_url"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there: an RPC outage
    path = tmp_path / "chains.json"
    path.write_text(json.dumps(document))
    truncate_all(db_url)
    app = create_app(make_settings(db_url, redis_url=redis_server_url), chains=ChainRegistry.load(path))
    with app.app_context():
        shop = create_merchant(app, "outage@example.com", {n: devnet.buyer(1).address for n in devnet.networks})
        client = app.test_client()
        intent = create_intent(client, shop)
        payload = sign_authorization(devnet.buyer(0).key, requirement(intent, "eip155:84532"))
        response = pay(client, shop, intent, "eip155:84532", payload)
        assert response.status_code == 503
        assert response.get_json()["error"]["code"] == "CHAIN_UNAVAILABLE"
        assert "127.0.0.1" not in response.get_data(as_text=True)  # no RPC URL leaks to the caller
        assert db.session.get(Intent, intent["intent_id"]).settlement_id is None
        # Our outage is not the payment failing: no payment.failed for merchants to act on (drills: 50+ per outage).
        assert db.session.scalar(select(func.count()).select_from(Event).where(Event.type == "payment.failed")) == 0
        db.session.remove()
        db.engine.dispose()
