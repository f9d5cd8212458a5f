"""The relayer's job: submit one settlement's authorization and finish it from the chain.

Rules that keep it exactly once:
- one job at a time per settlement (a Redis lock held for the whole job);
- the chain is asked first (a retry may find the authorization already executed);
- nothing is sent for an intent that another settlement has already paid;
- a revert releases the intent only when none of our transactions for it can still be mined, our
  reverted transaction's block is final, and the authorization is not used on chain (final or not);
  the reconciler keeps watching such a settlement until the chain can no longer execute it;
- a nonce used by another authorization of the buyer (other terms) is not a payment: released;
- paid only once final: with confirmations > 1 the chain is asked again after the wait (a reorg).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

from eth_account.signers.local import LocalAccount
from redis import Redis
from solders.keypair import Keypair

from backend import appstate
from backend.chains.evm import EvmChain, evm_chain
from backend.chains.solana import solana_chain
from backend.errors import DomainError
from backend.extensions import db
from backend.intents.models import PAID, Intent
from backend.queueing import RedisNotConfigured, app_job, app_redis
from backend.rails.evm.terms import EvmTerms
from backend.relaybudget import services as relaybudget
from backend.relaybudget.models import GAS
from backend.settlement import models as st
from backend.settlement import services
from backend.settlement.flow import notify_settled
from backend.settlement.reconcile import FINISHED, Outcome, settle_from_chain
from relayer import evm, solana
from relayer.faults import crash_point

log = logging.getLogger(__name__)

RECEIPT_TIMEOUT_SECONDS = 120
# The per-settlement lock lives this long unless its holder renews it (every third of it), so a
# relayer that dies frees its settlements within seconds.
JOB_LOCK_SECONDS = 15
JOB_LOCK_KEY = "payintent:relayer:settling:{}"
# failure_code of a settlement whose payer has code when the relayer is about to send (docs/security.md).
PAYER_HAS_CODE = "PAYER_HAS_CODE"
PAYER_CODE_REASON = (
    "the payer's address has contract code (a smart wallet or an EIP-7702 delegation): the relay does not "
    "settle such authorizations; pay from a plain address"
)
# An authorization whose validAfter the chain's latest block has not passed yet (the token needs
# block.timestamp > validAfter) is waited for this long, then left open for the reconciler to send again.
NOT_YET_VALID_WAIT_SECONDS = 10.0
# Set by relayer.worker at start-up: the only place relay keys live.
RELAY_ACCOUNTS: dict[str, list[LocalAccount]] = {}
SOLANA_RELAYS: dict[str, Keypair] = {}


def _redis() -> Redis:
    """The relayer's Redis connection (one per process: ``app_redis`` keeps it on the app)."""
    redis = app_redis()
    if redis is None:
        raise RedisNotConfigured("the relayer needs REDIS_URL")
    return redis


@contextlib.contextmanager
def settlement_lock(redis: Redis, settlement_id: str) -> Iterator[bool]:
    """Hold the settlement for this job; yields False if another live relayer holds it."""
    key = JOB_LOCK_KEY.format(settlement_id)
    token = secrets.token_hex(8).encode()
    deadline = time.monotonic() + JOB_LOCK_SECONDS + 2  # a dead holder's lock expires by then
    while not redis.set(key, token, nx=True, ex=JOB_LOCK_SECONDS):
        if time.monotonic() > deadline:
            yield False
            return
        time.sleep(0.25)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(JOB_LOCK_SECONDS / 3):
            if redis.get(key) != token:
                return
            redis.expire(key, JOB_LOCK_SECONDS)

    renewer = threading.Thread(target=renew, name=f"lock-{settlement_id}", daemon=True)
    renewer.start()
    try:
        yield True
    finally:
        stop.set()
        renewer.join(timeout=2)
        if redis.get(key) == token:
            redis.delete(key)


