"""Proof of payment at the paywall (issue 14, High 3 and Medium 7), on the devnet with a relayer.

A paid resource is served again only against proof bound to the payment (the access token its
settlement returned, or a signature of the payer's key over a fresh challenge), never against the
public data of a payment; anonymous 402s share one intent per route; buyers racing for that intent
are each charged once. Balances are read on chain.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import requests
from eth_account import Account
from flask import Flask, jsonify
from requests.adapters import HTTPAdapter

from payintent import x402
from payintent.client import PayIntentClient, PayIntentError
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
    return {"x402Version": 1, "scheme": "exact", "network": network, "intent_id": ours["intent_id"],
            "payload": sign_authorization(buyer, requirement)}  # fmt: skip


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
    paywall = Paywall(merchant_client, clock=lambda: now[0], access_seconds=60, recovery_seconds=90)
    for base in serve(app_selling(paywall, {"/report": PRICE, "/other": PRICE})):
        yield base, now


# --- High 3: proof, not public data --------------------------------------------------------------


def test_a_third_party_naming_a_paid_evm_intent_and_its_payer_gets_402(shop_url, devnet, shop):  # noqa: F811
    buyer = funded_account(devnet)
    ours = challenge_of(f"{shop_url}/report")
    payment = evm_payment(buyer, ours)
    assert send(f"{shop_url}/report", payment).status_code == 200  # the buyer paid
    before = payout(devnet, shop)
    # What anyone can read: the intent id (every 402 shows it) and the payer; the whole authorization
    # is in the transaction's calldata.
    forged = {"x402Version": 1, "scheme": "exact", "network": SEPOLIA, "intent_id": ours["intent_id"],
              "payload": {"from": buyer.address}}  # fmt: skip
    auth = payment["payload"]
    accepts = x402.v2_payment_required(ours["accepts"], ours["intent_id"], "", "", "")["accepts"]
    v2 = {"x402Version": 2,
          "payload": {"authorization": {k: v for k, v in auth.items() if k != "signature"},
                      "signature": auth["signature"]},
          "accepted": next(a for a in accepts if a["network"] == SEPOLIA)}  # fmt: skip
    for attempt, header in ((forged, "X-Payment"), (payment, "X-Payment"), (v2, "PAYMENT-SIGNATURE")):
        response = send(f"{shop_url}/report", attempt, header)
        assert response.status_code == 402, (header, attempt)
        assert "X-Payment-Response" not in response.headers and "paid content" not in response.text
    assert payout(devnet, shop) == before


def solana_shop(pay_app: Any, devnet: Any) -> Any:
    from solders.keypair import Keypair

    from tests.conftest import create_merchant

    wallet = str(Keypair().pubkey())
    shop = create_merchant(pay_app, f"paywall-sol-{wallet[:8].lower()}@example.com", {devnet_solana(devnet): wallet})
    shop.wallet = wallet  # type: ignore[attr-defined]
    return shop


def devnet_solana(devnet: Any) -> str:
    return str(devnet.info["solana"]["network"])


def solana_usdc(devnet: Any, owner: str) -> int:
    from solders.pubkey import Pubkey

    from backend.chains.solana import SolanaChain
    from payintent import solana_tx

    mint = Pubkey.from_string(devnet.info["solana"]["usdc_mint"])
    account = str(solana_tx.associated_token_address(Pubkey.from_string(owner), mint))
    return SolanaChain(devnet.info["solana"]["rpc_url"]).token_balance(account) or 0


def solana_payment(api_url: str, devnet: Any, intent_id: str, keypair: Any) -> dict[str, Any]:
    """What a Solana buyer sends: the checkout's transaction for the intent, signed as the buyer."""
    from payintent import solana_tx

    built = requests.post(
        f"{api_url}/api/v1/checkout/intents/{intent_id}/solana-transaction",
        json={"payer": str(keypair.pubkey()), "network": devnet_solana(devnet)},
        timeout=60,
    )
    assert built.status_code == 200, built.text
    tx = solana_tx.decode(built.json()["data"]["transaction"])
    return {"x402Version": 1, "scheme": "exact", "network": devnet_solana(devnet), "intent_id": intent_id,
            "payload": {"transaction": solana_tx.encode(solana_tx.sign_as(tx, keypair))}}  # fmt: skip


