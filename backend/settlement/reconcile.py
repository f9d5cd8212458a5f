"""Making the database tell the truth about the chain, whoever crashed.

The token's ``authorizationState(from, nonce)`` and its AuthorizationUsed/Canceled events are
the truth: an authorization that executed means the intent is paid, whatever our processes
managed to record before dying.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from enum import Enum

from redis import Redis

from backend import clock
from backend.chains.evm import AUTHORIZATION_USED_TOPIC, EvmChain, evm_chain
from backend.chains.registry import ChainRegistry
from backend.relaybudget import services as relaybudget
from backend.settlement import services
from backend.settlement.models import Settlement

log = logging.getLogger(__name__)

# A settlement untouched this long is looked at by the reconciler.
STALE_AFTER = timedelta(seconds=30)
# Chain clocks and ours may differ: give up on an unexecuted authorization only this long after validBefore.
EXPIRY_GRACE_SECONDS = 60


class Outcome(Enum):
    USED = "used"  # executed: the money moved
    CANCELED = "canceled"  # the buyer cancelled it: it can never execute
    UNUSED = "unused"  # not (yet) executed


def onchain_outcome(chain: EvmChain, settlement: Settlement) -> tuple[Outcome, str | None]:
    nonce = bytes.fromhex(settlement.nonce[2:])
    if not chain.authorization_state(settlement.payer, nonce):
        return Outcome.UNUSED, None
    found = chain.authorization_log(settlement.payer, nonce, (settlement.start_block or 0) - 5)
    if found is None:
        # Used, but the log is out of our search range: only our own mined transaction will do.
        receipt = chain.receipt(settlement.tx_hash) if settlement.tx_hash else None
        if receipt is not None and receipt.get("status") == 1:
            return Outcome.USED, settlement.tx_hash
        log.warning("settlement %s: authorization used but its transaction was not found yet", settlement.id)
        return Outcome.UNUSED, None
    topic, tx_hash, block_number = found
    if topic == AUTHORIZATION_USED_TOPIC and not chain.is_final(block_number):
        return Outcome.UNUSED, None  # executed, but not yet under enough confirmations
    return (Outcome.USED if topic == AUTHORIZATION_USED_TOPIC else Outcome.CANCELED), tx_hash


def finish_from_chain(chain: EvmChain, settlement: Settlement) -> bool:
    """Finish the settlement if the chain has decided it; returns whether it is finished."""
    relaybudget.charge_evm_transaction(chain, settlement)  # our mined transaction's gas, once (before it is finished)
    outcome, tx_hash = onchain_outcome(chain, settlement)
    if outcome is Outcome.USED:
        services.complete_settlement(settlement.id, tx_hash or "")
        return True
    if outcome is Outcome.CANCELED:
        services.fail_settlement(settlement.id, "AUTHORIZATION_CANCELED", "the buyer cancelled the authorization")
        return True
    if chain.block_timestamp() > settlement.valid_before + EXPIRY_GRACE_SECONDS:
        services.fail_settlement(
            settlement.id, "AUTHORIZATION_EXPIRED", "the authorization expired before it could be executed"
        )
        return True
    return False


def watch_released(registry: ChainRegistry) -> int:
    """Settlements failed on a revert may still execute until validBefore (their signature is out):
    if one does, the database follows the chain and the intent is paid."""
    found = 0
    for settlement in services.released_but_valid(int(clock.now().timestamp()) - EXPIRY_GRACE_SECONDS):
        network = registry.get(settlement.network)
        if network is None or network.kind != "evm":
            continue
        try:
            outcome, tx_hash = onchain_outcome(evm_chain(network), settlement)
        except Exception as exc:
            log.warning("could not watch settlement %s (%s)", settlement.id, type(exc).__name__)
            continue
        if outcome is Outcome.USED and tx_hash:
            services.complete_settlement(settlement.id, tx_hash)
            found += 1
    return found


def reconcile(registry: ChainRegistry, redis: Redis | None, queue_name: str = "relayer") -> dict[str, int]:
    """Periodic: finish or re-send every settlement left open by a crash, a timeout or a lost job."""
    from backend.settlement.flow import enqueue_settlement, notify_settled

    counts = {"finished": 0, "resent": 0, "waiting": 0, "errors": 0, "late": watch_released(registry)}
    for settlement in services.open_settlements(clock.now() - STALE_AFTER):
        network = registry.get(settlement.network)
        if network is None:
            counts["errors"] += 1
            continue
        try:
            if network.kind == "solana":
                from backend.settlement.solana import finish_from_chain as finish_solana
                from backend.settlement.solana import solana_chain

                finished = finish_solana(solana_chain(network), settlement)
            else:
                finished = finish_from_chain(evm_chain(network), settlement)
            if finished:
                counts["finished"] += 1
                if redis is not None:
                    notify_settled(redis, settlement.id)
                continue
            if redis is not None:
                # Not executed and still valid: (re)send. Sending the same authorization twice is
                # harmless: the token executes a nonce once.
                services.touch(settlement.id)
                enqueue_settlement(redis, settlement.id, queue_name, settlement.network)
                counts["resent"] += 1
            else:
                counts["waiting"] += 1
        except Exception as exc:  # logged without the message: RPC errors carry the RPC URL
            log.warning("could not reconcile settlement %s (%s)", settlement.id, type(exc).__name__)
            counts["errors"] += 1
    return counts


__all__ = ["Outcome", "finish_from_chain", "onchain_outcome", "reconcile"]
