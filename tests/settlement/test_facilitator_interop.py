"""The official PyPI ``x402`` packages on both sides of our facilitator API, on the devnet, unchanged.

A resource server: a Flask app with the library's ``PaymentMiddleware``, its ``x402ResourceServerSync`` and
``HTTPFacilitatorClientSync`` pointed at ``/api/v1/x402/facilitator`` with the merchant's API key as a header
(``create_headers``). A buyer: the library's ``x402ClientSync`` with ``register_exact_evm_client``, paying through
its ``requests`` adapter. Both over real HTTP (werkzeug); the facilitator is the settlement tests' app and relayer.
On chain the merchant's balance rises by exactly the price; in our API the payment is a paid intent.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
import requests
from flask import Flask, jsonify
from x402 import x402ClientSync
from x402.http import HTTPFacilitatorClientSync
from x402.http.clients import wrapRequestsWithPayment
from x402.http.middleware.flask import PaymentMiddleware
from x402.http.types import PaymentOption, RouteConfig
from x402.mechanisms.evm.exact import register_exact_evm_client, register_exact_evm_server
from x402.server import x402ResourceServerSync

from tests.payintent.conftest import serve

NETWORK = "eip155:84532"
PRICE = 10_000  # 0.01 USDC


@pytest.fixture
def facilitator_url(pay_app: Any) -> Iterator[str]:
    """Our API (the settlement tests' app, relayer and devnet) over real HTTP: the facilitator's base URL."""
    for base in serve(pay_app):
        yield f"{base}/api/v1/x402/facilitator"


def resource_server(facilitator_url: str, api_key: str, devnet: Any, pay_to: str, served: list[str]) -> Flask:
    """A merchant's own Flask app selling ``GET /weather`` through the library's middleware and our facilitator."""
    chain = devnet.chains.get(NETWORK)
    auth = {"Authorization": f"Bearer {api_key}"}
    facilitator = HTTPFacilitatorClientSync(
        {"url": facilitator_url, "create_headers": lambda: {"verify": auth, "settle": auth, "supported": auth}}
    )
    server = register_exact_evm_server(x402ResourceServerSync(facilitator), NETWORK)
    price = {"amount": str(PRICE), "asset": chain.usdc_address,
             "extra": {"name": chain.usdc_domain_name, "version": chain.usdc_domain_version}}  # fmt: skip
    routes = {
        "GET /weather": RouteConfig(
            accepts=PaymentOption(scheme="exact", pay_to=pay_to, price=price, network=NETWORK),
            description="The weather, now",
            mime_type="application/json",
        )
    }
    app = Flask("weather-shop")

    @app.get("/weather")
    def weather() -> Any:
        served.append("weather")
        return jsonify({"forecast": "sunny"})

    PaymentMiddleware(app, routes, server)  # asks our /supported now (sync_facilitator_on_start)
    return app


def buyer_session(account: Any, asset: str) -> requests.Session:
    client = x402ClientSync()
    register_exact_evm_client(client, account)
    # Its default spend controls allow only the assets it knows (Circle's USDC): opt in to the devnet's.
    client.set_spend_controls({"allowed_assets": [{"network": NETWORK, "asset": asset}]})
    return wrapRequestsWithPayment(requests.Session(), client)


def test_the_official_flask_middleware_sells_through_our_facilitator_to_the_official_client(
    pay_client, shop, devnet, facilitator_url
):
    served: list[str] = []
    shop_app = resource_server(facilitator_url, shop.api_key, devnet, shop.payout, served)
    buyer = devnet.buyer(0)
    before = devnet.balance(NETWORK, buyer.address)
    for base in serve(shop_app):
        unpaid = requests.get(f"{base}/weather", timeout=30)
        assert unpaid.status_code == 402 and served == []  # the requirement, and nothing served
        session = buyer_session(buyer, devnet.chains.get(NETWORK).usdc_address)
        paid = session.get(f"{base}/weather", timeout=60)
        assert paid.status_code == 200, paid.text
        assert paid.json() == {"forecast": "sunny"} and served == ["weather"]
        header = paid.headers.get("PAYMENT-RESPONSE") or paid.headers.get("X-PAYMENT-RESPONSE")
        assert header, dict(paid.headers)
        settled = json.loads(base64.b64decode(header))
    assert settled["success"] is True and settled["network"] == NETWORK
    assert devnet.w3(NETWORK).eth.get_transaction_receipt(settled["transaction"])["status"] == 1
    # On chain: exactly the price moved, from the buyer to the merchant.
    assert devnet.balance(NETWORK, shop.payout) == PRICE
    assert before - devnet.balance(NETWORK, buyer.address) == PRICE
    # In our API: the merchant's paid intent, with the resource.
    listed = pay_client.get("/api/v1/x402/intents?status=paid", headers=shop.headers).get_json()["data"]["intents"]
    (intent,) = listed
    assert intent["tx_hash"] == settled["transaction"] and intent["buyer_address"] == buyer.address
    assert intent["amount_usdc"] == Decimal("0.01") and intent["chain"] == NETWORK
    assert intent["metadata"]["x402_resource"].endswith("/weather")
