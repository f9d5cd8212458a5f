"""``max_per_session`` bounds what a hostile server can take from a PayingAgent (second paywall review,
Medium M1), on the devnet: the hostile server's operator settles what it kept through the real API and
relayer, and the buyer's balance is read on chain.

(a) a negative ``maxAmountRequired`` passed the caps and drove the spent counter negative;
(b) after a 402 answer to its payment the agent released its reservation, though the server kept a
    valid signed authorization (valid 900 s) it could settle later.
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import pytest
import requests

from payintent import x402
from payintent.agent import PaymentRequiredError, SpendLimitError
from payintent.client import PayIntentClient
from tests.payintent.conftest import serve
from tests.payintent.test_paywall import (  # noqa: F401  (fixtures)
    ATOMIC,
    PRICE,
    agent_for,
    funded_account,
    merchant_client,
    payout,
    rpc_urls,
    shop_url,
)
from tests.payintent.test_paywall_access import SEPOLIA


def test_a_negative_price_does_not_reset_the_session_cap(shop_url, devnet, shop):  # noqa: F811
    real = x402.decode_header(requests.get(f"{shop_url}/report", timeout=30).headers["X-Payment-Required"])
    requirement = next(r for r in real["accepts"] if r["network"] == SEPOLIA)

    def hostile(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        body = {"x402Version": 1, "intent_id": "pi_x", "accepts": [{**requirement, "maxAmountRequired": "-100000000"}]}
        start_response("402 Payment Required", [("X-Payment-Required", x402.encode_header(body))])
        return [b"{}"]

    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), max_per_call=PRICE, max_per_session=PRICE)
    for base in serve(hostile):
        with pytest.raises(Exception) as refused:
            agent.get(f"{base}/x")
    assert agent.spent_usdc == 0  # (it was -100 on e88e21b: the cap then allowed 100.25 USDC)
    assert isinstance(refused.value, PaymentRequiredError) and "no valid maxAmountRequired" in str(refused.value)
    before = payout(devnet, shop)
    assert agent.get(f"{shop_url}/report?day=0").status_code == 200  # the cap allows one 0.25 purchase...
    with pytest.raises(SpendLimitError):
        agent.get(f"{shop_url}/report?day=1")  # ... and no second
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC


class Keeper:
    """A hostile resource server selling through the merchant's real intents: it answers every payment
    with a 402 ("refused") and keeps the signed authorization to settle later."""

    def __init__(self, client: PayIntentClient, **changes: Any) -> None:
        self.client, self.changes = client, changes
        self.kept: list[dict[str, Any]] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ.get("HTTP_X_PAYMENT"):
            self.kept.append(x402.decode_header(environ["HTTP_X_PAYMENT"]))
        intent = self.client.create_intent(PRICE)
        accepts = [{**r, **self.changes} for r in intent["payment_requirements"]]
        body = {"x402Version": 1, "intent_id": intent["intent_id"], "accepts": accepts}
        start_response("402 Payment Required", [("X-Payment-Required", x402.encode_header(body))])
        return [b'{"error":"payment refused"}']

    def settle_kept(self) -> None:
        """Later, the operator settles every authorization it kept, each on a fresh intent."""
        for payment in self.kept:
            fresh = self.client.create_intent(PRICE)
            self.client.settle(fresh["intent_id"], {k: v for k, v in payment.items() if k != "intent_id"})


def test_a_refused_payment_stays_counted_while_the_server_can_still_settle_it(merchant_client, devnet, shop):  # noqa: F811
    keeper = Keeper(merchant_client)
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    offset = [0.0]
    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), max_per_call=PRICE, max_per_session=PRICE,
                      clock=lambda: time.time() + offset[0])  # fmt: skip
    for base in serve(keeper):
        with pytest.raises(PaymentRequiredError, match="refused the payment"):
            agent.get(f"{base}/x")
        for _ in range(3):  # the cap is spent: nothing more is signed, whatever the server says
            with pytest.raises(SpendLimitError):
                agent.get(f"{base}/x")
    assert len(keeper.kept) == 1 and agent.spent_usdc == Decimal(PRICE)
    assert int(keeper.kept[0]["payload"]["validBefore"]) <= time.time() + 120  # the requirement's maxTimeoutSeconds
    before = payout(devnet, shop)
    keeper.settle_kept()
    assert payout(devnet, shop)[SEPOLIA] - before[SEPOLIA] == ATOMIC  # what it took: the session cap, no more
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000 - ATOMIC
    offset[0] = 400  # past validBefore: the chain shows it used, so it stays counted for good
    assert agent.release_expired() == 0 and agent.spent_usdc == Decimal(PRICE)


def test_a_kept_authorization_is_released_once_the_chain_shows_it_expired_unused(merchant_client, devnet, shop):  # noqa: F811
    keeper = Keeper(merchant_client, maxTimeoutSeconds=1)  # the agent signs for its floor (2 s here)
    buyer = funded_account(devnet, SEPOLIA, 5_000_000)
    agent = agent_for(buyer, devnet, rpc_urls=rpc_urls(devnet), max_per_call=PRICE, max_per_session=PRICE)
    agent.min_validity_seconds, agent.expiry_margin_seconds = 2, 1
    for base in serve(keeper):
        with pytest.raises(PaymentRequiredError, match="refused the payment"):
            agent.get(f"{base}/x")
        assert agent.spent_usdc == Decimal(PRICE) and agent.release_expired() == 0  # still valid on chain
        w3 = devnet.w3(SEPOLIA)
        deadline = time.time() + 60
        released = Decimal(0)
        while not released and time.time() < deadline:
            w3.provider.make_request("evm_mine", [])  # a new block: the chain's clock moves on
            released = agent.release_expired()
            time.sleep(0.5)
        assert released == Decimal(PRICE) and agent.spent_usdc == 0
        with pytest.raises(PaymentRequiredError, match="refused the payment"):  # the cap is free again
            agent.get(f"{base}/x")
    assert len(keeper.kept) == 2
    assert devnet.balance(SEPOLIA, buyer.address) == 5_000_000  # expired authorizations moved nothing
