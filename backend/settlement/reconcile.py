"""Making the database tell the truth about the chain, whoever crashed.

The token's ``authorizationState(from, nonce)`` and its AuthorizationUsed/Canceled events are
the truth: an authorization that executed means the intent is paid, whatever our processes
managed to record before dying.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from enum import Enum
from typing import Any

from redis import Redis

from backend import clock
from backend.chains.evm import AUTHORIZATION_USED_TOPIC, EvmChain, authorization_transfer, evm_chain
from backend.chains.registry import ChainRegistry
from backend.relaybudget import services as relaybudget
from backend.settlement import services
from backend.settlement.models import Settlement

log = logging.getLogger(__name__)

# A settlement untouched this long is looked at by the reconciler.
STALE_AFTER = timedelta(seconds=30)
# Chain clocks and ours may differ: give up on an unexecuted authorization only this long after validBefore.
EXPIRY_GRACE_SECONDS = 60
# The watch of released settlements (``watch_released``) visits at most this many per tick, for at most this long
# (each visit costs one or two RPC calls; the open settlements are handled first).
WATCH_PER_TICK = 50
WATCH_SECONDS_PER_TICK = 5.0


class Outcome(Enum):
    USED = "used"  # executed with this settlement's terms, under the network's confirmations: the merchant was paid
    CANCELED = "canceled"  # the buyer cancelled it, under the network's confirmations: it can never execute
    # The payer's nonce was used, under the network's confirmations, by ANOTHER authorization (other recipient
    # or amount, signed with the same nonce): this one can never execute, and the merchant got nothing from it.
    USED_ELSEWHERE = "used-elsewhere"
    # Executed or cancelled on chain, but not final yet (or its transaction not found yet). A reorg may
    # still undo it, so it is neither paid nor released: the claim is kept until the chain decides.
    NOT_FINAL = "not-final"
    UNUSED = "unused"  # not (yet) executed
    EXPIRED = "expired"  # unused, and no block that could still execute it can be final: it never will


# The outcomes that finish a settlement (see ``settle_from_chain``).
FINISHED = (Outcome.USED, Outcome.CANCELED, Outcome.USED_ELSEWHERE, Outcome.EXPIRED)
# failure_code of a settlement whose nonce another authorization of the payer used.
USED_ELSEWHERE_CODE = "AUTHORIZATION_USED_ELSEWHERE"


def _paid_this(chain: EvmChain, settlement: Settlement, receipt: dict[str, Any], nonce: bytes) -> bool | None:
    """Whether the authorization that used the nonce in ``receipt`` moved exactly the settlement's terms
    (payer -> pay_to, amount); None if the receipt does not show what it moved."""
    moved = authorization_transfer(receipt, chain.token.address, settlement.payer, nonce)
    if moved is None:
        return None
    to, value = moved
    return to.lower() == settlement.pay_to.lower() and value == settlement.amount_atomic


def onchain_outcome(chain: EvmChain, settlement: Settlement, head: int | None = None) -> tuple[Outcome, str | None]:
    """What the chain says about the settlement's authorization: USED, USED_ELSEWHERE, CANCELED, NOT_FINAL
    or UNUSED.

    The height (``head``, unless given) is read first, and the state and the log search are pinned to
    it: a log or receipt found is final only if it is buried under the confirmations at that height,
    so a reorg between the reads cannot pass for final, and a lagging RPC node cannot answer "unused"
    from an older state. A used nonce counts as this payment only if the same transaction moved this
    settlement's terms: the buyer may have signed the nonce again for something else.
    """
    nonce = bytes.fromhex(settlement.nonce[2:])
    head = chain.block_number() if head is None else head
    if not chain.authorization_state(settlement.payer, nonce, head):
        return Outcome.UNUSED, None
    found = chain.authorization_log(settlement.payer, nonce, (settlement.start_block or 0) - 5, head)
    if found is None:
        # Used, but the log is out of our search range (or the RPC's log index lags): only our own
        # mined transaction will do. Until it is found and final, the money may have moved: never release.
        receipt = chain.receipt(settlement.tx_hash) if settlement.tx_hash else None
        if (
            receipt is not None
            and receipt.get("status") == 1
            and chain.is_final(int(receipt["blockNumber"]), head)
            and _paid_this(chain, settlement, receipt, nonce)
        ):
            return Outcome.USED, settlement.tx_hash
        log.warning("settlement %s: authorization used but its final transaction was not found yet", settlement.id)
        return Outcome.NOT_FINAL, None
    topic, tx_hash, block_number = found
    if not chain.is_final(block_number, head):
        return Outcome.NOT_FINAL, tx_hash  # executed (or cancelled), but a reorg may still undo it
    if topic != AUTHORIZATION_USED_TOPIC:
        return Outcome.CANCELED, tx_hash
    receipt = chain.receipt(tx_hash)
    if receipt is None or int(receipt["blockNumber"]) != block_number:
        log.warning("settlement %s: the receipt of %s is not (or elsewhere) on this node yet", settlement.id, tx_hash)
        return Outcome.NOT_FINAL, tx_hash  # a lagging node or a reorg under way: look again
    paid = _paid_this(chain, settlement, receipt, nonce)
    if paid is None:
        # Not the token's layout (AuthorizationUsed, then its Transfer): we cannot tell what moved, so neither
        # pay (the merchant may have nothing) nor release (the buyer may have paid): an operator must look.
        log.error("settlement %s: cannot read what %s moved; left claimed", settlement.id, tx_hash)
        return Outcome.NOT_FINAL, tx_hash
    return (Outcome.USED if paid else Outcome.USED_ELSEWHERE), tx_hash


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
    elif outcome is Outcome.USED_ELSEWHERE:
        services.fail_settlement(
            settlement.id,
            USED_ELSEWHERE_CODE,
            f"the buyer's nonce was used by another authorization (other recipient or amount) in {tx_hash}; "
            "this one can never execute and the merchant received nothing from it",
        )
    elif outcome is Outcome.UNUSED and can_never_execute(chain, settlement, head):
        services.fail_settlement(
            settlement.id, "AUTHORIZATION_EXPIRED", "the authorization expired before it could be executed"
        )
        return Outcome.EXPIRED
    return outcome


def finish_from_chain(chain: EvmChain, settlement: Settlement) -> bool:
    """Finish the settlement if the chain has decided it; returns whether it is finished."""
    return settle_from_chain(chain, settlement) in FINISHED


def watch_released(registry: ChainRegistry, limit: int = WATCH_PER_TICK) -> dict[str, int]:
    """Settlements released without executing (a revert, or their intent paid by another) may still
    execute until validBefore (their signature is out): if one does, the database follows the chain
    (the intent is paid, or the second payment is recorded as a duplicate).

    Watched until the chain has decided, not until a clock of ours runs out: a settlement leaves the
    watch when a check finds it executed (recorded), its nonce used by other terms or cancelled (final),
    or unused with the newest final block past validBefore (+ grace), so an execution seen late (an
    outage, a lagging RPC) is still recorded. Visited round-robin (least recently watched first), at
    most ``limit`` per tick and for at most ``WATCH_SECONDS_PER_TICK``: many released settlements can
    delay a late execution's record by a few ticks, never hide it. Returns ``{"late": recorded,
    "watched": visited}``.
    """
    found = visited = 0
    heads: dict[str, int] = {}
    final_times: dict[str, int] = {}
    deadline = time.monotonic() + WATCH_SECONDS_PER_TICK
    for settlement in services.watched_settlements(limit):
        if time.monotonic() > deadline:
            break  # the rest keep their turn: they are the least recently watched next tick
        visited += 1
        services.mark_watched(settlement.id)  # to the back of the line, whatever this visit finds
        network = registry.get(settlement.network)
        if network is None:
            continue  # not configured now (it may come back): keep watching
        if network.kind != "evm":
            services.end_watch(settlement.id)  # a failed Solana transaction can never land again
            continue
        try:
            chain = evm_chain(network)
            if network.network not in heads:
                heads[network.network] = chain.block_number()  # read before any state or log of this tick
            head = heads[network.network]
            outcome, tx_hash = onchain_outcome(chain, settlement, head)
            if outcome is Outcome.USED and tx_hash:
                services.complete_settlement(settlement.id, tx_hash)
                services.end_watch(settlement.id)
                found += 1
            elif outcome in (Outcome.CANCELED, Outcome.USED_ELSEWHERE):
                # The nonce is spent without paying this settlement's terms: it can never execute. Nothing
                # to record (a nonce consumed by a 0-value self-transfer is no second charge).
                services.end_watch(settlement.id)
            elif outcome is Outcome.UNUSED:
                if network.network not in final_times:
                    final_times[network.network] = chain.block_timestamp(chain.final_block(head))
                if final_times[network.network] > settlement.valid_before + EXPIRY_GRACE_SECONDS:
                    services.end_watch(settlement.id)  # no block that can still join the chain may execute it
        except Exception as exc:
            log.warning("could not watch settlement %s (%s)", settlement.id, type(exc).__name__)
    return {"late": found, "watched": visited}


def reconcile(registry: ChainRegistry, redis: Redis | None, queue_name: str = "relayer") -> dict[str, int]:
    """Periodic: finish or re-send every settlement left open by a crash, a timeout or a lost job."""
    from backend.settlement.flow import enqueue_settlement, notify_settled

    counts = {"finished": 0, "resent": 0, "waiting": 0, "errors": 0}
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
    counts.update(watch_released(registry))  # after the open ones, bounded: the watch cannot hold them up
    return counts


__all__ = [
    "FINISHED",
    "Outcome",
    "finish_from_chain",
    "onchain_outcome",
    "reconcile",
    "settle_from_chain",
    "watch_released",
]
