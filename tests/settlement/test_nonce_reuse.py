"""A buyer's nonce used by another authorization of theirs is not a payment (second review, H1 and H2).

EIP-3009 nonces belong to the payer, not to one set of terms: after submitting an authorization
(pay the merchant N USDC, nonce X), the buyer can sign a second one with the same nonce X that moves
1 unit (or 0) to themselves, and get it executed first. The token then says "nonce X used", and an
`AuthorizationUsed(payer, X)` log exists, yet the merchant received nothing. Before, every finisher
(the reconciler, the relayer's revert path, the watch of released settlements) took that for the
payment: the intent was marked paid (H1), or a `payment.duplicate` "refund needed" was sent for a
second charge that never happened (H2). An execution now counts only if the same transaction moved
the settlement's terms: the token's `Transfer(payer -> payTo, amount)` right after `AuthorizationUsed`.

Real Anvil chain and token, real relayer processes; balances checked on chain.
"""

from __future__ import annotations

import json
import time
from typing import Any

from eth_account import Account
from sqlalchemy import select

from backend.events.models import Event
from backend.extensions import db
from backend.settlement.models import Settlement
from payintent.eip3009 import sign_authorization
from tests.settlement.conftest import stop_process
from tests.settlement.test_duplicate import _execute
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, _send_as, _token, iso  # noqa: F401  (fixture)


def _events(kind: str, intent_id: str) -> list[dict[str, Any]]:
    db.session.expire_all()
    rows = db.session.scalars(select(Event).where(Event.type == kind, Event.intent_id == intent_id))
    return [json.loads(row.payload)["data"] for row in rows]


def _funded_buyer(w3: Any, token: Any, devnet: Any, amount: int) -> Any:
    buyer = Account.create()
    _send_as(w3, devnet.buyer(1), token.functions.transfer(buyer.address, amount))
    return buyer


def _same_nonce_to_self(buyer: Any, paid: dict[str, str], intent: dict[str, Any], value: int) -> dict[str, str]:
    """The buyer signs the SAME nonce again, for other terms: ``value`` to their own address."""
    other = {**requirement(intent, NETWORK), "payTo": buyer.address, "maxAmountRequired": str(value)}
    return sign_authorization(buyer.key, other, nonce=bytes.fromhex(paid["nonce"][2:]))


def _pay_legitimately(iso: Any, buyer: Any, intent: dict[str, Any]) -> Any:  # noqa: F811
    relayer = iso.relayer()
    try:
        pay(iso.client, iso.shop, intent, NETWORK, sign_authorization(buyer.key, requirement(intent, NETWORK)))
        return iso.wait_paid(intent["intent_id"], timeout=60)
    finally:
        stop_process(relayer)


def test_a_nonce_used_by_the_buyers_own_other_terms_is_not_paid_by_the_reconciler(iso):  # noqa: F811
    w3, token = _token(iso.devnet, NETWORK)
    buyer = _funded_buyer(w3, token, iso.devnet, 50_000_000)
    intent = create_intent(iso.client, iso.shop, 50)
    intent_id = intent["intent_id"]
    submitted = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, submitted).status_code == 504  # claimed; no relayer here
    decoy_tx = _execute(w3, token, _same_nonce_to_self(buyer, submitted, intent, 1))  # 1 unit to itself, first
    assert iso.devnet.balance(NETWORK, iso.payout) == 0  # the merchant received nothing
    assert iso.devnet.balance(NETWORK, buyer.address) == 50_000_000

    counts = iso.reconcile_later()
    assert counts["finished"] == 1
    row = iso.intent_row(intent_id)
    assert row.status == "pending" and row.tx_hash is None and row.settlement_id is None  # not paid; released
    settlement = iso.settlement(intent_id)
    assert settlement.status == "failed" and settlement.failure_code == "AUTHORIZATION_USED_ELSEWHERE"
    assert decoy_tx in (settlement.failure_reason or "")
    assert settlement.watched_at is None  # its nonce is spent: nothing left to watch
    assert _events("payment.completed", intent_id) == []
    (failed,) = _events("payment.failed", intent_id)
    assert failed["code"] == "AUTHORIZATION_USED_ELSEWHERE" and failed["settlement_id"] == settlement.id

    # A real payment then pays it, once.
    paid = _pay_legitimately(iso, buyer, intent)
    assert paid.tx_hash != decoy_tx
    assert iso.devnet.balance(NETWORK, iso.payout) == 50_000_000
    assert iso.devnet.balance(NETWORK, buyer.address) == 0
    (completed,) = _events("payment.completed", intent_id)
    assert completed["tx_hash"] == paid.tx_hash


