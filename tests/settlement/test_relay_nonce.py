"""A settlement records the nonce its relay transaction was signed with (``settlements.relay_nonce``), before the
broadcast, through the real relayer on Anvil; the public API never shows it."""

from __future__ import annotations

import json
from typing import Any

from redis import Redis

from backend.rails.evm.nonces import NonceManager
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