def test_solana_a_third_party_gets_402_and_a_late_buyer_is_not_charged(api_url, pay_app, devnet):
    from solders.keypair import Keypair

    shop = solana_shop(pay_app, devnet)
    paywall = Paywall(PayIntentClient(api_url, shop.api_key))
    buyer, late = (Keypair.from_base58_string(devnet.info["solana_buyers"][i]["secret_key"]) for i in (1, 2))
    for base in serve(app_selling(paywall, {"/report": PRICE})):
        ours = challenge_of(f"{base}/report")
        payment = solana_payment(api_url, devnet, ours["intent_id"], buyer)
        too_late = solana_payment(api_url, devnet, ours["intent_id"], late)  # same challenge, not sent yet
        spent = {str(k.pubkey()): solana_usdc(devnet, str(k.pubkey())) for k in (buyer, late)}
        assert send(f"{base}/report", payment).status_code == 200
        assert solana_usdc(devnet, shop.wallet) == ATOMIC
        # The memo carries the intent id; the payer is the transaction's signer: both public.
        forged = {"x402Version": 1, "scheme": "exact", "network": devnet_solana(devnet),
                  "intent_id": ours["intent_id"], "payload": {"from": str(buyer.pubkey())}}  # fmt: skip
        for attempt in (forged, payment):
            response = send(f"{base}/report", attempt)
            assert response.status_code == 402 and "X-Payment-Response" not in response.headers
        # The second buyer's transaction names the paid intent: refused before submission, a fresh intent offered.
        refused = send(f"{base}/report", too_late)
        assert refused.status_code == 402 and "nothing was charged" in refused.json()["error"]
        assert refused.json()["intent_id"] != ours["intent_id"]
        assert solana_usdc(devnet, shop.wallet) == ATOMIC
        assert solana_usdc(devnet, str(buyer.pubkey())) == spent[str(buyer.pubkey())] - ATOMIC
        assert solana_usdc(devnet, str(late.pubkey())) == spent[str(late.pubkey())]


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


def test_a_proof_needs_the_payers_key_a_fresh_challenge_and_a_recent_payment(clocked, devnet, shop):
    from payintent.access import sign_evm_proof

    base, now = clocked
    buyer, stranger = funded_account(devnet), Account.create()
    ours = challenge_of(f"{base}/report")
    assert send(f"{base}/report", evm_payment(buyer, ours)).status_code == 200
    before = payout(devnet, shop)

    def prove(account: Any, path: str = "/report", challenge_from: str = "/report", payer: str | None = None) -> Any:
        challenge = requests.get(f"{base}{challenge_from}", timeout=30).headers["X-Payment-Access-Challenge"]
        proof = sign_evm_proof(account, f"GET {path}", ours["intent_id"], challenge)
        if payer:
            proof["payer"] = payer
        return requests.get(f"{base}{path}", headers={"X-Payment-Proof": x402.encode_header(proof)}, timeout=30)

    assert prove(stranger, payer=buyer.address).status_code == 402  # claims to be the payer: wrong key
    assert "not paid by this payer" in prove(stranger).json()["error"]  # its own key: it paid nothing
    assert "challenge" in prove(buyer, challenge_from="/other").json()["error"]  # a challenge of another resource
    served = prove(buyer)
    assert served.status_code == 200 and served.json() == {"content": "/report"}
    assert requests.get(f"{base}/report", headers={"X-Payment-Access": served.headers["X-Payment-Access"]},
                        timeout=30).status_code == 200  # fmt: skip
    challenge = requests.get(f"{base}/report", timeout=30).headers["X-Payment-Access-Challenge"]
    now[0] += 121  # the challenge is stale, and the payment older than recovery_seconds
    stale = sign_evm_proof(buyer, "GET /report", ours["intent_id"], challenge)
    refused = requests.get(f"{base}/report", headers={"X-Payment-Proof": x402.encode_header(stale)}, timeout=30)
    assert refused.status_code == 402 and "expired" in refused.json()["error"]
    assert "too old" in prove(buyer).json()["error"]
    assert payout(devnet, shop) == before


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
    assert sum("X-Payment-Proof" in r.headers for r in sent) == 1  # recovered by proving the payer's key
    assert sum("X-Payment" in r.headers for r in sent) == 1  # one authorization, sent once
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC
    assert agent.get(f"{shop_url}/report").status_code == 200  # its token now
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC and agent.spent_usdc == Decimal(PRICE)


