"""The relayer's job: submit one settlement's authorization and finish it from its receipt."""

from __future__ import annotations

import logging

from eth_account.signers.local import LocalAccount
from flask import current_app
from redis import Redis

from backend.chains.evm import EvmChain, evm_chain
from backend.queueing import app_job, redis_from_url
from backend.settlement import models as st
from backend.settlement import services
from backend.settlement.flow import notify_settled
from backend.settlement.reconcile import finish_from_chain
from relayer import evm
from relayer.faults import crash_point

log = logging.getLogger(__name__)

RECEIPT_TIMEOUT_SECONDS = 120
# Set by relayer.worker at start-up: the only place relay keys live.
RELAY_ACCOUNTS: dict[str, list[LocalAccount]] = {}


def _redis() -> Redis:
    return redis_from_url(current_app.config["PAYINTENT_SETTINGS"].redis_url)


@app_job
def settle(settlement_id: str) -> str:
    redis = _redis()
    try:
        return _settle(settlement_id, redis)
    finally:
        notify_settled(redis, settlement_id)


def _settle(settlement_id: str, redis: Redis) -> str:
    settlement = services.get_settlement(settlement_id)
    if settlement is None or settlement.status not in st.OPEN:
        return "finished"
    network = current_app.extensions["payintent.chains"].get(settlement.network)
    accounts = RELAY_ACCOUNTS.get(settlement.network)
    if network is None or not accounts:
        log.error("no relay account for %s; settlement %s waits", settlement.network, settlement_id)
        return "no-relay-account"
    chain = evm_chain(network)
    # A retry (after a crash or a lost job) first asks the chain what already happened.
    if finish_from_chain(chain, settlement):
        return "finished-from-chain"
    if settlement.status == st.SUBMITTED and settlement.tx_hash:
        receipt = chain.receipt(settlement.tx_hash)
        if receipt is not None:
            return _finish(chain, settlement, settlement.tx_hash, receipt)
    call = evm.transfer_call(chain, settlement)
    try:
        gas = evm.estimate(chain, call, accounts[0].address)
    except evm.Reverted as exc:
        services.fail_settlement(settlement_id, "SETTLEMENT_FAILED", f"the transfer would revert: {exc}")
        return "reverted-before-send"
    tx_hash = evm.send(
        redis,
        chain,
        accounts,
        call,
        gas,
        before_broadcast=lambda h, address: _submitted(settlement_id, h, address),
    )
    crash_point("after-broadcast")
    receipt = evm.wait_receipt(chain, tx_hash, RECEIPT_TIMEOUT_SECONDS)
    crash_point("before-finish")
    if receipt is None:
        return "waiting-for-receipt"  # the reconciler finishes it
    return _finish(chain, services.get_settlement(settlement_id) or settlement, tx_hash, receipt)


def _submitted(settlement_id: str, tx_hash: str, relay_address: str) -> None:
    services.mark_submitted(settlement_id, tx_hash, relay_address)
    crash_point("after-mark-submitted")


def _finish(chain: EvmChain, settlement: st.Settlement, tx_hash: str, receipt: dict) -> str:
    if receipt.get("status") == 1:
        services.complete_settlement(settlement.id, tx_hash)
        return "confirmed"
    # Reverted: maybe someone else executed the authorization first; the chain decides.
    if finish_from_chain(chain, settlement):
        return "finished-from-chain"
    services.fail_settlement(settlement.id, "SETTLEMENT_FAILED", f"transaction {tx_hash} reverted")
    return "reverted"
