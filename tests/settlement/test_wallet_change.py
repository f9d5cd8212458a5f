"""Issue 14 review, Medium: a merchant changes or removes its payout wallet while intents are pending.

An intent keeps the payment requirement it was created with (its payTo: the address the buyer signs). Before,
a payment signed to that old payTo settled after the merchant had replaced or removed the wallet: the USDC
went to an address the merchant no longer controls or wants. Now such a payment is refused 409
REQUIREMENT_OUTDATED before anything is sent (nothing moves on chain); the intent is never redirected to the
new wallet (a buyer signs payTo), and a fresh intent pays the new wallet.

Real Anvil chain and token, the session's real relayer process, real database and Redis.
"""

from __future__ import annotations

from typing import Any

from eth_account import Account

from backend.merchants import services as merchants
from payintent.eip3009 import sign_authorization
from tests.settlement.test_pay import INTENTS, create_intent, pay, requirement

NETWORK = "eip155:84532"


def test_a_payment_to_a_replaced_wallet_is_refused_and_nothing_moves(pay_app, pay_client, shop, devnet):
    old = shop.payout
    intent = create_intent(pay_client, shop, 2)
    signed_to_old = sign_authorization(devnet.buyer(0).key, requirement(intent, NETWORK))
    buyer_before = devnet.balance(NETWORK, devnet.buyer(0).address)
    new = Account.create().address
    merchants.set_wallet(shop.id, NETWORK, new, pay_app.extensions["payintent.chains"])  # the merchant moves

    refused = pay(pay_client, shop, intent, NETWORK, signed_to_old)
    assert refused.status_code == 409, refused.get_json()
    assert refused.get_json()["error"]["code"] == "REQUIREMENT_OUTDATED"
    assert devnet.balance(NETWORK, old) == 0 and devnet.balance(NETWORK, new) == 0  # on chain: nothing moved
    assert devnet.balance(NETWORK, devnet.buyer(0).address) == buyer_before

    # Not redirected either: the intent still names the old payTo, so a payment to the new wallet is refused.
    to_new = sign_authorization(devnet.buyer(0).key, {**requirement(intent, NETWORK), "payTo": new})
    assert pay(pay_client, shop, intent, NETWORK, to_new).get_json()["error"]["code"] == "REQUIREMENT_OUTDATED"
    read = pay_client.get(f"{INTENTS}/{intent['intent_id']}", headers=shop.headers).get_json()
    assert read["data"]["status"] == "pending" and requirement(read["data"], NETWORK)["payTo"] == old

    fresh = create_intent(pay_client, shop, 2)  # what the merchant does: a new intent, paying the new wallet
    assert requirement(fresh, NETWORK)["payTo"] == new
    paid = pay(pay_client, shop, fresh, NETWORK, sign_authorization(devnet.buyer(0).key, requirement(fresh, NETWORK)))
    assert paid.status_code == 200, paid.get_json()
    assert devnet.balance(NETWORK, new) == 2_000_000 and devnet.balance(NETWORK, old) == 0


def test_a_payment_after_the_wallet_was_removed_is_refused(pay_app, pay_client, shop, devnet):
    intent = create_intent(pay_client, shop, 1)
    signed = sign_authorization(devnet.buyer(1).key, requirement(intent, NETWORK))
    merchants.remove_wallet(shop.id, NETWORK)

    refused = pay(pay_client, shop, intent, NETWORK, signed)
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "REQUIREMENT_OUTDATED"
    assert devnet.balance(NETWORK, shop.payout) == 0

    # The merchant registers the same wallet again: the intent's payTo is its wallet again, and it is payable.
    merchants.set_wallet(shop.id, NETWORK, shop.payout, pay_app.extensions["payintent.chains"])
    assert pay(pay_client, shop, intent, NETWORK, signed).status_code == 200
    assert devnet.balance(NETWORK, shop.payout) == 1_000_000


def test_the_claim_checks_the_wallet_again(pay_app, pay_client, shop, devnet, monkeypatch: Any):
    """The wallet changes after /pay's first check, before the claim: the claim (which locks the wallet row)
    refuses it too, and nothing is claimed."""
    from backend.settlement import services

    intent = create_intent(pay_client, shop, 1)
    signed = sign_authorization(devnet.buyer(2).key, requirement(intent, NETWORK))
    first_check = services.check_pay_to_current

    def then_the_merchant_moves(*args: Any, **kwargs: Any) -> None:
        first_check(*args, **kwargs)
        if not kwargs.get("lock"):
            merchants.set_wallet(shop.id, NETWORK, Account.create().address, pay_app.extensions["payintent.chains"])

    monkeypatch.setattr(services, "check_pay_to_current", then_the_merchant_moves)
    refused = pay(pay_client, shop, intent, NETWORK, signed)
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "REQUIREMENT_OUTDATED"
    read = pay_client.get(f"{INTENTS}/{intent['intent_id']}", headers=shop.headers).get_json()
    assert read["data"]["status"] == "pending" and read["data"]["tx_hash"] is None
    assert devnet.balance(NETWORK, shop.payout) == 0