@app_job
def settle(settlement_id: str) -> str:
    redis = _redis()
    with settlement_lock(redis, settlement_id) as held:
        if not held:
            return "already-being-settled"  # another relayer process is on it
        # An exception (an RPC hiccup) propagates: RQ retries the job and /pay keeps waiting.
        try:
            outcome = _settle(settlement_id, redis)
        except DomainError as err:  # a catalog error: a 5xx kind (CHAIN_UNAVAILABLE) is transient, the job retried
            (log.warning if err.http_status >= 500 else log.error)("settlement %s: %s %s", settlement_id, err.code, err)
            raise
    log.info("settlement %s: %s", settlement_id, outcome)
    notify_settled(redis, settlement_id)
    return outcome


def _settle(settlement_id: str, redis: Redis) -> str:
    settlement = services.get_settlement(settlement_id)
    if settlement is None or settlement.status not in st.OPEN:
        return "finished"
    network = appstate.chains().get(settlement.network)
    if network is not None and network.kind == "solana":
        relay = SOLANA_RELAYS.get(settlement.network)
        if relay is None:
            log.error("no relay keypair for %s; settlement %s waits", settlement.network, settlement_id)
            return "no-relay-account"
        return solana.settle(solana_chain(network), network, relay, settlement, crash_point)
    accounts = RELAY_ACCOUNTS.get(settlement.network)
    if network is None or not accounts:
        log.error("no relay account for %s; settlement %s waits", settlement.network, settlement_id)
        return "no-relay-account"
    chain = evm_chain(network)
    # A retry first asks the chain what already happened. A fresh settlement (never sent) skips it:
    # /pay has just read authorizationState, and if anyone executed it since, the gas estimate
    # reverts and _reverted asks the chain then.
    if settlement.status != st.PENDING:
        outcome = settle_from_chain(chain, settlement)
        if outcome in FINISHED:
            return "finished-from-chain"
        if outcome is Outcome.NOT_FINAL:
            return "waiting-for-confirmations"  # executed, not final: nothing to send; the reconciler finishes it
    if settlement.status == st.SUBMITTED and settlement.tx_hash:
        receipt = chain.receipt(settlement.tx_hash)
        if receipt is not None:
            return _finish(chain, settlement, settlement.tx_hash, receipt)
        if evm.is_pending(chain, settlement.tx_hash):
            return "still-pending"  # our earlier transaction may still be mined: never send a second one
    intent = db.session.get(Intent, settlement.intent_id, populate_existing=True)
    if intent is not None and intent.status == PAID and intent.settlement_id != settlement_id:
        services.fail_settlement(settlement_id, "ALREADY_PAID", "the intent was paid by another authorization")
        return "intent-already-paid"
    # /pay refused a payer with code, but code can appear since (an EIP-7702 delegation): look again, now,
    # right before the estimate and the send (the code's answer at estimate time proves nothing).
    if chain.has_code(settlement.payer):
        return _reverted(chain, settlement, PAYER_CODE_REASON, PAYER_HAS_CODE)
    # Not before the chain's clock passes validAfter: the transaction would revert (docs/security.md).
    terms = st.settlement_terms(settlement)
    assert isinstance(terms, EvmTerms)
    if not _valid_on_chain(chain, terms.valid_after):
        return "not-yet-valid"  # left open: the reconciler sends it again once it is STALE_AFTER old
    call = evm.transfer_call(chain, settlement)
    fees = evm.fees(chain)  # the estimate and the send use the same fee fields
    try:
        # Estimated from the leased account that then sends it, with its fees (evm.send).
        tx_hash = evm.send(
            redis,
            chain,
            accounts,
            call,
            fees,
            before_broadcast=lambda h, address: _submitted(settlement_id, h, address),
        )
    except evm.Refused as exc:
        # The node refused it for good: final, not retried (the chain still decides first, in _reverted).
        return _reverted(chain, services.get_settlement(settlement_id) or settlement, f"the node refused it: {exc}")
    except evm.Reverted as exc:  # the estimate, from the account that would send it
        latest = services.get_settlement(settlement_id) or settlement
        return _reverted(chain, latest, f"the transfer would revert: {exc}")
    except evm.NotYetValid:
        return "not-yet-valid"  # the node's clock disagrees with its latest block's: transient, left open
    except evm.RelayShortOfFunds as exc:
        # Our relay's trouble, never the payment's: left open (the reconciler sends it again) and said loudly.
        log.error("settlement %s waits: %s", settlement_id, exc)
        return "relay-short-of-eth"
    crash_point("after-broadcast")
    receipt = evm.wait_receipt(chain, tx_hash, RECEIPT_TIMEOUT_SECONDS)
    crash_point("before-finish")
    if receipt is None:
        return "waiting-for-receipt"  # the reconciler finishes it
    return _finish(chain, services.get_settlement(settlement_id) or settlement, tx_hash, receipt)