def test_front_running_the_relayer_with_the_same_nonce_is_not_paid_by_the_relayer(iso):  # noqa: F811
    """The buyer's same-nonce self-transfer waits in the mempool with a higher tip when /pay is called
    (so /pay sees the nonce unused); it is mined first and the relay's transaction reverts. The relayer's
    revert path alone (no reconciler) must release the intent, not mark it paid with the buyer's transaction."""
    w3, token = _token(iso.devnet, NETWORK)
    buyer = _funded_buyer(w3, token, iso.devnet, 40_000_000)
    intent = create_intent(iso.client, iso.shop, 40)
    intent_id = intent["intent_id"]
    submitted = sign_authorization(buyer.key, requirement(intent, NETWORK))
    decoy = _same_nonce_to_self(buyer, submitted, intent, 1)
    rpc = w3.provider.make_request
    relayer = iso.relayer()
    try:
        assert "error" not in rpc("evm_setAutomine", [False])
        sig = bytes.fromhex(decoy["signature"][2:])
        call = token.functions.transferWithAuthorization(
            decoy["from"], decoy["to"], int(decoy["value"]), int(decoy["validAfter"]), int(decoy["validBefore"]),
            bytes.fromhex(decoy["nonce"][2:]), sig[64], sig[:32], sig[32:64],
        )  # fmt: skip
        outsider = Account.create()
        rpc("anvil_setBalance", [outsider.address, hex(10**18)])
        tx = call.build_transaction({"from": outsider.address, "nonce": 0, "chainId": w3.eth.chain_id, "gas": 200_000,
                                     "maxPriorityFeePerGas": 50 * 10**9, "maxFeePerGas": 100 * 10**9})  # fmt: skip
        decoy_tx = "0x" + bytes(w3.eth.send_raw_transaction(outsider.sign_transaction(tx).raw_transaction)).hex()
        assert pay(iso.client, iso.shop, intent, NETWORK, submitted).status_code == 504  # accepted, in flight
        relay_tx = iso.wait_settlement(intent_id, "submitted").tx_hash
        deadline = time.monotonic() + 30
        while rpc("eth_getTransactionByHash", [relay_tx]).get("result") is None:
            assert time.monotonic() < deadline, "the relay's transaction never reached the node"
            time.sleep(0.1)
        assert "error" not in rpc("evm_mine", [])  # both in one block: the buyer's first (higher tip)
        assert "error" not in rpc("evm_setAutomine", [True])
        settlement = iso.wait_settlement(intent_id, "failed", timeout=60)  # by the relayer alone
    finally:
        rpc("evm_setAutomine", [True])
        stop_process(relayer)
    assert w3.eth.get_transaction_receipt(decoy_tx)["status"] == 1
    assert w3.eth.get_transaction_receipt(relay_tx)["status"] == 0
    assert settlement.failure_code == "AUTHORIZATION_USED_ELSEWHERE"
    assert iso.devnet.balance(NETWORK, iso.payout) == 0  # no money reached the merchant
    row = iso.intent_row(intent_id)
    assert row.status == "pending" and row.settlement_id is None and row.tx_hash is None
    assert _events("payment.completed", intent_id) == []

    paid = _pay_legitimately(iso, buyer, intent)
    assert paid.tx_hash not in (decoy_tx, relay_tx)
    assert iso.devnet.balance(NETWORK, iso.payout) == 40_000_000
    assert len(_events("payment.completed", intent_id)) == 1


def test_a_released_nonce_used_for_a_self_transfer_is_no_duplicate_charge(iso):  # noqa: F811
    """H2: after the intent is paid, the buyer spends a released authorization's nonce on a 0-value
    self-transfer. Nothing was charged twice: no payment.duplicate, and the watch is done with it."""
    w3, token = _token(iso.devnet, NETWORK)
    buyer, elsewhere = _funded_buyer(w3, token, iso.devnet, 30_000_000), Account.create()
    intent = create_intent(iso.client, iso.shop, 30)
    intent_id = intent["intent_id"]
    first = sign_authorization(buyer.key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, first).get_json()["error"]["code"] == "SETTLEMENT_PENDING"
    _send_as(w3, buyer, token.functions.transfer(elsewhere.address, 30_000_000))  # gone before the relay sends
    relayer = iso.relayer()
    try:
        released = iso.wait_settlement(intent_id, "failed", timeout=60)  # the transfer would revert: released
        assert released.failure_code == "SETTLEMENT_FAILED"
        _send_as(w3, elsewhere, token.functions.transfer(buyer.address, 30_000_000))
        pay(iso.client, iso.shop, intent, NETWORK, sign_authorization(buyer.key, requirement(intent, NETWORK)))
        paid = iso.wait_paid(intent_id, timeout=60)
    finally:
        stop_process(relayer)
    assert iso.devnet.balance(NETWORK, iso.payout) == 30_000_000  # paid once

    decoy_tx = _execute(w3, token, _same_nonce_to_self(buyer, first, intent, 0))  # the released nonce, 0 USDC
    counts = iso.reconcile_later()
    assert counts["late"] == 0
    assert _events("payment.duplicate", intent_id) == []
    assert counts["watched"] == 1
    db.session.expire_all()
    record = db.session.get(Settlement, released.id)
    assert record is not None and record.status == "failed" and record.failure_code == "SETTLEMENT_FAILED"
    assert record.tx_hash != decoy_tx
    assert record.watched_at is None and record.watch_done_at is not None  # it can never execute: watch done
    row = iso.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == paid.tx_hash
    assert len(_events("payment.completed", intent_id)) == 1
    assert iso.devnet.balance(NETWORK, iso.payout) == 30_000_000  # still one payment: nothing to refund
    assert iso.reconcile_later()["watched"] == 0
