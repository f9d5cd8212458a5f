"""Nobody spends the merchant's API quota through the paywall (second review of the paywall: Medium M2, M3,
Low L4), against the real API, the devnet and a relayer; balances read on chain.

- M2: a Flask route with a path parameter made one intent per concrete path, and the paywall's maps
  grew for ever; intents are now shared by the route's rule, and every map is bounded.
- M3: each forged header (a random intent id, a garbage authorization, a self-signed proof) cost
  one API call; a 429 from the API escaped as a 500. Forged headers are now refused offline,
  requests that still need the API are budgeted per client and in all (429/503 + Retry-After), and
  an API error is a 503 with Retry-After.
- L4: a forged header overwrote a buyer's recovery hint before /pay verified anything.
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
from requests.adapters import HTTPAdapter

from payintent import x402
from payintent.access import sign_evm_proof
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

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        self.calls.append(f"{method} {path}")
        return super()._request(method, path, **kwargs)


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


def held(paywall: Paywall) -> int:
    """The largest map the paywall keeps for its intents."""
    return max(
        len(v) for v in vars(paywall.intents).values() if hasattr(v, "__len__") and not isinstance(v, str | tuple)
    )


def test_a_route_with_a_path_parameter_shares_one_intent(merchant_client):  # noqa: F811
    paywall = Paywall(merchant_client)
    before = merchant_client.list_intents(limit=1)["total"]
    with requests.Session() as session:
        for base in serve(shop_app(paywall)):
            shown = {session.get(f"{base}/items/{n}", timeout=30).json()["intent_id"] for n in range(300)}
    created = merchant_client.list_intents(limit=1)["total"] - before
    assert created <= 2 and len(shown) <= 2, (created, len(shown))
    assert held(paywall) <= 2  # nothing kept per path


def junk_requests(base: str, session: requests.Session, shared: str) -> Iterator[requests.Response]:
    """What an attacker sends for free: random intent ids, garbage authorizations, self-signed proofs (of
    random intents, and of the route's unpaid intent that every 402 shows)."""
    stranger = Account.create()
    for i in range(40):
        named = {"x402Version": 1, "scheme": "exact", "network": SEPOLIA, "intent_id": f"pi_{uuid.uuid4().hex}"}
        yield session.get(f"{base}/report", headers={"X-Payment": x402.encode_header(named)}, timeout=30)
        garbage = {"x402Version": 1, "scheme": "exact", "network": SEPOLIA,
                   "payload": {"from": stranger.address, "to": stranger.address, "value": "250000", "validAfter": "0",
                               "validBefore": str(int(time.time()) + 600), "nonce": "0x" + f"{i:064x}",
                               "signature": "0x" + "11" * 65}}  # fmt: skip
        yield session.get(f"{base}/report", headers={"X-Payment": x402.encode_header(garbage)}, timeout=30)
        challenge = session.get(f"{base}/report", timeout=30).headers["X-Payment-Access-Challenge"]
        proof = sign_evm_proof(stranger, "GET /report", shared if i % 2 else f"pi_{uuid.uuid4().hex}", challenge)
        proof["nonce"] = "0x" + f"{i:064x}"
        yield session.get(f"{base}/report", headers={"X-Payment-Proof": x402.encode_header(proof)}, timeout=30)


def test_forged_payments_and_proofs_cost_no_api_call(api_url, shop, devnet):
    client = CountingClient(api_url, shop.api_key)
    paywall = Paywall(client)
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    before = payout(devnet, shop)
    with requests.Session() as session:
        for base in serve(shop_app(paywall)):
            shared = challenge_of(f"{base}/report")["intent_id"]
            start = len(client.calls)
            statuses = {r.status_code for r in junk_requests(base, session, shared)}
            spent = [c for c in client.calls[start:] if c != f"GET /x402/intents/{shared}"]  # (the 15 s re-read)
            assert statuses == {402} and spent == [], (statuses, spent)
            paid = send(f"{base}/report", evm_payment(buyer, challenge_of(f"{base}/report")))
            assert paid.status_code == 200 and paid.json() == {"report": "paid content"}
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC


def test_requests_that_need_the_api_are_budgeted_per_client(api_url, shop, devnet):
    """Validly signed authorizations of empty accounts pass every offline check: each needs /pay. A client
    gets its share of calls a minute, then 429 with Retry-After; other clients and later buyers are served."""
    now = [time.time()]
    client = CountingClient(api_url, shop.api_key)
    paywall = Paywall(client, requests_per_minute_per_client=8, clock=lambda: now[0])  # a burst of 2
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    before = payout(devnet, shop)
    for base in serve(shop_app(paywall)):
        ours = challenge_of(f"{base}/report")
        start = len(client.calls)
        answers = [send(f"{base}/report", evm_payment(Account.create(), ours)) for _ in range(10)]
        assert [a.status_code for a in answers[:2]] == [402, 402]  # /pay refused them: no USDC
        assert {a.status_code for a in answers[2:]} == {429}
        assert all(1 <= int(a.headers["Retry-After"]) <= 60 for a in answers[2:])
        assert sum(c == "POST /x402/pay" for c in client.calls[start:]) == 2
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
        for answer in (requests.get(f"{base}/other", timeout=30), send(f"{base}/report", payment)):
            assert answer.status_code == 503 and int(answer.headers["Retry-After"]) >= 1, answer.text
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000  # nothing charged; the same payment may be retried
    assert devnet.balance(SEPOLIA, shop.payout) == 0


class ForgeBeforeProof(HTTPAdapter):
    """Forwards every request; another buyer pays the shared intent just before the agent's payment goes
    out, the answer to that payment is lost, and ``forge`` runs just before the agent's first proof."""

    def __init__(self, someone_pays_first: Any, forge: Any) -> None:
        super().__init__()
        self.someone_pays_first, self.forge = someone_pays_first, forge
        self.dropped = False

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        if "X-Payment-Proof" in request.headers and self.forge is not None:
            self.forge()
            self.forge = None
        if "X-Payment" in request.headers and self.someone_pays_first is not None:
            self.someone_pays_first()
            self.someone_pays_first = None
        response = super().send(request, *args, **kwargs)
        if "X-Payment" in request.headers and not self.dropped:
            self.dropped = True
            raise requests.ConnectionError("connection reset after the payment was sent")
        return response


def test_a_forged_header_cannot_overwrite_a_buyers_recovery_hint(shop_url, merchant_client, devnet, shop):  # noqa: F811
    """The agent's payment is settled on a fresh intent (another buyer took the shared one) and its answer
    is lost; before it proves its payment, an attacker sends a header with the agent's (from, nonce) and a
    bad signature. The agent still recovers with its proof; nothing is charged twice."""
    first, buyer = funded_account(devnet), funded_account(devnet, SEPOLIA, 5_000_000)
    shared = challenge_of(f"{shop_url}/report")["intent_id"]
    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), sleep=lambda _: None)
    recorded = recording(agent.session)

    def someone_pays_first() -> None:
        merchant_client.pay(shared, first, rpc_urls=rpc_urls(devnet))

    def forge() -> None:
        payload = x402.decode_header(next(r for r in recorded if "X-Payment" in r.headers).headers["X-Payment"])
        requirement = next(r for r in challenge_of(f"{shop_url}/report")["accepts"] if r["network"] == SEPOLIA)
        forged = sign_authorization(Account.create(), requirement)  # well formed, signed by someone else
        forged.update({"from": payload["payload"]["from"], "nonce": payload["payload"]["nonce"]})
        answer = send(f"{shop_url}/report", {"x402Version": 1, "scheme": "exact", "network": SEPOLIA,
                                             "payload": forged})  # fmt: skip
        assert answer.status_code == 402

    agent.session.mount("http://", ForgeBeforeProof(someone_pays_first, forge))
    before = payout(devnet, shop)
    response = agent.get(f"{shop_url}/report")
    assert response.status_code == 200 and response.payment["intent_id"] != shared
    assert sum("X-Payment-Proof" in r.headers for r in recorded) >= 1
    assert sum("X-Payment" in r.headers for r in recorded) == 1
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == 2 * ATOMIC  # each buyer once
