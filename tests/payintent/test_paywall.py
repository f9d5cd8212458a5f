"""The x402 paywall (Flask decorator, WSGI middleware) and the paying agent, against the real API
over HTTP, the devnet and a relayer: money moves once, only for the resource, within the caps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from functools import partial
from typing import Any

import pytest
import requests
from eth_account import Account
from flask import Flask, jsonify

from payintent import x402
from payintent.agent import PayingAgent, PaymentRequiredError, SpendLimitError
from payintent.client import PayIntentClient
from payintent.eip3009 import sign_authorization
from payintent.paywall import Paywall, PaywallMiddleware
from tests.payintent.conftest import serve
from tests.payintent.test_client import mint

PRICE = "0.25"
ATOMIC = 250_000


@pytest.fixture
def merchant_client(api_url: str, shop: Any) -> PayIntentClient:
    return PayIntentClient(api_url, shop.api_key)


@pytest.fixture
def shop_url(merchant_client: PayIntentClient) -> Iterator[str]:
    """A resource server: /report costs PRICE, /premium costs 1, / is free (Flask decorator)."""
    app = Flask("shop")
    paywall = Paywall(merchant_client)

    @app.get("/")
    def index() -> Any:
        return jsonify({"free": True})

    @app.get("/report")
    @paywall.require(PRICE, description="A report")
    def report() -> Any:
        return jsonify({"report": "paid content"})

    @app.get("/premium")
    @paywall.require("1")
    def premium() -> Any:
        return jsonify({"premium": "paid content"})

    yield from serve(app)


def rpc_urls(devnet: Any) -> dict[str, str]:
    return {network: chain["rpc_url"] for network, chain in devnet.info["networks"].items()}


def devnet_usdc(devnet: Any) -> dict[str, str]:
    """The devnet's TestUSDC, which agents pay only when told to (it is not Circle's USDC)."""
    return {network: chain["usdc_address"] for network, chain in devnet.info["networks"].items()}


def agent_for(buyer: Any, devnet: Any, **options: Any) -> PayingAgent:
    return PayingAgent(buyer, allowed_assets=devnet_usdc(devnet), **options)


def funded_account(devnet: Any, network: str = "eip155:11155111", atomic: int = 5_000_000) -> Any:
    """A fresh buyer holding USDC on one chain only (so the agent must choose that one)."""
    account = Account.create()
    mint(devnet, network, account.address, atomic)
    return account


def payout(devnet: Any, shop: Any) -> dict[str, int]:
    return {network: devnet.balance(network, shop.payout) for network in devnet.networks}


def recording(session: requests.Session) -> list[requests.PreparedRequest]:
    sent: list[requests.PreparedRequest] = []
    original: Callable[..., Any] = session.send

    def send(request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        sent.append(request)
        return original(request, **kwargs)

    session.send = send  # type: ignore[method-assign]
    return sent


def signed_v1(url: str, buyer: Any) -> dict[str, str]:
    """An x402 v1 payment header (no payment-identifier, as a plain client sends it) for the 402 of ``url``, signed
    by ``buyer`` on Ethereum Sepolia."""
    ours = x402.decode_header(requests.get(url, timeout=10).headers["X-Payment-Required"])
    requirement = next(r for r in ours["accepts"] if r["network"] == "eip155:11155111")
    payment = {"x402Version": 1, "scheme": "exact", "network": requirement["network"],
               "payload": sign_authorization(buyer, requirement)}  # fmt: skip
    return {"X-Payment": x402.encode_header(payment)}


def intent_count(client: PayIntentClient) -> int:
    return int(client.list_intents(limit=1)["total"])


def paid_intent(client: PayIntentClient, transaction: str) -> dict[str, Any]:
    """The merchant's paid intent the facilitator recorded for ``transaction``."""
    found = [i for i in client.list_intents(status="paid", limit=100)["intents"] if i["tx_hash"] == transaction]
    assert len(found) == 1, found
    return found[0]


def test_a_request_without_payment_gets_402_in_every_shape_and_makes_no_intent(shop_url, merchant_client, shop):
    assert requests.get(f"{shop_url}/", timeout=10).status_code == 200  # free routes are untouched
    before = intent_count(merchant_client)
    response = requests.get(f"{shop_url}/report?day=monday", timeout=10)
    assert response.status_code == 402 and response.headers["Cache-Control"] == "no-store"
    for _ in range(20):  # anonymous requests cost no intent, no row, no API call
        assert requests.get(f"{shop_url}/report?day={_}", timeout=10).status_code == 402
    assert intent_count(merchant_client) == before
    ours = x402.decode_header(response.headers["X-Payment-Required"])
    assert "intent_id" not in ours
    networks = [r["network"] for r in ours["accepts"]]
    assert networks and all(n.startswith("eip155:") for n in networks)  # the facilitator's networks: EVM
    for requirement in ours["accepts"]:
        assert requirement["payTo"] == shop.payout and requirement["maxAmountRequired"] == str(ATOMIC)
        assert requirement["resource"] == f"{shop_url}/report?day=monday" and requirement["extra"]["name"]
    body = response.json()
    assert body["x402Version"] == 1 and body["payment_requirements"] == ours["accepts"]
    assert [a["network"] for a in body["accepts"]][:2] == ["base-sepolia", "sepolia"]  # the names v1 clients know
    v2 = x402.decode_header(response.headers["PAYMENT-REQUIRED"])
    assert v2["x402Version"] == 2 and v2["resource"]["url"] == f"{shop_url}/report?day=monday"
    assert [a["network"] for a in v2["accepts"]] == networks
    assert {a["amount"] for a in v2["accepts"]} == {str(ATOMIC)}
    assert all("intentId" not in a["extra"] for a in v2["accepts"])


