"""Releasing a claim, and watching what was released (second review of the reconciler, M1, L1, L2).

- M1: with `confirmations` > 1, our transaction's revert in a block that is not final released the
  claim at once; a reorg can re-include our transaction alone, and then it succeeds, after the intent
  was released and perhaps paid again (charged twice). Now the revert is decided once its block is final.
- L1: the watch of released settlements ended on our clock (an hour past validBefore), so an execution
  not seen by then (a worker outage) was never recorded: money moved, intent not paid. Now a settlement
  leaves the watch only when the chain has decided (executed, or unused with a final block past validBefore).
- L2: the watch took the first 200 rows by validBefore each tick, so 200 decoys hid a real late execution;
  now rows are visited round-robin, a bounded number per tick.

Real Anvil chain and token; mining by hand and a reorg by snapshot/revert as in test_finality.py.
"""

from __future__ import annotations

import secrets
import time
from datetime import timedelta
from typing import Any

from eth_account import Account
from sqlalchemy import select

from backend import clock as clock_module
from backend.chains.evm import evm_chain
from backend.extensions import db
from backend.rails.evm.outcome import EXPIRY_GRACE_SECONDS
from backend.settlement import services
from backend.settlement.models import Settlement
from backend.settlement.reconcile import WATCH_PER_TICK
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.settlement.conftest import stop_process
from tests.settlement.test_duplicate import _execute
from tests.settlement.test_finality import CONFIRMATIONS, careful, chain  # noqa: F401  (fixtures)
from tests.settlement.test_nonce_reuse import _events, _funded_buyer
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, _token, iso  # noqa: F401  (fixture)

HOUR = 3600


def _relay_tx_in_pool(careful: Any, chain: Any, intent_id: str) -> tuple[str, str]:  # noqa: F811
    """Mining paused: the relay's transaction for the intent, waiting in the pool, and its raw bytes."""
    relay_tx = careful.wait_settlement(intent_id, "submitted").tx_hash
    assert relay_tx
    chain.wait_in_pool(relay_tx)
    w3 = careful.devnet.w3(NETWORK)
    return relay_tx, w3.provider.make_request("eth_getRawTransactionByHash", [relay_tx])["result"]


def _revert_behind_a_front_run(careful: Any, chain: Any, relay_tx: str, buyer: Any, amount: int) -> int:  # noqa: F811
    """The buyer moves the USDC away with a higher tip than the relay's transaction waiting in the pool, so
    one block holds both and the relay's reverts. Returns that block."""
    w3, token = _token(careful.devnet, NETWORK)
    w3.provider.make_request("anvil_setBalance", [buyer.address, hex(10**18)])
    move = token.functions.transfer(Account.create().address, amount).build_transaction(
        {"from": buyer.address, "nonce": w3.eth.get_transaction_count(buyer.address), "chainId": w3.eth.chain_id,
         "gas": 100_000, "maxPriorityFeePerGas": 50 * 10**9, "maxFeePerGas": 100 * 10**9})  # fmt: skip
    w3.eth.send_raw_transaction(buyer.sign_transaction(move).raw_transaction)
    block = chain.mine()
    receipt = w3.eth.get_transaction_receipt(relay_tx)
    assert receipt["status"] == 0 and receipt["blockNumber"] == block
    return block


