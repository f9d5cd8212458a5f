"""What a paywall's token is for (second review of the paywall: High H1, Low L1, L2), against the real API,
the devnet and a relayer; balances read on chain.

- H1: the middleware keyed tokens on a URL rebuilt from the raw Host header, so ``GET /cheap`` with
  ``Host: x/y#`` bought a token serving every route. Keys now come from the method, the configured
  route and the query, never from the host.
- L1: a token names the paywall (``name``/``origin``) and the price.
- L2: HEAD and other spellings of a route (``/report/``, ``//report``) are charged like the route.
"""

from __future__ import annotations

import http.client
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import requests
from flask import Flask, jsonify

from payintent import x402
from payintent.client import PayIntentClient
from payintent.paywall import Paywall, PaywallMiddleware
from tests.payintent.conftest import serve
from tests.payintent.test_paywall import (  # noqa: F401  (fixtures)
    ATOMIC,
    PRICE,
    agent_for,
    funded_account,
    merchant_client,
    payout,
    recording,
    rpc_urls,
    shop_url,
)
from tests.payintent.test_paywall_access import SEPOLIA, challenge_of, evm_payment, send

PREMIUM_ATOMIC = "1000000"


def secret_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [f"SECRET of {environ['PATH_INFO']}?{environ.get('QUERY_STRING', '')}".encode()]


