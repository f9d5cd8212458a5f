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
