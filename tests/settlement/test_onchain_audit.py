"""harness.audit, the on-chain audit the benchmarks and the drills share: a real payment passes it, and it
finds a payment recorded with the wrong amount, payee or transaction, a charge nobody recorded, and a
transaction counted twice."""

from __future__ import annotations

from typing import Any

from harness import audit
from payintent.eip3009 import sign_authorization
from tests.settlement.test_pay import create_intent, pay, requirement

NETWORK = "eip155:84532"


def tokens(devnet: Any) -> dict[str, audit.Token]:
    return {
        n: audit.Token(devnet.info["networks"][n]["rpc_url"], devnet.info["networks"][n]["usdc_address"])
        for n in devnet.networks
    }


def test_a_payment_adds_up_and_each_wrong_record_is_found(pay_client, shop, devnet):
    buyer = devnet.buyer(2)
    keys = {NETWORK: [buyer.address, shop.payout]}
    before = audit.balances(tokens(devnet), keys)
    intent = create_intent(pay_client, shop, 1.5)
    response = pay(pay_client, shop, intent, NETWORK, sign_authorization(buyer.key, requirement(intent, NETWORK)))
    assert response.status_code == 200, response.get_json()
    tx_hash = response.get_json()["data"]["tx_hash"]
    paid = audit.Paid(NETWORK, buyer.address, shop.payout, 1_500_000, tx_hash)

    assert audit.audit(tokens(devnet), [paid], before) == []

    other = "0x" + "22" * 20
    wrong_amount = audit.audit(
        tokens(devnet), [audit.Paid(NETWORK, buyer.address, shop.payout, 1_000_000, tx_hash)], before
    )
    assert any("not exactly its payment's transfer" in p for p in wrong_amount)
    assert any("received 1500000 atomic USDC for 1000000 recorded" in p for p in wrong_amount)
    wrong_payee = audit.check_transactions(
        tokens(devnet), [audit.Paid(NETWORK, buyer.address, other, 1_500_000, tx_hash)]
    )
    assert len(wrong_payee) == 1 and "not exactly its payment's transfer" in wrong_payee[0]
    unrecorded = audit.audit(tokens(devnet), [], before)
    assert any(f"{buyer.address.lower()} lost 1500000 atomic USDC for 0 recorded (an unrecorded charge)" in p
               for p in unrecorded)  # fmt: skip
    assert audit.check_transactions(tokens(devnet), [paid, paid]) == ["1 x a transaction counted for two payments"]
    reverted = audit.check_transactions(
        tokens(devnet), [audit.Paid(NETWORK, buyer.address, shop.payout, 1, "0x" + "00" * 32)]
    )
    assert reverted == [f"1 x a paid payment's transaction on {NETWORK} missing or reverted"]