def raw(
    base: str, method: str, target: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A request with exactly this target and Host (requests would normalise them)."""
    port = urlsplit(base).port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    sent = {"Host": f"127.0.0.1:{port}", **(headers or {})}
    connection.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
    for name, value in sent.items():
        connection.putheader(name, value)
    connection.endheaders()
    answer = connection.getresponse()
    body = answer.read()
    connection.close()
    return answer.status, dict(answer.getheaders()), body


def price_of(headers: dict[str, str]) -> set[str]:
    return {a["maxAmountRequired"] for a in x402.decode_header(headers["X-Payment-Required"])["accepts"]}


def test_the_host_header_names_no_resource(merchant_client, devnet, shop):  # noqa: F811
    app = PaywallMiddleware(secret_app, Paywall(merchant_client), {"GET /cheap": PRICE, "GET /premium": "1"})
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    hosts = ("x#", "x/y#", "x?", "shop.example/premium?id=42#")
    before, intents_before = payout(devnet, shop), merchant_client.list_intents(limit=1)["total"]
    for base in serve(app):
        for host in hosts:
            status, headers, _ = raw(base, "GET", "/cheap", {"Host": host})
            assert status == 402 and price_of(headers) == {str(ATOMIC)}, host
            ours = x402.decode_header(headers["X-Payment-Required"])
            payment = x402.encode_header(evm_payment(buyer, ours))
            status, headers, body = raw(base, "GET", "/cheap", {"Host": host, "X-Payment": payment})
            assert status == 200 and body == b"SECRET of /cheap?", (host, body)
            token = headers["X-Payment-Access"]
            for target in ("/premium", "/premium?id=42", "/premium?id=1"):
                for asked in (host, "shop.example"):
                    status, headers, body = raw(base, "GET", target, {"Host": asked, "X-Payment-Access": token})
                    assert status == 402 and b"SECRET" not in body, (host, target, asked, body)
                    assert price_of(headers) == {PREMIUM_ATOMIC}  # the premium route's own price
            status, _, body = raw(base, "GET", "/cheap", {"Host": "shop.example", "X-Payment-Access": token})
            assert status == 200 and body == b"SECRET of /cheap?"  # what was bought, under any Host
        for i in range(20):  # Hosts make no intents either: none without a payment
            status, headers, _ = raw(base, "GET", "/premium", {"Host": f"h/{i}#"})
            assert status == 402 and price_of(headers) == {PREMIUM_ATOMIC}
    after = payout(devnet, shop)
    assert after[SEPOLIA] - before[SEPOLIA] == len(hosts) * ATOMIC  # only what was paid for, no premium sale
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - len(hosts) * ATOMIC
    created = merchant_client.list_intents(limit=1)["total"] - intents_before
    assert created == len(hosts), created  # one per sale of /cheap, recorded when paid


def test_the_middleware_charges_every_spelling_of_its_route(merchant_client, devnet, shop):  # noqa: F811
    inner = Flask(f"inner-{uuid.uuid4().hex[:6]}")
    inner.url_map.strict_slashes = False  # the app serves /report/ as /report

    @inner.get("/report")
    def report() -> Any:
        return jsonify(report="paid content"), 200, {"X-Rows": "1234"}

    app = PaywallMiddleware(inner.wsgi_app, Paywall(merchant_client), {"GET /report": PRICE})
    spellings = [("GET", "/report"), ("HEAD", "/report"), ("GET", "/report/"), ("HEAD", "/report/"),
                 ("GET", "//report"), ("GET", "/./report"), ("GET", "/x/../report")]  # fmt: skip
    before = payout(devnet, shop)
    for base in serve(app):
        for method, target in spellings:
            status, headers, _ = raw(base, method, target)
            assert status == 402 and "X-Rows" not in headers, (method, target)
        paid = agent_for(funded_account(devnet), devnet, rpc_urls=rpc_urls(devnet)).get(f"{base}/report")
        assert paid.status_code == 200 and paid.json() == {"report": "paid content"}
        token = paid.headers["X-Payment-Access"]
        for method, target in spellings[:4]:  # one resource: its token serves it however it is spelled
            status, headers, _ = raw(base, method, target, {"X-Payment-Access": token})
            assert status == 200 and headers["X-Rows"] == "1234", (method, target)
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC


def shop_with(paywall: Paywall, price: str) -> Flask:
    app = Flask(f"service-{uuid.uuid4().hex[:6]}")

    @app.get("/article")
    @paywall.require(price)
    def article() -> Any:
        return jsonify(article=f"the {price} USDC article")

    return app


def test_a_token_names_its_paywall_and_its_price(api_url, shop, devnet):
    client = PayIntentClient(api_url, shop.api_key)  # one merchant key, several services (one shared secret)
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    before = payout(devnet, shop)
    blog, dearer = shop_with(Paywall(client), PRICE), shop_with(Paywall(client), "1")  # no name: same secret
    for blog_url in serve(blog):
        paid = send(f"{blog_url}/article", evm_payment(buyer, challenge_of(f"{blog_url}/article")))
        assert paid.status_code == 200
        token = paid.headers["X-Payment-Access"]
        for dearer_url in serve(dearer):
            refused = requests.get(f"{dearer_url}/article", headers={"X-Payment-Access": token}, timeout=30)
            assert refused.status_code == 402 and "another price" in refused.json()["error"]
    named = shop_with(Paywall(client, name="blog"), PRICE)
    other = shop_with(Paywall(client, origin="https://pro.example"), PRICE)  # the name defaults to the origin
    for named_url in serve(named):
        paid = send(f"{named_url}/article", evm_payment(buyer, challenge_of(f"{named_url}/article")))
        token = paid.headers["X-Payment-Access"]
        for other_url in serve(other):
            refused = requests.get(f"{other_url}/article", headers={"X-Payment-Access": token}, timeout=30)
            assert refused.status_code == 402 and "another paywall" in refused.json()["error"]
            offer = requests.get(f"{other_url}/article", timeout=30).json()
            assert {a["resource"] for a in offer["accepts"]} == {"https://pro.example/article"}
        assert requests.get(f"{named_url}/article", headers={"X-Payment-Access": token}, timeout=30).ok
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == 2 * ATOMIC


def test_check_takes_no_url(merchant_client):  # noqa: F811
    paywall = Paywall(merchant_client)
    answer = paywall.check("GET", "/report", "", {}, PRICE, client="203.0.113.9")
    assert answer.status == 402 and answer.body and answer.body["accepts"][0]["resource"] == "/report"
    assert not paywall.check("GET", "/report", "a=1", {"X-Payment-Access": "pa1.x.y"}, PRICE).paid
