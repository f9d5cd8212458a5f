"""Standard x402 clients buy from our paywall unchanged: PyPI ``x402``'s requests wrapper and npm
``@x402/fetch`` (both read the v2 ``PAYMENT-REQUIRED`` header and answer ``PAYMENT-SIGNATURE``), and
a v1 client that reads the JSON body and answers ``X-PAYMENT``. Money moves once, on chain, and the
facilitator records the merchant's paid intent."""

from __future__ import annotations

import json
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

import requests
from x402 import x402ClientSync
from x402.http.clients.requests import wrapRequestsWithPayment
from x402.http.utils import encode_payment_signature_header
from x402.mechanisms.evm.exact import register_exact_evm_client
from x402.schemas.v1 import PaymentRequiredV1

from payintent import x402
from tests.payintent.test_paywall import (  # noqa: F401
    ATOMIC,
    funded_account,
    merchant_client,
    paid_intent,
    payout,
    shop_url,
)

REPO = Path(__file__).resolve().parents[2]
FETCH_MJS = Path(__file__).with_name("x402_fetch.mjs")
DEVNET_ASSET_NETWORKS = ("eip155:84532", "eip155:11155111", "eip155:5042002", "base-sepolia", "sepolia")


def library_client(account: Any, devnet: Any) -> x402ClientSync:
    """The library's client as an agent configures it: its default spend controls know only
    Circle's USDC, so the devnet's token is allowed explicitly (no change to the library)."""
    client = x402ClientSync()
    register_exact_evm_client(client, account)
    asset = next(iter(devnet.info["networks"].values()))["usdc_address"]
    client.set_spend_controls({"allowed_assets": [{"network": n, "asset": asset} for n in DEVNET_ASSET_NETWORKS]})
    return client


def test_the_pypi_x402_requests_wrapper_buys_from_the_paywall(shop_url, merchant_client, devnet, shop):  # noqa: F811
    buyer = funded_account(devnet, "eip155:84532")
    before = payout(devnet, shop)
    session = wrapRequestsWithPayment(requests.Session(), library_client(buyer, devnet))
    response = session.get(f"{shop_url}/report", timeout=60)
    assert response.status_code == 200 and response.json() == {"report": "paid content"}
    receipt = x402.decode_header(response.headers["PAYMENT-RESPONSE"])
    assert receipt["success"] is True and receipt["payer"] == buyer.address
    intent = paid_intent(merchant_client, receipt["transaction"])
    assert intent["amount_usdc"] == Decimal("0.25") and intent["metadata"]["x402_resource"] == f"{shop_url}/report"
    after = payout(devnet, shop)
    assert sum(after.values()) - sum(before.values()) == ATOMIC
    assert after[receipt["network"]] - before[receipt["network"]] == ATOMIC


def test_a_v1_client_pays_with_x_payment_and_gets_a_receipt_and_a_token(shop_url, merchant_client, devnet, shop):  # noqa: F811
    buyer = funded_account(devnet, "eip155:84532")
    challenge = requests.get(f"{shop_url}/report", timeout=10)
    body = challenge.json()
    v1 = {
        "x402Version": 1,
        "error": body["error"],
        "accepts": [a for a in body["accepts"] if a["network"] == "base-sepolia"],
    }
    payment = library_client(buyer, devnet).create_payment_payload(PaymentRequiredV1.model_validate(v1))
    header = {"X-PAYMENT": encode_payment_signature_header(payment)}  # as a v1 client sends it
    before = payout(devnet, shop)
    response = requests.get(f"{shop_url}/report", headers=header, timeout=60)
    assert response.status_code == 200, response.text
    receipt = x402.decode_header(response.headers["X-PAYMENT-RESPONSE"])
    assert receipt["network"] == "eip155:84532" and receipt["payer"] == buyer.address
    sold = paid_intent(merchant_client, receipt["transaction"])
    assert sold["chain"] == "eip155:84532" and sold["buyer_address"].lower() == buyer.address.lower()
    assert response.headers["X-Payment-Access"]
    assert sum(payout(devnet, shop).values()) - sum(before.values()) == ATOMIC


def test_the_npm_x402_fetch_wrapper_buys_from_the_paywall(shop_url, merchant_client, devnet, shop):  # noqa: F811
    buyer = funded_account(devnet, "eip155:84532")  # the wrapper pays the first entry it can sign: no balance check
    asset = next(iter(devnet.info["networks"].values()))["usdc_address"]
    request = {
        "url": f"{shop_url}/report",
        "privateKey": buyer.key.to_0x_hex(),
        "allowedAssets": [{"network": n, "asset": asset} for n in DEVNET_ASSET_NETWORKS],
    }
    before = payout(devnet, shop)
    ran = subprocess.run(
        ["node", str(FETCH_MJS)], input=json.dumps(request), capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["status"] == 200, result
    assert json.loads(result["body"]) == {"report": "paid content"}
    receipt = result["paymentResponse"]
    assert receipt["success"] is True and receipt["payer"] == buyer.address
    assert paid_intent(merchant_client, receipt["transaction"])["amount_usdc"] == Decimal("0.25")
    after = payout(devnet, shop)
    assert sum(after.values()) - sum(before.values()) == ATOMIC
