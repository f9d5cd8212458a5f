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
# A released authorization is watched this long past its validBefore (+ grace): one that executed just before
# validBefore needs its confirmations before it counts, and the watch must still be looking then.
FINALITY_WATCH_SECONDS = 3600


class Outcome(Enum):
    USED = "used"  # executed, under the network's confirmations: the money moved
    CANCELED = "canceled"  # the buyer cancelled it, under the network's confirmations: it can never execute
    # Executed or cancelled on chain, but not final yet (or its transaction not found yet). A reorg may
    # still undo it, so it is neither paid nor released: the claim is kept until the chain decides.
    NOT_FINAL = "not-final"
    UNUSED = "unused"  # not (yet) executed
    EXPIRED = "expired"  # unused, and no block that could still execute it can be final: it never will


# The outcomes that finish a settlement (see ``settle_from_chain``).
FINISHED = (Outcome.USED, Outcome.CANCELED, Outcome.EXPIRED)


def onchain_outcome(chain: EvmChain, settlement: Settlement, head: int | None = None) -> tuple[Outcome, str | None]:
    """What the chain says about the settlement's authorization: USED, CANCELED, NOT_FINAL or UNUSED.

    The height (``head``, unless given) is read first: a log or receipt found afterwards is final
    only if it is buried under the confirmations at that height, so a reorg between the reads
    cannot pass for final.
    """
    nonce = bytes.fromhex(settlement.nonce[2:])
    head = chain.block_number() if head is None else head
    if not chain.authorization_state(settlement.payer, nonce):
        return Outcome.UNUSED, None
    found = chain.authorization_log(settlement.payer, nonce, (settlement.start_block or 0) - 5)
    if found is None:
        # Used, but the log is out of our search range (or the RPC's log index lags): only our own
        # mined transaction will do. Until it is found and final, the money may have moved: never release.
        receipt = chain.receipt(settlement.tx_hash) if settlement.tx_hash else None
        if receipt is not None and receipt.get("status") == 1 and chain.is_final(int(receipt["blockNumber"]), head):
            return Outcome.USED, settlement.tx_hash
        log.warning("settlement %s: authorization used but its final transaction was not found yet", settlement.id)
        return Outcome.NOT_FINAL, None
    topic, tx_hash, block_number = found
    if not chain.is_final(block_number, head):
        return Outcome.NOT_FINAL, tx_hash  # executed (or cancelled), but a reorg may still undo it
    return (Outcome.USED if topic == AUTHORIZATION_USED_TOPIC else Outcome.CANCELED), tx_hash


def can_never_execute(chain: EvmChain, settlement: Settlement, head: int) -> bool:
    """Whether an authorization found unused (after reading ``head``) can never execute any more.

    The token executes it only in a block with ``timestamp < validBefore``. Once the newest final
    block (at ``head``) is past validBefore (+ grace), every block that is or can still become part
    of the chain comes after it and is later still: no reorg can bring back a block that executes it.
    """
    return chain.block_timestamp(chain.final_block(head)) > settlement.valid_before + EXPIRY_GRACE_SECONDS


def settle_from_chain(chain: EvmChain, settlement: Settlement) -> Outcome:
    """Finish the settlement if the chain has decided it (USED: paid; CANCELED, EXPIRED: failed, the
    intent released); NOT_FINAL and UNUSED leave it open. Returns the outcome."""
    relaybudget.charge_evm_transaction(chain, settlement)  # our mined transaction's gas, once (before it is finished)
    head = chain.block_number()
    outcome, tx_hash = onchain_outcome(chain, settlement, head)
    if outcome is Outcome.USED:
        services.complete_settlement(settlement.id, tx_hash or "")
    elif outcome is Outcome.CANCELED:
        services.fail_settlement(settlement.id, "AUTHORIZATION_CANCELED", "the buyer cancelled the authorization")
    elif outcome is Outcome.UNUSED and can_never_execute(chain, settlement, head):
        services.fail_settlement(
            settlement.id, "AUTHORIZATION_EXPIRED", "the authorization expired before it could be executed"
        )
        return Outcome.EXPIRED
    return outcome


def finish_from_chain(chain: EvmChain, settlement: Settlement) -> bool:
    """Finish the settlement if the chain has decided it; returns whether it is finished."""
    return settle_from_chain(chain, settlement) in FINISHED


def watch_released(registry: ChainRegistry) -> int:
    """Settlements released without executing (a revert, or their intent paid by another) may still
    execute until validBefore (their signature is out): if one does, the database follows the chain
    (the intent is paid, or the second payment is recorded as a duplicate). Watched until the blocks
    that could hold such an execution are final."""
    found = 0
    since = int(clock.now().timestamp()) - EXPIRY_GRACE_SECONDS - FINALITY_WATCH_SECONDS
    for settlement in services.released_but_valid(since):
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
                outcome = settle_from_chain(evm_chain(network), settlement)
                finished = outcome in FINISHED
                if outcome is Outcome.NOT_FINAL:
                    # On chain but not final: nothing to send, nothing to release; look again later.
                    services.touch(settlement.id)
                    counts["waiting"] += 1
                    continue
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


__all__ = ["FINISHED", "Outcome", "finish_from_chain", "onchain_outcome", "reconcile", "settle_from_chain"]