def test_an_agent_whose_payment_moved_to_a_fresh_intent_and_whose_answer_was_lost_recovers(
    shop_url,  # noqa: F811
    merchant_client,  # noqa: F811
    devnet,
    shop,
):
    """Two faults at once: another buyer pays the shared intent while the agent signs (its payment is
    settled on a fresh intent), and the answer is lost: the proof's nonce finds the fresh intent."""
    first, buyer = funded_account(devnet), funded_account(devnet, SEPOLIA, 5_000_000)
    shared = challenge_of(f"{shop_url}/report")["intent_id"]

    def someone_pays_first() -> None:
        merchant_client.pay(shared, first, rpc_urls=rpc_urls(devnet))

    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), sleep=lambda _: None)
    agent.session.mount("http://", DropPaidAnswers(before_payment=someone_pays_first))
    before = payout(devnet, shop)
    response = agent.get(f"{shop_url}/report")
    assert response.status_code == 200 and response.payment["intent_id"] != shared
    assert merchant_client.get_intent(response.payment["intent_id"])["buyer_address"] == buyer.address
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == 2 * ATOMIC  # each buyer once


class SlowSettlement(PayIntentClient):
    """The merchant's client, for a relayer slower than /pay waits: the first settle answers 504
    SETTLEMENT_PENDING (after settling for real, so the payment does complete)."""

    pending = 1

    def settle(self, intent_id: str, payment_signature: Any) -> dict[str, Any]:
        result = super().settle(intent_id, payment_signature)
        if self.pending:
            self.pending -= 1
            raise PayIntentError(504, "SETTLEMENT_PENDING", "still settling", {"intent_id": intent_id})
        return result


def test_a_payment_still_settling_is_collected_with_its_claim_token(api_url, shop, devnet):
    paywall = Paywall(SlowSettlement(api_url, shop.api_key))
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    for base in serve(app_selling(paywall, {"/report": PRICE})):
        ours = challenge_of(f"{base}/report")
        settling = send(f"{base}/report", evm_payment(buyer, ours))
        assert settling.status_code == 503 and settling.headers["Retry-After"]
        claim = settling.headers["X-Payment-Access"]
        stranger = send(f"{base}/report", evm_payment(Account.create(), ours))  # no claim token: nothing
        assert stranger.status_code == 402
        collected = requests.get(f"{base}/report", headers={"X-Payment-Access": claim}, timeout=30)
        assert collected.status_code == 200 and collected.headers["X-Payment-Access"] != claim
        agent = agent_for(funded_account(devnet, SEPOLIA, 5_000_000), devnet, rpc_urls=rpc_urls(devnet),
                          sleep=lambda _: None)  # fmt: skip
        paywall.client.pending = 1  # type: ignore[attr-defined]
        assert agent.get(f"{base}/report").status_code == 200  # the agent follows the claim by itself
        assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC
        assert devnet.balance(SEPOLIA, agent.account.address) == 5_000_000 - ATOMIC


# --- Medium 7: anonymous requests do not create intents ------------------------------------------


def test_a_hundred_anonymous_requests_create_one_intent(shop_url, merchant_client):  # noqa: F811
    before = merchant_client.list_intents(limit=1)["total"]

    def ask(n: int) -> str:
        response = requests.get(f"{shop_url}/report?n={n % 7}", timeout=30)  # query strings do not multiply them
        assert response.status_code == 402
        return str(response.json()["intent_id"])

    with ThreadPoolExecutor(8) as pool:
        shown = set(pool.map(ask, range(100)))
    created = merchant_client.list_intents(limit=1)["total"] - before
    assert created <= 2 and len(shown) == created, (created, shown)


def test_two_buyers_paying_the_same_challenge_at_once_are_both_served_and_charged_once(shop_url, devnet, shop):  # noqa: F811
    buyers = [funded_account(devnet, SEPOLIA, 5_000_000) for _ in range(2)]
    ours = challenge_of(f"{shop_url}/report")
    payments = [evm_payment(b, ours) for b in buyers]
    before = payout(devnet, shop)
    start = threading.Barrier(2)
    answers: list[requests.Response] = [None, None]  # type: ignore[list-item]

    def pay(i: int) -> None:
        start.wait(timeout=30)
        answers[i] = send(f"{shop_url}/report", payments[i])

    threads = [threading.Thread(target=pay, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    receipts = [x402.decode_header(a.headers["X-Payment-Response"]) for a in answers]
    assert [r["payer"] for r in receipts] == [b.address for b in buyers]
    assert receipts[0]["intent_id"] != receipts[1]["intent_id"]  # one settled the shared intent, one a fresh one
    assert [devnet.balance(SEPOLIA, b.address) for b in buyers] == [5_000_000 - ATOMIC] * 2
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == 2 * ATOMIC


# --- Low: the agent pays only USDC ---------------------------------------------------------------


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
