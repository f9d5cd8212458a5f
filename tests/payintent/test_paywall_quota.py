"""Nobody spends the merchant's API quota through the paywall (second review of the paywall: Medium M2, M3),
against the real API, the devnet and a relayer; balances read on chain.

- M2: anonymous 402s make no intent and no API call (the catalog is read once every few minutes).
- M3: a forged header (a garbage authorization, one for another recipient) costs no API call; requests
  that still need the API (verify, settle) are budgeted per client and in all (429/503 + Retry-After),
  and an API error is a 503 with Retry-After, never a 500.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from eth_account import Account
from flask import Flask, jsonify

from payintent import x402
from payintent.client import PayIntentClient, PayIntentError
from payintent.eip3009 import sign_authorization
from payintent.paywall import Paywall
from tests.conftest import create_merchant
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
from tests.settlement.conftest import make_pay_app


class CountingClient(PayIntentClient):
    """The merchant's real client, counting the API calls the paywall makes with its key."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        self.calls.append(f"{method} {path}")
        return super()._send(method, path, **kwargs)


def shop_app(paywall: Paywall) -> Flask:
    app = Flask(f"shop-{uuid.uuid4().hex[:6]}")

    @app.get("/items/<int:n>")
    @paywall.require(PRICE)
    def item(n: int) -> Any:
        return jsonify(item=n)

    @app.get("/report")
    @paywall.require(PRICE)
    def report() -> Any:
        return jsonify(report="paid content")

    @app.get("/other")
    @paywall.require(PRICE)
    def other() -> Any:
        return jsonify(other=1)

    return app


def test_anonymous_requests_make_no_intent_and_one_api_call_in_all(api_url, shop):
    client = CountingClient(api_url, shop.api_key)
    paywall = Paywall(client)
    before = client.list_intents(limit=1)["total"]
    with requests.Session() as session:
        for base in serve(shop_app(paywall)):
            start = len(client.calls)
            statuses = {session.get(f"{base}/items/{n}", timeout=30).status_code for n in range(300)}
            assert statuses == {402}
            assert client.calls[start:] == ["GET /x402/facilitator/supported"]  # the catalog, once
    assert client.list_intents(limit=1)["total"] == before


def junk_requests(base: str, session: requests.Session) -> Iterator[requests.Response]:
    """What an attacker sends for free: garbage authorizations, and well-signed ones paying someone else."""
    stranger = Account.create()
    requirement = next(r for r in challenge_of(f"{base}/report")["accepts"] if r["network"] == SEPOLIA)
    for i in range(40):
        garbage = {"x402Version": 1, "scheme": "exact", "network": SEPOLIA,
                   "payload": {"from": stranger.address, "to": stranger.address, "value": "250000", "validAfter": "0",
                               "validBefore": str(int(time.time()) + 600), "nonce": "0x" + f"{i:064x}",
                               "signature": "0x" + "11" * 65}}  # fmt: skip
        yield session.get(f"{base}/report", headers={"X-Payment": x402.encode_header(garbage)}, timeout=30)
        elsewhere = sign_authorization(stranger, {**requirement, "payTo": stranger.address})
        misdirected = {"x402Version": 1, "scheme": "exact", "network": SEPOLIA, "payload": elsewhere}
        yield session.get(f"{base}/report", headers={"X-Payment": x402.encode_header(misdirected)}, timeout=30)
        yield session.get(f"{base}/report", headers={"X-Payment": "bm90IGpzb24="}, timeout=30)


def test_forged_payments_cost_no_api_call(api_url, shop, devnet):
    client = CountingClient(api_url, shop.api_key)
    paywall = Paywall(client)
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    before = payout(devnet, shop)
    with requests.Session() as session:
        for base in serve(shop_app(paywall)):
            challenge_of(f"{base}/report")  # the catalog read
            start = len(client.calls)
            statuses = {r.status_code for r in junk_requests(base, session)}
            assert statuses == {402} and client.calls[start:] == [], (statuses, client.calls[start:])
            paid = send(f"{base}/report", evm_payment(buyer, challenge_of(f"{base}/report")))
            assert paid.status_code == 200 and paid.json() == {"report": "paid content"}
            assert client.calls[start:] == ["POST /x402/facilitator/verify", "POST /x402/facilitator/settle"]
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC


def test_requests_that_need_the_api_are_budgeted_per_client(api_url, shop, devnet):
    """Validly signed authorizations of empty accounts pass every offline check: each needs /pay. A client
    gets its share of calls a minute, then 429 with Retry-After; later buyers are served."""
    now = [time.time()]
    client = CountingClient(api_url, shop.api_key)
    paywall = Paywall(client, requests_per_minute_per_client=8, clock=lambda: now[0])  # a burst of 2
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    before = payout(devnet, shop)
    for base in serve(shop_app(paywall)):
        ours = challenge_of(f"{base}/report")
        start = len(client.calls)
        answers = [send(f"{base}/report", evm_payment(Account.create(), ours)) for _ in range(10)]
        assert [a.status_code for a in answers[:2]] == [402, 402]  # verify refused them: no USDC
        assert {a.status_code for a in answers[2:]} == {429}
        assert all(1 <= int(a.headers["Retry-After"]) <= 60 for a in answers[2:])
        assert client.calls[start:] == ["POST /x402/facilitator/verify"] * 2
        now[0] += 60  # a minute later the client has its share again
        assert send(f"{base}/report", evm_payment(buyer, challenge_of(f"{base}/report"))).status_code == 200
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC


@pytest.fixture
def limited_api(db_url: str, redis_server_url: str, devnet: Any, relayer: Any) -> Iterator[tuple[str, Any]]:
    """The API with a quota of 20 calls a minute per key, and a merchant on it."""
    from backend.extensions import db

    api = make_pay_app(db_url, redis_server_url, devnet, api_requests_per_minute_per_key=20)
    with api.app_context():
        payout_address = Account.create().address
        shop = create_merchant(
            api, f"q-{uuid.uuid4().hex[:6]}@example.com", dict.fromkeys(devnet.networks, payout_address)
        )
        shop.payout = payout_address
        for api_url in serve(api):
            yield api_url, shop
        db.session.remove()
        db.engine.dispose()


def test_an_api_refusal_is_a_503_with_retry_after_never_a_500(limited_api, devnet):
    api_url, shop = limited_api
    client = PayIntentClient(api_url, shop.api_key)
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    for base in serve(shop_app(Paywall(client))):
        ours = challenge_of(f"{base}/report")
        payment = evm_payment(buyer, ours)
        with pytest.raises(PayIntentError) as limited:
            for _ in range(40):  # someone (anyone holding the key, or the paywall's users) used up the quota
                client.list_intents(limit=1)
        assert limited.value.status == 429
        assert requests.get(f"{base}/other", timeout=30).status_code == 402  # the catalog needs no API call
        answer = send(f"{base}/report", payment)  # verify does: the API answers 429
        assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1, answer.text
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000  # nothing charged; the same payment may be retried
    assert devnet.balance(SEPOLIA, shop.payout) == 0
