"""The official x402 packages on both sides of our facilitator API, on the devnet, unchanged.

Resource servers: PyPI ``x402``'s Flask ``PaymentMiddleware`` (its ``x402ResourceServerSync`` and
``HTTPFacilitatorClientSync`` pointed at ``/api/v1/x402/facilitator`` with the merchant's API key as a header,
``create_headers``), and npm ``@x402/express`` with ``@x402/core``'s ``HTTPFacilitatorClient``
(``createAuthHeaders``; ``x402_express_shop.mjs``). Buyers: PyPI ``x402ClientSync`` paying through its ``requests``
adapter, and npm ``@x402/fetch`` (``x402_fetch_buy.mjs``). Every pair, over real HTTP; the facilitator is the
settlement tests' app and relayer. On chain the merchant's balance rises by exactly the price; in our API the
payment is a paid intent.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
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
EXPRESS_SHOP = Path(__file__).with_name("x402_express_shop.mjs")
FETCH_BUY = Path(__file__).with_name("x402_fetch_buy.mjs")
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


@contextlib.contextmanager
def shop_served(kind: str, facilitator_url: str, shop: Any, devnet: Any) -> Iterator[tuple[str, Callable[[], int]]]:
    """The merchant's resource server (the library's middleware, our facilitator) over HTTP: (its base URL, how many
    times it served the paid route)."""
    if kind == "pypi-flask":
        served: list[str] = []
        app = resource_server(facilitator_url, shop.api_key, devnet, shop.payout, served)
        for base in serve(app):
            yield base, lambda: len(served)
        return
    chain = devnet.chains.get(NETWORK)
    config = {"facilitatorUrl": facilitator_url, "apiKey": shop.api_key, "network": NETWORK, "payTo": shop.payout,
              "amount": str(PRICE), "asset": chain.usdc_address,
              "extra": {"name": chain.usdc_domain_name, "version": chain.usdc_domain_version}}  # fmt: skip
    proc = subprocess.Popen(["node", str(EXPRESS_SHOP)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(config))
        proc.stdin.close()
        first = proc.stdout.readline()  # it asked our /supported at its start, then listens
        assert first.startswith("listening "), first
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        yield f"http://127.0.0.1:{int(first.split()[1])}", lambda: sum(line == "served /weather\n" for line in lines)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def buy(kind: str, url: str, account: Any, asset: str) -> tuple[int, Any, dict[str, Any] | None]:
    """GET ``url`` paying its 402 with the library's client: (status, JSON body, the decoded PAYMENT-RESPONSE)."""
    if kind == "pypi":
        paid = buyer_session(account, asset).get(url, timeout=60)
        header = paid.headers.get("PAYMENT-RESPONSE") or paid.headers.get("X-PAYMENT-RESPONSE")
        body = paid.json() if paid.status_code == 200 else paid.text
        return paid.status_code, body, json.loads(base64.b64decode(header)) if header else None
    request = {"url": url, "privateKey": account.key.to_0x_hex(), "network": NETWORK, "asset": asset}
    done = subprocess.run(["node", str(FETCH_BUY)], input=json.dumps(request), capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    body = json.loads(answer["body"]) if answer["status"] == 200 else answer["body"]
    return answer["status"], body, answer["paymentResponse"]


@pytest.mark.parametrize("buyer_kind", ["pypi", "npm"])
@pytest.mark.parametrize("shop_kind", ["pypi-flask", "npm-express"])
def test_the_official_middlewares_sell_through_our_facilitator_to_the_official_clients(
    pay_client, shop, devnet, facilitator_url, shop_kind, buyer_kind
):
    buyer = devnet.buyer(0)
    asset = devnet.chains.get(NETWORK).usdc_address
    before = devnet.balance(NETWORK, buyer.address)
    with shop_served(shop_kind, facilitator_url, shop, devnet) as (base, served):
        unpaid = requests.get(f"{base}/weather", timeout=30)
        assert unpaid.status_code == 402 and served() == 0  # the requirement, and nothing served
        status, body, settled = buy(buyer_kind, f"{base}/weather", buyer, asset)
        assert status == 200, body
        assert body == {"forecast": "sunny"} and served() == 1
    assert settled is not None and settled["success"] is True and settled["network"] == NETWORK, settled
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
