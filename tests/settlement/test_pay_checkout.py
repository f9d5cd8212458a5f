"""Paying through the public checkout API moves money like /api/v1/x402/pay (the same settlement code)."""

from __future__ import annotations

from payintent.eip3009 import sign_authorization
from tests.settlement.test_pay import create_intent, requirement


def test_checkout_pay_settles_on_chain_without_a_key(pay_client, shop, devnet):
    network = "eip155:11155111"
    intent = create_intent(pay_client, shop, 1.75)
    payload = sign_authorization(devnet.buyer(0).key, requirement(intent, network))
    body = {"payment_signature": {"scheme": "exact", "network": network, "x402Version": 1, "payload": payload}}
    response = pay_client.post(f"/api/v1/checkout/intents/{intent['intent_id']}/pay", json=body)
    assert response.status_code == 200, response.data
    assert devnet.balance(network, shop.payout) == 1_750_000
    view = pay_client.get(f"/api/v1/checkout/intents/{intent['intent_id']}").get_json()["data"]
    assert view["status"] == "paid" and view["tx_hash"] == response.get_json()["data"]["tx_hash"]
    again = pay_client.post(f"/api/v1/checkout/intents/{intent['intent_id']}/pay", json=body)
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "ALREADY_PAID"


def test_the_checkout_reads_the_buyers_balance_from_the_chain(pay_client, shop, devnet):
    from eth_account import Account

    intent = create_intent(pay_client, shop, 2)
    url = f"/api/v1/checkout/intents/{intent['intent_id']}/balance"
    buyer = devnet.buyer(1).address
    for network in devnet.networks:
        response = pay_client.get(url, query_string={"network": network, "address": buyer.lower()})
        assert response.status_code == 200, response.data
        data = response.get_json()["data"]
        assert data["address"] == buyer  # checksummed
        assert int(data["balance_atomic"]) == devnet.balance(network, buyer) > 0
        assert data["required_atomic"] == "2000000"
    empty = pay_client.get(url, query_string={"network": devnet.networks[0], "address": Account.create().address})
    assert empty.get_json()["data"]["balance_atomic"] == "0"

    sol_buyer = devnet.info["solana_buyers"][0]["address"]
    for query, code in (
        ({"network": "eip155:1", "address": buyer}, "UNSUPPORTED_NETWORK"),
        ({"network": devnet.networks[0], "address": sol_buyer}, "VALIDATION_ERROR"),
        ({"network": devnet.networks[0]}, "VALIDATION_ERROR"),
    ):
        refused = pay_client.get(url, query_string=query)
        assert refused.status_code == 400 and refused.get_json()["error"]["code"] == code, (query, refused.data)
