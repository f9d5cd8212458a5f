"""A settlement records the nonce its relay transaction was signed with (``settlements.relay_nonce``), before the
broadcast, through the real relayer on Anvil; the public API never shows it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from eth_account import Account
from redis import Redis

from backend.chains.evm import evm_chain
from backend.rails.evm import relay as evm
from backend.rails.evm.nonces import NonceManager
from backend.rails.evm.rail import EVM_RAIL
from backend.settlement import services
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.settlement.conftest import stop_process
from tests.settlement.test_pay import INTENTS, create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, iso

__all__ = ["iso"]


def test_a_paid_settlement_records_its_transactions_sender_and_nonce(iso: Any) -> None:
    intent = create_intent(iso.client, iso.shop, 2)
    payload = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
    relayer = iso.relayer()
    try:
        pay(iso.client, iso.shop, intent, NETWORK, payload)
        paid = iso.wait_paid(intent["intent_id"])
    finally:
        stop_process(relayer)
    settlement = iso.settlement(intent["intent_id"])
    tx = iso.devnet.w3(NETWORK).eth.get_transaction(paid.tx_hash)
    assert settlement.tx_hash == paid.tx_hash
    assert (settlement.relay_address, settlement.relay_nonce) == (tx["from"], tx["nonce"])
    assert iso.devnet.balance(NETWORK, iso.payout) == 2_000_000
    shown = iso.client.get(f"{INTENTS}/{intent['intent_id']}", headers=iso.shop.headers)
    assert shown.status_code == 200 and "relay_nonce" not in json.dumps(shown.get_json())


def test_the_nonce_is_recorded_before_the_broadcast_and_a_nonce_manager_starts_after_it(iso: Any) -> None:
    """The relayer dies between the record and the broadcast: the row holds the (account, nonce) it signed, the
    chain never saw it, and a nonce manager given the recorded nonce (Redis lost) starts after it and reports it as
    a gap."""
    intent = create_intent(iso.client, iso.shop, 1)
    payload = sign_authorization(iso.devnet.buyer(1).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="after-mark-submitted")
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, payload).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = iso.settlement(intent["intent_id"])
    assert settlement.status == "submitted" and settlement.relay_address and settlement.relay_nonce is not None
    w3 = iso.devnet.w3(NETWORK)
    assert w3.eth.get_transaction_count(settlement.relay_address, "pending") == settlement.relay_nonce  # not sent
    assert iso.devnet.balance(NETWORK, iso.payout) == 0
    redis = Redis.from_url(iso.redis_url)
    manager = NonceManager(w3, NETWORK, settlement.relay_address, w3.eth.chain_id, redis)
    redis.delete(manager.hint_key)  # Redis lost too: the database's record alone keeps the nonce from being reused
    assert manager.start(settlement.relay_nonce) == [settlement.relay_nonce]
    assert manager.allocate() == settlement.relay_nonce + 1


def test_a_send_tried_again_after_nonce_too_low_records_the_nonce_it_signed_last(
    iso: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``relay.send`` signs again at a new nonce after the node's "nonce too low" (here: a lagging node's pending
    count, once): ``before_broadcast`` runs again, so the open settlement's row names the mined transaction's
    (hash, sender, nonce), not the refused one's."""
    intent = create_intent(iso.client, iso.shop, 1)
    auth = sign_authorization(iso.devnet.buyer(2).key, requirement(intent, NETWORK))
    crashing = iso.relayer(fault="after-mark-submitted")  # an open (submitted) settlement, nothing sent
    try:
        assert pay(iso.client, iso.shop, intent, NETWORK, auth).status_code == 504
        assert crashing.wait(timeout=30) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    settlement = iso.settlement(intent["intent_id"])
    keys = json.load(open(iso.devnet.info["relay_keys_file"]))[NETWORK]  # noqa: SIM115
    relay = next(a for a in map(Account.from_key, keys) if a.address == settlement.relay_address)
    redis = Redis.from_url(iso.redis_url)
    redis.delete(evm.LEASE_KEY.format(NETWORK, relay.address))  # the dead relayer's lease
    chain = evm_chain(iso.devnet.chains.get(NETWORK))
    w3 = chain.w3
    # The settlement's recorded nonce goes to another transaction: the nonce a lagging node names is mined.
    lagging = int(w3.eth.get_transaction_count(relay.address, "pending"))
    tx = {"from": relay.address, "to": relay.address, "value": 0, "gas": 21_000, "nonce": lagging,
          "chainId": w3.eth.chain_id, **evm.fees(chain)}  # fmt: skip
    assert w3.eth.wait_for_transaction_receipt(w3.eth.send_raw_transaction(relay.sign_transaction(tx).raw_transaction))
    real_count, answers = w3.eth.get_transaction_count, [lagging]  # the next count read answers `lagging`, once
    monkeypatch.setattr(w3.eth, "get_transaction_count", lambda *a: answers.pop() if answers else real_count(*a))
    terms = EVM_RAIL.terms_from_columns(
        {"payer": auth["from"], "pay_to": auth["to"], "amount_atomic": int(auth["value"]),
         "valid_after": int(auth["validAfter"]), "valid_before": int(auth["validBefore"]), "nonce": auth["nonce"],
         "signature": auth["signature"]}
    )  # fmt: skip
    calls: list[tuple[str, str, int]] = []

    def recorded(tx_hash: str, address: str, nonce: int) -> None:
        calls.append((tx_hash, address, nonce))
        services.mark_submitted(settlement.id, tx_hash, address, relay_nonce=nonce)

    tx_hash = evm.send(redis, chain, [relay], evm.transfer_call(chain, terms), evm.fees(chain), recorded)
    assert w3.eth.wait_for_transaction_receipt(tx_hash, timeout=30)["status"] == 1
    mined = w3.eth.get_transaction(tx_hash)
    assert calls == [(calls[0][0], relay.address, lagging), (tx_hash, relay.address, lagging + 1)]
    assert mined["nonce"] == lagging + 1
    row = iso.settlement(intent["intent_id"])
    assert (row.tx_hash, row.relay_address, row.relay_nonce) == (tx_hash, mined["from"], mined["nonce"])
    assert iso.devnet.balance(NETWORK, iso.payout) == 1_000_000