def test_a_revert_not_yet_final_keeps_the_claim_and_a_reorg_that_executes_it_pays_once(careful, chain, monkeypatch):  # noqa: F811
    import relayer.tasks as tasks
    from backend.rails.evm.watch import status_of
    from backend.rails.registry import rail_for
    from backend.settlement.models import settlement_claim

    w3, token = _token(careful.devnet, NETWORK)
    buyer = _funded_buyer(w3, token, careful.devnet, 7_000_000)
    intent = create_intent(careful.client, careful.shop, 7)
    intent_id = intent["intent_id"]
    chain.pause()
    crashing = careful.relayer(fault="before-finish")  # dies once it has read the (reverted) receipt
    try:
        auth = sign_authorization(buyer.key, requirement(intent, NETWORK))
        assert pay(careful.client, careful.shop, intent, NETWORK, auth).status_code == 504
        relay_tx, raw_relay_tx = _relay_tx_in_pool(careful, chain, intent_id)
        fork = chain.rpc("evm_snapshot")  # the chain before the block that holds the revert
        _revert_behind_a_front_run(careful, chain, relay_tx, buyer, 7_000_000)
        assert crashing.wait(timeout=60) == CRASH_EXIT_CODE
    finally:
        stop_process(crashing)
    receipt = dict(w3.eth.get_transaction_receipt(relay_tx))  # what the relayer read: reverted, 1 block of 3
    settlement = careful.settlement(intent_id)

    # The relayer's finish of that revert (its wait for the confirmations cut short): the claim is kept.
    monkeypatch.setattr(tasks, "RECEIPT_TIMEOUT_SECONDS", 1)
    network = careful.chains.get(NETWORK)
    landed = status_of(evm_chain(network), receipt, None)  # what the relayer read, as its rail's watch says it
    outcome = tasks._finish(rail_for(network), network, settlement, settlement_claim(settlement), landed)
    assert outcome == "waiting-for-confirmations"
    row = careful.intent_row(intent_id)
    assert row.status == "pending" and row.settlement_id == settlement.id  # still claimed, not released
    assert careful.settlement(intent_id).status == "submitted"
    assert careful.events("payment.failed", intent_id) == []
    second = sign_authorization(careful.devnet.buyer(2).key, requirement(intent, NETWORK))
    refused = pay(careful.client, careful.shop, intent, NETWORK, second)  # nobody can pay it a second time
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "PAYMENT_IN_PROGRESS"

    # A reorg (within the 3 confirmations) re-orders the block: our transaction alone, and it succeeds.
    chain.rpc("evm_revert", fork)
    chain.pause()
    w3.provider.make_request("eth_sendRawTransaction", [raw_relay_tx])
    chain.mine(CONFIRMATIONS)
    assert w3.eth.get_transaction_receipt(relay_tx)["status"] == 1
    assert careful.devnet.balance(NETWORK, careful.payout) == 7_000_000
    assert careful.reconcile_later()["finished"] == 1
    row = careful.intent_row(intent_id)
    assert row.status == "paid" and row.tx_hash == relay_tx
    assert len(careful.events("payment.completed", intent_id)) == 1
    assert careful.events("payment.duplicate", intent_id) == []
    refused = pay(careful.client, careful.shop, intent, NETWORK, second)
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "ALREADY_PAID"
    assert careful.devnet.balance(NETWORK, careful.payout) == 7_000_000  # charged once


def test_the_relayer_releases_a_revert_once_its_block_is_final(careful, chain):  # noqa: F811
    w3, token = _token(careful.devnet, NETWORK)
    buyer = _funded_buyer(w3, token, careful.devnet, 5_000_000)
    intent = create_intent(careful.client, careful.shop, 5)
    intent_id = intent["intent_id"]
    chain.pause()
    relayer = careful.relayer()
    try:
        auth = sign_authorization(buyer.key, requirement(intent, NETWORK))
        assert pay(careful.client, careful.shop, intent, NETWORK, auth).status_code == 504
        relay_tx, _ = _relay_tx_in_pool(careful, chain, intent_id)
        _revert_behind_a_front_run(careful, chain, relay_tx, buyer, 5_000_000)  # 1 block of 3
        chain.mine()  # 2 of 3: the relayer still waits
        assert careful.settlement(intent_id).status == "submitted"
        assert careful.intent_row(intent_id).settlement_id is not None
        chain.mine()  # 3 of 3: final, decided: released
        settlement = careful.wait_settlement(intent_id, "failed", timeout=60)
    finally:
        stop_process(relayer)
    assert settlement.failure_code == "SETTLEMENT_FAILED" and "reverted" in (settlement.failure_reason or "")
    assert careful.intent_row(intent_id).settlement_id is None  # payable again
    assert settlement.watched_at is not None  # and watched: its signature is out
    (failed,) = careful.events("payment.failed", intent_id)
    assert failed["code"] == "SETTLEMENT_FAILED"
    assert careful.devnet.balance(NETWORK, careful.payout) == 0


def _released(iso: Any, amount: float = 5) -> tuple[dict[str, Any], dict[str, str], Settlement]:  # noqa: F811
    """An intent claimed by an authorization that is then released (as a revert releases it)."""
    intent = create_intent(iso.client, iso.shop, amount)
    auth = sign_authorization(iso.devnet.buyer(0).key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, auth).status_code == 504  # claimed; no relayer here
    settlement = iso.settlement(intent["intent_id"])
    assert services.fail_settlement(settlement.id, "SETTLEMENT_FAILED", "transaction 0x.. reverted")
    return intent, auth, settlement


def test_a_late_execution_seen_after_an_outage_is_still_recorded(iso):  # noqa: F811
    """L1: the released authorization executed before validBefore; the worker was down for longer than an
    hour past validBefore. When it comes back, the watch still looks, and the intent is paid."""
    intent, auth, _ = _released(iso)
    w3, token = _token(iso.devnet, NETWORK)
    executed = _execute(w3, token, auth)  # before validBefore: it executes
    assert iso.devnet.balance(NETWORK, iso.payout) == 5_000_000
    away = int(auth["validBefore"]) - int(time.time()) + EXPIRY_GRACE_SECONDS + HOUR + 600
    counts = iso.reconcile_later(away)
    assert counts["late"] == 1
    row = iso.intent_row(intent["intent_id"])
    assert row.status == "paid" and row.tx_hash == executed
    assert len(_events("payment.completed", intent["intent_id"])) == 1
    assert iso.settlement(intent["intent_id"]).watch_done_at is not None
    assert iso.reconcile_later(away + 60)["watched"] == 0  # recorded: out of the watch for good