def test_an_agent_pays_on_the_chain_holding_its_usdc_and_gets_the_resource(shop_url, merchant_client, devnet, shop):
    buyer = funded_account(devnet, "eip155:11155111")
    before = payout(devnet, shop)
    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), max_per_call="1", max_per_session="1")
    response = agent.get(f"{shop_url}/report")
    assert response.status_code == 200 and response.json() == {"report": "paid content"}
    receipt = response.payment
    assert receipt["success"] is True and receipt["network"] == "eip155:11155111" and receipt["payer"] == buyer.address
    assert receipt == x402.decode_header(response.headers["PAYMENT-RESPONSE"])
    paid = paid_intent(merchant_client, receipt["transaction"])  # recorded when paid, by the facilitator
    assert paid["amount_usdc"] == Decimal(PRICE) and paid["buyer_address"].lower() == buyer.address.lower()
    assert paid["metadata"]["x402_resource"] == f"{shop_url}/report" and paid["description"] == "A report"
    after = payout(devnet, shop)
    assert {n: after[n] - before[n] for n in after} == {n: ATOMIC if n == "eip155:11155111" else 0 for n in after}
    assert devnet.balance("eip155:11155111", buyer.address) == 5_000_000 - ATOMIC
    assert agent.spent_usdc == Decimal(PRICE)


def test_a_view_that_fails_is_not_paid_for(merchant_client, devnet, shop):
    app = Flask("failing")
    paywall = Paywall(merchant_client)
    served: list[str] = []

    @app.get("/broken")
    @paywall.require(PRICE)
    def broken() -> Any:
        served.append("broken")
        return jsonify({"error": "the report is not ready"}), 500

    for base in serve(app):
        buyer = funded_account(devnet)
        header = signed_v1(f"{base}/broken", buyer)
        before = payout(devnet, shop)
        response = requests.get(f"{base}/broken", headers=header, timeout=60)
        assert response.status_code == 500 and served == ["broken"]  # verified, served, and not settled
        assert "PAYMENT-RESPONSE" not in response.headers and "X-Payment-Access" not in response.headers
        assert payout(devnet, shop) == before and devnet.balance("eip155:11155111", buyer.address) == 5_000_000


def test_the_access_token_serves_again_and_a_copy_of_the_payment_does_not(shop_url, devnet, shop):
    buyer = funded_account(devnet)
    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet))
    sent = recording(agent.session)
    first = agent.get(f"{shop_url}/report")
    assert first.status_code == 200 and first.headers["X-Payment-Access"]
    header, token = sent[-1].headers["X-Payment"], first.headers["X-Payment-Access"]
    before = payout(devnet, shop)
    # The token its answer carried serves again, nothing charged.
    again = requests.get(f"{shop_url}/report", headers={"X-Payment-Access": token}, timeout=30)
    assert again.status_code == 200 and again.json() == {"report": "paid content"}
    assert agent.get(f"{shop_url}/report").status_code == 200  # the agent presents its token by itself
    assert sent[-1].headers["X-Payment-Access"] == token and "X-Payment" not in sent[-1].headers
    # The buyer's own retry (its payment-identifier, known only to it and the paywall) gets the first result.
    retry = requests.get(f"{shop_url}/report", headers={"X-Payment": header}, timeout=30)
    assert retry.status_code == 200 and x402.decode_header(retry.headers["PAYMENT-RESPONSE"]) == first.payment
    # The same header at another resource of the same price buys nothing: its id is this resource's retry only.
    other = requests.get(f"{shop_url}/report?day=2", headers={"X-Payment": header}, timeout=30)
    assert other.status_code == 402 and "PAYMENT-RESPONSE" not in other.headers
    # The payment as anyone can rebuild it from the chain (no payment-identifier) buys nothing.
    copied = {k: v for k, v in x402.decode_header(header).items() if k != "extensions"}
    replay = requests.get(f"{shop_url}/report", headers={"X-Payment": x402.encode_header(copied)}, timeout=30)
    assert replay.status_code == 402 and "not proof" in replay.json()["error"]
    # Another payment-identifier with the same authorization buys nothing either.
    other = {**copied, "extensions": {"payment-identifier": {"info": {"id": "someone-else-0123456789"}}}}
    stolen = requests.get(f"{shop_url}/report", headers={"X-Payment": x402.encode_header(other)}, timeout=30)
    assert stolen.status_code == 402
    elsewhere = requests.get(f"{shop_url}/premium", headers={"X-Payment": header}, timeout=30)
    assert elsewhere.status_code == 402 and "value must be 1000000" in elsewhere.json()["error"]  # /premium's price
    assert requests.get(f"{shop_url}/premium", headers={"X-Payment-Access": token}, timeout=30).status_code == 402
    assert payout(devnet, shop) == before and agent.spent_usdc == Decimal(PRICE)


