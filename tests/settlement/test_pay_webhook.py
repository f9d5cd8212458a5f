"""Paying on the devnet delivers a signed payment.completed to the merchant's receiver within a second."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import time

from harness.ready import wait_registered
from payintent.eip3009 import sign_authorization
from payintent.webhooks import verify_signature, verify_standard
from tests.settlement.conftest import PAYINTENT, stop_process
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.webhooks.receiver import start_receiver


def test_payment_completed_reaches_the_receiver_signed_within_a_second(pay_client, shop, devnet, db_url,
                                                                       redis_server_url):  # fmt: skip
    receiver = start_receiver()
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": redis_server_url, "LOG_LEVEL": "WARNING",
           "CHAINS_FILE": devnet.info["chains_file"], "WEBHOOK_ALLOW_PRIVATE_TARGETS": "1"}  # fmt: skip
    worker = subprocess.Popen([PAYINTENT, "worker"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        hook = pay_client.post(
            "/api/v1/webhooks", json={"url": receiver.url("/orders"), "events": ["payment.completed"]},
            headers=shop.headers,
        ).get_json()["data"]  # fmt: skip
        network = "eip155:84532"
        intent = create_intent(pay_client, shop, 2.25)
        payload = sign_authorization(devnet.buyer(2).key, requirement(intent, network))
        wait_registered(worker, redis_server_url)  # the worker is up and listening (not a fixed sleep)
        response = pay(pay_client, shop, intent, network, payload)
        paid_at = time.monotonic()
        assert response.status_code == 200, response.data
        (got,) = receiver.wait_for(1, timeout=5)
        latency = got.at - paid_at
        assert latency < 1.0, f"payment.completed arrived {latency:.3f} s after /pay answered"
    finally:
        stop_process(worker)
        receiver.close()
    verify_signature(got.body, got.headers["Service-Signature"], hook["secret"])
    assert got.headers["Service-Signature"] == "sha256=" + hmac.new(
        hook["secret"].encode(), got.body, hashlib.sha256).hexdigest()  # fmt: skip
    verify_standard(got.body, got.headers, hook["secret"])
    envelope = json.loads(got.body)
    data = response.get_json()["data"]
    assert envelope["event"] == "payment.completed"
    assert envelope["data"] == {
        "intent_id": intent["intent_id"], "status": "paid", "amount_usdc": 2.25, "order_id": "o-1",
        "tx_hash": data["tx_hash"], "buyer_address": devnet.buyer(2).address, "chain": network,
        "paid_at": data["settled_at"],
    }  # fmt: skip
