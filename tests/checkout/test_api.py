"""The public checkout API: no key, one intent, only what a buyer needs, rate-limited."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from backend import clock
from backend.checkout import services
from tests.intents.helpers import URL, create
from tests.test_openapi import check, spec  # noqa: F401  (fixture)

CHECKOUT = "/api/v1/checkout/intents"


def test_a_buyer_reads_the_intent_without_a_key_and_without_merchant_data(client, merchant, spec):  # noqa: F811
    intent = create(client, merchant, amount_usdc=12.5, description="Two mugs", order_id="o-77",
                    metadata={"customer": "c_42"}, redirect_url="https://shop.example/thanks")  # fmt: skip
    response = client.get(f"{CHECKOUT}/{intent['intent_id']}")
    assert response.status_code == 200
    check(spec, f"{CHECKOUT}/{{intent_id}}", "get", response)
    data = response.get_json()["data"]
    assert data["merchant_name"] == "Test Shop" and data["description"] == "Two mugs"
    assert data["amount_usdc"] == 12.5 and data["status"] == "pending"
    assert data["payment_requirements"] == intent["payment_requirements"]
    assert data["redirect_url"] == "https://shop.example/thanks"
    text = response.get_data(as_text=True)
    for secret in ("c_42", "o-77", merchant.api_key, merchant.id):
        assert secret not in text


def test_unknown_and_malformed_ids_are_404(client):
    for intent_id in (str(uuid.uuid4()), "nope", "x" * 36):
        response = client.get(f"{CHECKOUT}/{intent_id}")
        assert response.status_code == 404
        assert response.get_json()["error"]["code"] == "NOT_FOUND"


def test_cancelled_and_expired_show_their_status(client, merchant, clock):
    cancelled = create(client, merchant)
    client.delete(f"{URL}/{cancelled['intent_id']}", headers=merchant.headers)
    assert client.get(f"{CHECKOUT}/{cancelled['intent_id']}").get_json()["data"]["status"] == "cancelled"
    expired = create(client, merchant)
    clock.advance(minutes=31)
    assert client.get(f"{CHECKOUT}/{expired['intent_id']}").get_json()["data"]["status"] == "expired"


def test_clients_are_rate_limited_with_retry_after(client, merchant, monkeypatch):
    intent = create(client, merchant)
    monkeypatch.setattr(services, "READS_PER_MINUTE", 3)
    codes = [client.get(f"{CHECKOUT}/{intent['intent_id']}").status_code for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
    limited = client.get(f"{CHECKOUT}/{intent['intent_id']}")
    assert limited.get_json()["error"]["code"] == "RATE_LIMITED"
    assert 1 <= int(limited.headers["Retry-After"]) <= 60


def test_paying_through_the_checkout_needs_no_key_but_a_valid_payload(client, merchant):
    intent = create(client, merchant)
    body = {"payment_signature": {"scheme": "exact", "network": "eip155:84532", "x402Version": 1,
                                  "payload": {"from": "0x0"}}}  # fmt: skip
    assert client.post(f"{CHECKOUT}/{uuid.uuid4()}/pay", json=body).status_code == 404
    malformed = client.post(f"{CHECKOUT}/{intent['intent_id']}/pay", json={"payment_signature": {"scheme": "exact"}})
    assert malformed.status_code == 400 and malformed.get_json()["error"]["code"] == "VALIDATION_ERROR"
    # (A well-formed payment needs the settlement queue: tests/settlement/test_pay_checkout.py pays for real.)
    assert client.post(f"{CHECKOUT}/{intent['intent_id']}/pay", json=body).status_code != 401


def test_a_balance_for_a_malformed_address_is_400_before_any_chain_is_asked(client, merchant):
    # Found by tests/test_fuzz_api.py: an EVM address with a trailing newline answered 500.
    intent = create(client, merchant)
    for address in ("0x70997970C51812dc3A010C7d01b50e0d17dc79C8\n", "0x1234567890123456789012345678901234567890 "):
        query = {"network": "eip155:84532", "address": address}
        response = client.get(f"{CHECKOUT}/{intent['intent_id']}/balance", query_string=query)
        assert response.status_code == 400, response.data
        assert response.get_json()["error"]["code"] == "VALIDATION_ERROR"


def test_the_buyers_view_says_how_a_wallet_reaches_each_network(client, merchant, spec, chains):  # noqa: F811
    intent = create(client, merchant)
    response = client.get(f"{CHECKOUT}/{intent['intent_id']}")
    check(spec, f"{CHECKOUT}/{{intent_id}}", "get", response)
    data = response.get_json()["data"]
    assert [n["network"] for n in data["networks"]] == [r["network"] for r in data["payment_requirements"]]
    for entry in data["networks"]:
        network = chains.get(entry["network"])
        assert entry["name"] == network.name and entry["kind"] == network.kind
        if network.kind == "evm":
            assert entry["chain_id"] == network.chain_id and entry["wallet_rpc_url"].startswith("https://")
            assert entry["native_currency"]["decimals"] == 18
        else:
            assert entry["chain_id"] is None and entry["wallet_chain"] == "solana:devnet"
    assert abs(datetime.fromisoformat(data["server_time"].replace("Z", "+00:00")) - clock.now()) < timedelta(seconds=5)
