"""Releasing a claim (second review of the reconciler, M1).

- M1: with `confirmations` > 1, our transaction's revert in a block that is not final released the
  claim at once; a reorg can re-include our transaction alone, and then it succeeds, after the intent
  was released and perhaps paid again (charged twice). Now the revert is decided once its block is final.

Real Anvil chain and token; mining by hand and a reorg by snapshot/revert as in test_finality.py.
"""

from __future__ import annotations

from typing import Any

from eth_account import Account

from backend.chains.evm import evm_chain
from payintent.eip3009 import sign_authorization
from relayer.faults import CRASH_EXIT_CODE
from tests.settlement.conftest import stop_process
from tests.settlement.test_finality import CONFIRMATIONS, careful, chain  # noqa: F401  (fixtures)
from tests.settlement.test_nonce_reuse import _funded_buyer
from tests.settlement.test_pay import create_intent, pay, requirement
from tests.settlement.test_recovery import NETWORK, _token


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
    outcome = tasks._finish(evm_chain(careful.chains.get(NETWORK)), settlement, relay_tx, receipt)
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
    (failed,) = careful.events("payment.failed", intent_id)
    assert failed["code"] == "SETTLEMENT_FAILED"
    assert careful.devnet.balance(NETWORK, careful.payout) == 0