def _valid_on_chain(chain: EvmChain, valid_after: int) -> bool:
    """Whether the chain's latest block is past validAfter (then every later block is too), waiting for it up
    to NOT_YET_VALID_WAIT_SECONDS."""
    deadline = time.monotonic() + NOT_YET_VALID_WAIT_SECONDS
    while chain.block_timestamp("latest") <= valid_after:
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return True


def _submitted(settlement_id: str, tx_hash: str, relay_address: str) -> None:
    services.mark_submitted(settlement_id, tx_hash, relay_address)
    crash_point("after-mark-submitted")


def _finish(chain: EvmChain, settlement: st.Settlement, tx_hash: str, receipt: dict[str, Any]) -> str:
    # The gas our transaction cost, to the merchant's relay budget (reverted or not), before anything else.
    relaybudget.charge(settlement.merchant_id, settlement.network, GAS, relaybudget.evm_gas_cost(receipt), tx_hash,
                       settlement.id)  # fmt: skip
    if receipt.get("status") == 1:
        if chain.network.confirmations <= 1:
            services.complete_settlement(settlement.id, tx_hash)  # mined is final on this network
            return "confirmed"
        if not evm.wait_confirmations(chain, int(receipt["blockNumber"]), RECEIPT_TIMEOUT_SECONDS):
            return "waiting-for-confirmations"  # the reconciler finishes it once final
        # The chain's height passing the receipt's block proves nothing if a reorg dropped that block
        # while we waited: the chain decides again, with the log and its finality read now.
        outcome = settle_from_chain(chain, settlement)
        if outcome is Outcome.USED:
            return "confirmed"
        if outcome in FINISHED:
            return "finished-from-chain"
        return "waiting-for-confirmations" if outcome is Outcome.NOT_FINAL else "reorged-out"
    return _reverted(chain, settlement, f"transaction {tx_hash} reverted")


def _reverted(chain: EvmChain, settlement: st.Settlement, reason: str, code: str = "SETTLEMENT_FAILED") -> str:
    """A revert: the chain decides (someone may have executed or cancelled it); else release the intent.

    Not while our own transaction's revert is in a block that is not final: a reorg may still replace
    that block and mine our transaction alone, and then it succeeds, after the intent was released (and
    perhaps paid again). The revert is waited for up to its confirmations, then decided again.
    """
    for _ in range(2):
        head = chain.block_number()  # before the receipt: its block is final only if buried at this height
        receipt = chain.receipt(settlement.tx_hash) if settlement.tx_hash else None
        outcome = settle_from_chain(chain, settlement)
        if outcome in FINISHED:
            return "finished-from-chain"
        if outcome is Outcome.NOT_FINAL:
            return "waiting-for-confirmations"  # executed (by anyone), not final: never release it now
        if receipt is None:
            if settlement.tx_hash and evm.is_pending(chain, settlement.tx_hash):
                return "still-pending"
            break  # none of our transactions for it is mined or pending
        if receipt.get("status") == 1:
            return "waiting-for-confirmations"  # mined after all (a reorg): the chain decides once its log is final
        block = int(receipt["blockNumber"])
        if chain.is_final(block, head):
            break
        if not evm.wait_confirmations(chain, block, RECEIPT_TIMEOUT_SECONDS):
            return "waiting-for-confirmations"  # the reconciler sends it back to us; decided once final
    else:
        return "waiting-for-confirmations"  # the block moved under us while we waited: decide next time
    services.fail_settlement(settlement.id, code, reason)
    return "reverted" if code == "SETTLEMENT_FAILED" else code.lower()