def test_one_payment_sent_twice_at_once_is_served_once_and_charged_once(merchant_client, devnet, shop):
    app = Flask("racing")
    paywall = Paywall(merchant_client, settle_wait_seconds=5)

    @app.get("/report")
    @paywall.require(PRICE)
    def report() -> Any:
        return jsonify({"report": "paid content"})

    for base in serve(app):
        header = signed_v1(f"{base}/report", funded_account(devnet))  # no payment-identifier: a plain v1 client's
        before = payout(devnet, shop)
        send = partial(requests.get, f"{base}/report", headers=header, timeout=90)
        with ThreadPoolExecutor(2) as pool:
            answers = [future.result() for future in [pool.submit(send), pool.submit(send)]]
        statuses = sorted(a.status_code for a in answers)
        assert statuses[0] == 200 and statuses[1] != 200, statuses
        assert sum(payout(devnet, shop).values()) - sum(before.values()) == ATOMIC


def test_a_payment_for_a_cheaper_resource_cannot_buy_a_dearer_one(shop_url, devnet, shop):
    header = signed_v1(f"{shop_url}/report", funded_account(devnet))  # 0.25 USDC
    before = payout(devnet, shop)
    response = requests.get(f"{shop_url}/premium", headers=header, timeout=30)
    assert response.status_code == 402 and "value must be 1000000" in response.json()["error"]  # /premium: 1 USDC
    assert payout(devnet, shop) == before


def test_spend_caps_refuse_before_anything_is_signed(shop_url, merchant_client, devnet, shop):
    buyer = funded_account(devnet)
    before = payout(devnet, shop)
    cheap = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), max_per_call="0.10")
    with pytest.raises(SpendLimitError, match="max_per_call"):
        cheap.get(f"{shop_url}/report")
    session_capped = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), max_per_call="1", max_per_session="0.60")
    assert session_capped.get(f"{shop_url}/report?day=1").status_code == 200  # three resources: three payments
    assert session_capped.get(f"{shop_url}/report?day=2").status_code == 200
    with pytest.raises(SpendLimitError, match="max_per_session"):
        session_capped.get(f"{shop_url}/report?day=3")  # a third would make 0.75
    assert session_capped.spent_usdc == Decimal("0.50")
    after = payout(devnet, shop)
    assert sum(after.values()) - sum(before.values()) == 2 * ATOMIC


def test_a_refused_payment_stays_counted_until_it_can_no_longer_settle(shop_url, devnet, shop):
    broke = Account.create()  # no USDC anywhere, and no RPC URLs to find that out before signing
    now = [time.time()]
    agent = agent_for(broke, devnet, max_per_call="1", clock=lambda: now[0])
    with pytest.raises(PaymentRequiredError, match="refused the payment") as refused:
        agent.get(f"{shop_url}/report")
    assert refused.value.response is not None and refused.value.response.status_code == 402
    # A refusal is the server's word: a server may keep the signed authorization and settle it later.
    assert agent.spent_usdc == Decimal(PRICE) and agent.release_expired() == 0
    now[0] += 120 + agent.expiry_margin_seconds + 1  # past validBefore (maxTimeoutSeconds 120) and the margin
    assert agent.release_expired() == Decimal(PRICE) and agent.spent_usdc == 0


def test_bad_payment_headers_get_a_clear_402(shop_url):
    for header in ("not base64!", "bm90IGpzb24=", x402.encode_header({"x402Version": 1})):
        response = requests.get(f"{shop_url}/report", headers={"X-Payment": header}, timeout=10)
        assert response.status_code == 402, header
        assert response.json()["error"] and "X-Payment-Required" in response.headers


def test_the_wsgi_middleware_charges_only_its_routes(merchant_client, devnet, shop):
    def plain_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [f"content of {environ['PATH_INFO']}".encode()]

    app = PaywallMiddleware(plain_app, Paywall(merchant_client), {"GET /data": PRICE})
    for base in serve(app):
        assert requests.get(f"{base}/free", timeout=10).text == "content of /free"
        assert requests.get(f"{base}/data", timeout=10).status_code == 402
        before = payout(devnet, shop)
        response = agent_for(funded_account(devnet), devnet, rpc_urls=rpc_urls(devnet)).get(f"{base}/data")
        assert response.status_code == 200 and response.text == "content of /data"
        assert response.payment["transaction"] and "X-Payment-Response" in response.headers
        assert sum(payout(devnet, shop).values()) - sum(before.values()) == ATOMIC
