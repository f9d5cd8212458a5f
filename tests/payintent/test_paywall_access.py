"""Access after paying, on the devnet with a relayer: a paid resource is served again only against the
access token its settlement returned (never against the public data of a payment), and an agent whose
answer was lost gets it by sending the same payment again (its payment-identifier), charged once.
Balances are read on chain.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import requests
from eth_account import Account
from flask import Flask, jsonify
from requests.adapters import HTTPAdapter

from payintent import x402
from payintent.client import PayIntentClient
from payintent.eip3009 import sign_authorization
from payintent.paywall import Paywall
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

SEPOLIA = "eip155:11155111"
TESTNETS = Path(__file__).resolve().parents[2] / "backend" / "chains" / "testnets.json"


# --- helpers -------------------------------------------------------------------------------------


def challenge_of(url: str) -> dict[str, Any]:
    response = requests.get(url, timeout=30)
    assert response.status_code == 402
    return x402.decode_header(response.headers["X-Payment-Required"])


def evm_payment(buyer: Any, ours: dict[str, Any], network: str = SEPOLIA) -> dict[str, Any]:
    requirement = next(r for r in ours["accepts"] if r["network"] == network)
    return {"x402Version": 1, "scheme": "exact", "network": network, "payload": sign_authorization(buyer, requirement)}


def send(url: str, payment: dict[str, Any], header: str = "X-Payment") -> requests.Response:
    return requests.get(url, headers={header: x402.encode_header(payment)}, timeout=60)


def app_selling(paywall: Paywall, routes: dict[str, str]) -> Flask:
    app = Flask(f"shop-{uuid.uuid4().hex[:6]}")
    for path, price in routes.items():

        def view(path: str = path) -> Any:
            return jsonify({"content": path})

        app.add_url_rule(path, path, paywall.require(price)(view))
    return app


@pytest.fixture
def clocked(merchant_client: PayIntentClient) -> Iterator[tuple[str, list[float]]]:  # noqa: F811
    """A shop whose paywall reads a clock the test moves: /report and /other at PRICE."""
    now = [time.time()]
    paywall = Paywall(merchant_client, clock=lambda: now[0], access_seconds=60)
    for base in serve(app_selling(paywall, {"/report": PRICE, "/other": PRICE})):
        yield base, now


# --- High 3: proof, not public data --------------------------------------------------------------


def test_a_token_serves_its_resource_until_it_expires_and_nothing_else(clocked, merchant_client, devnet, shop):  # noqa: F811
    base, now = clocked
    before = payout(devnet, shop)
    paid = send(f"{base}/report?day=1", evm_payment(funded_account(devnet), challenge_of(f"{base}/report?day=1")))
    assert paid.status_code == 200
    token = paid.headers["X-Payment-Access"]
    assert int(paid.headers["X-Payment-Access-Expires"]) == int(now[0]) + 60

    def read(path: str, value: str) -> requests.Response:
        return requests.get(f"{base}{path}", headers={"X-Payment-Access": value}, timeout=30)

    assert read("/report?day=1", token).json() == {"content": "/report"}
    prefix, body, mac = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    moved = base64.urlsafe_b64encode(json.dumps({**claims, "e": claims["e"] + 3600}).encode()).decode().rstrip("=")
    flipped = mac[:-2] + ("AA" if mac[-2:] != "AA" else "BB")
    foreign = Paywall(merchant_client, secret="another paywall's secret")
    stranger_token = foreign.keys.issue(_grant(claims))  # the same claims, made with another secret
    for path, value, reason in (
        ("/report?day=2", token, "another resource"),  # another query of the same route
        ("/other", token, "another resource"),
        ("/report?day=1", f"{prefix}.{moved}.{mac}", "not valid"),  # a longer expiry, same MAC
        ("/report?day=1", f"{prefix}.{body}.{flipped}", "not valid"),
        ("/report?day=1", stranger_token, "not valid"),  # made with another secret
        ("/report?day=1", "pa1.garbage", "malformed"),
    ):
        refused = read(path, value)
        assert refused.status_code == 402 and reason in refused.json()["error"], (path, value)
    now[0] += 61
    expired = read("/report?day=1", token)
    assert expired.status_code == 402 and "expired" in expired.json()["error"]
    after = payout(devnet, shop)
    assert sum(after.values()) - sum(before.values()) == ATOMIC


def _grant(claims: dict[str, Any]) -> Any:
    from payintent.access import Grant

    return Grant(claims["k"], claims["r"], claims["i"], claims["p"], claims["e"])


class DropPaidAnswers(HTTPAdapter):
    """Forwards every request for real, but loses the answer to the first ``drops`` that carry a
    payment (a connection reset after the server got it); ``before_payment`` runs first."""

    def __init__(self, drops: int = 1, before_payment: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.drops = drops
        self.before_payment = before_payment

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        if "X-Payment" in request.headers and self.before_payment is not None:
            self.before_payment()
            self.before_payment = None
        response = super().send(request, *args, **kwargs)
        if "X-Payment" in request.headers and self.drops > 0:
            self.drops -= 1
            raise requests.ConnectionError("connection reset after the payment was sent")
        return response


def test_an_agent_whose_connection_broke_after_paying_gets_the_resource_without_paying_twice(shop_url, devnet, shop):  # noqa: F811
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), sleep=lambda _: None)
    agent.session.mount("http://", DropPaidAnswers())
    sent = recording(agent.session)
    before = payout(devnet, shop)
    response = agent.get(f"{shop_url}/report")
    assert response.status_code == 200 and response.json() == {"report": "paid content"}
    assert response.payment["payer"] == buyer.address and response.headers["X-Payment-Access"]
    payments = [r.headers["X-Payment"] for r in sent if "X-Payment" in r.headers]
    assert len(payments) == 2 and payments[0] == payments[1]  # the same payment (payment-identifier) again
    assert x402.decode_header(payments[0])["extensions"]["payment-identifier"]["info"]["id"]
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC
    assert agent.get(f"{shop_url}/report").status_code == 200  # its token now
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC and agent.spent_usdc == Decimal(PRICE)


def test_the_agent_signs_only_for_known_usdc_unless_told_otherwise(shop_url, devnet, shop):  # noqa: F811
    from payintent.agent import KNOWN_USDC, AssetNotAllowedError, PayingAgent

    configured = json.loads(TESTNETS.read_text())["networks"]
    assert {n["network"]: (n["usdc_address"],) for n in configured if n["kind"] == "evm"} == KNOWN_USDC
    buyer = funded_account(devnet)
    before = payout(devnet, shop)
    agent = PayingAgent(buyer, rpc_urls=rpc_urls(devnet))  # the devnet's TestUSDC is not Circle's USDC
    sent = recording(agent.session)
    with pytest.raises(AssetNotAllowedError, match="not an allowed USDC contract"):
        agent.get(f"{shop_url}/report")
    assert not any("X-Payment" in r.headers for r in sent) and agent.spent_usdc == 0
    wrong = PayingAgent(buyer, rpc_urls=rpc_urls(devnet), allowed_assets={SEPOLIA: Account.create().address})
    with pytest.raises(AssetNotAllowedError):
        wrong.get(f"{shop_url}/report")
    assert payout(devnet, shop) == before
    assert agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet)).get(f"{shop_url}/report").status_code == 200