def test_the_watch_ends_when_the_chain_says_it_can_never_execute_not_on_our_clock(iso, chain):  # noqa: F811
    intent, auth, _ = _released(iso)
    valid_before = int(auth["validBefore"])
    far = valid_before - int(time.time()) + EXPIRY_GRACE_SECONDS + 5 * HOUR  # our clock is far past it ...
    assert iso.reconcile_later(far)["watched"] == 1
    assert iso.settlement(intent["intent_id"]).watched_at is not None  # ... the chain's is not: still watched
    chain.mine(timestamp=valid_before + EXPIRY_GRACE_SECONDS + 1)  # a final block past validBefore (+ grace)
    assert iso.reconcile_later(far)["watched"] == 1
    settlement = iso.settlement(intent["intent_id"])
    assert settlement.watched_at is None and settlement.watch_done_at is not None
    assert iso.reconcile_later(far)["watched"] == 0
    assert iso.intent_row(intent["intent_id"]).status == "pending" and settlement.status == "failed"


def test_released_decoys_cannot_hide_a_late_execution(iso):  # noqa: F811
    """L2: 200 released settlements that stay valid (any merchant can make them) are watched before the
    victim each tick; visited round-robin, a bounded number per tick, the victim's execution is still found."""
    intent, auth, victim = _released(iso)
    other = create_intent(iso.client, iso.shop, 5)
    earlier = clock_module.now() - timedelta(hours=1)
    decoys = 200
    for _ in range(decoys):  # any merchant's, any intent's; watched before the victim, and ending before it
        db.session.add(Settlement(
            id="stl_" + secrets.token_hex(16), intent_id=other["intent_id"], merchant_id=victim.merchant_id,
            network=NETWORK, asset=victim.asset, payer=Account.create().address, pay_to=victim.pay_to,
            amount_atomic=1, valid_after=0, valid_before=victim.valid_before - 1, nonce="0x" + secrets.token_hex(32),
            signature=victim.signature, status="failed", failure_code="SETTLEMENT_FAILED",
            start_block=victim.start_block, created_at=earlier, updated_at=earlier, watched_at=earlier))  # fmt: skip
    db.session.commit()
    w3, token = _token(iso.devnet, NETWORK)
    executed = _execute(w3, token, auth)  # the victim's released authorization executes

    ticks = []
    for _ in range(3 * (decoys // WATCH_PER_TICK + 1)):
        ticks.append(iso.reconcile_later())
        if ticks[-1]["late"]:
            break
    row = iso.intent_row(intent["intent_id"])
    assert row.status == "paid" and row.tx_hash == executed
    assert all(tick["watched"] <= WATCH_PER_TICK for tick in ticks)  # the work per tick is bounded
    assert sum(tick["watched"] for tick in ticks[:-1]) <= decoys  # found within one round of the watch list


def test_a_settlement_refused_because_another_paid_the_intent_sends_no_payment_failed(iso):  # noqa: F811
    """The intent was paid (a released authorization executed after all) while a second settlement waited
    for the relayer: the relayer refuses to send it (ALREADY_PAID). Nothing failed for the merchant, whose
    intent is paid: no payment.failed; the refused authorization is watched (its signature is out)."""
    intent, _, first = _released(iso, 3)
    second = sign_authorization(iso.devnet.buyer(1).key, requirement(intent, NETWORK))
    assert pay(iso.client, iso.shop, intent, NETWORK, second).status_code == 504  # claimed, queued
    assert services.complete_settlement(first.id, "0x" + "ab" * 32)  # what the watch does when it executed
    relayer = iso.relayer()
    try:
        deadline = time.monotonic() + 60
        while (refused := _other(intent["intent_id"], first.id)).status != "failed":
            assert time.monotonic() < deadline, refused.status
            time.sleep(0.1)
    finally:
        stop_process(relayer)
    assert refused.failure_code == "ALREADY_PAID"
    failed = _events("payment.failed", intent["intent_id"])
    assert [event["code"] for event in failed] == ["SETTLEMENT_FAILED"]  # the first's release only
    assert refused.watched_at is not None
    assert iso.devnet.balance(NETWORK, iso.payout) == 0  # nothing was sent


def _other(intent_id: str, settlement_id: str) -> Settlement:
    db.session.expire_all()
    return db.session.scalars(
        select(Settlement).where(Settlement.intent_id == intent_id, Settlement.id != settlement_id)
    ).one()
