"""Making the database tell the truth about the chain, whoever crashed.

The token's ``authorizationState(from, nonce)`` and its AuthorizationUsed/Canceled events are
the truth: an authorization that executed means the intent is paid, whatever our processes
managed to record before dying.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from enum import Enum
from typing import Any

import requests
from flask import current_app, has_app_context
from redis import Redis
from rq.timeouts import JobTimeoutException

from backend import appstate, clock
from backend.chains.evm import (
    AUTHORIZATION_USED_TOPIC,
    DEFAULT_LOG_BLOCK_RANGE,
    EvmChain,
    LogSearchIncomplete,
    authorization_transfer,
    evm_chain,
)
from backend.chains.registry import ChainRegistry, Network
from backend.chains.solana import SolanaRpcError, solana_chain
from backend.rails.evm.rail import EVM_RAIL
from backend.rails.evm.rail import EXPIRY_GRACE_SECONDS as EXPIRY_GRACE_SECONDS  # the watch's tests use it
from backend.rails.registry import rail_for
from backend.relaybudget import services as relaybudget
from backend.settlement import services
from backend.settlement.flow import enqueue_settlement, notify_settled
from backend.settlement.models import Settlement, settlement_terms
from backend.settlement.solana import finish_from_chain as finish_solana

log = logging.getLogger(__name__)
_EVM = EVM_RAIL  # the EVM finish-from-chain below moves into the rail in stage 2 (docs/architecture.md, "Rails")

# A settlement untouched this long is looked at by the reconciler.
STALE_AFTER = timedelta(seconds=30)
# The watch of released settlements (``watch_released``) visits at most this many per tick, for at most this long
# (each visit costs one or two RPC calls; the open settlements are handled first).
WATCH_PER_TICK = 50
WATCH_SECONDS_PER_TICK = 5.0
# The time one reconcile pass gives each chain (RECONCILE_CHAIN_SECONDS; see ``ChainPass``).
CHAIN_SECONDS_PER_PASS = 20.0
# One log search (``onchain_outcome``) runs at most this long unless its caller gives a deadline (the relayer's).
LOG_SEARCH_SECONDS = 20.0


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


def log_block_range() -> int:
    """RECONCILE_LOG_BLOCK_RANGE of the app in context (the worker's, the relayer's), else the default."""
    if has_app_context() and appstate.SETTINGS_KEY in current_app.config:
        return int(appstate.settings().reconcile_log_block_range)
    return DEFAULT_LOG_BLOCK_RANGE


def onchain_outcome(
    chain: EvmChain,
    settlement: Settlement,
    head: int | None = None,
    log_range: int | None = None,
    deadline: float | None = None,
) -> tuple[Outcome, str | None]:
    """What the chain says about the settlement's authorization: USED, USED_ELSEWHERE, CANCELED, NOT_FINAL
    or UNUSED.

    The height (``head``, unless given) is read first, and the state, the receipt and the log search are
    pinned to it: a log or receipt found is final only if it is buried under the confirmations at that
    height, so a reorg between the reads cannot pass for final, and a lagging RPC node cannot answer "unused"
    from an older state. A used nonce counts as this payment only if the same transaction moved this
    settlement's terms: the buyer may have signed the nonce again for something else.

    Our own transaction (``tx_hash``) is looked up first, by its receipt: no log search, which RPC providers
    limit. Only when it did not execute the authorization (none sent, reverted, not mined) are the token's
    logs searched, from the claim's height, in windows of ``log_range`` blocks (RECONCILE_LOG_BLOCK_RANGE;
    ``EvmChain.authorization_log``). An RPC error raises: it is never taken for "not found". A search still
    unfinished at ``deadline`` (``time.monotonic()``; by default LOG_SEARCH_SECONDS from now) is NOT_FINAL: the
    next look goes on from where it stopped (short of the newest blocks). A search that finished with no match
    is NOT_FINAL too, and the next look searches again from the claim's block (an RPC answered incompletely).
    """
    nonce = bytes.fromhex(settlement.nonce[2:])
    head = chain.block_number() if head is None else head
    if not chain.authorization_state(settlement.payer, nonce, head):
        return Outcome.UNUSED, None
    if settlement.tx_hash:
        receipt = chain.receipt(settlement.tx_hash)
        if receipt is not None and receipt.get("status") == 1 and _paid_this(chain, settlement, receipt, nonce):
            # Our transaction executed it with this settlement's terms: paid once its block is final at ``head``.
            final = chain.is_final(int(receipt["blockNumber"]), head)
            return (Outcome.USED if final else Outcome.NOT_FINAL), settlement.tx_hash
    if deadline is None:
        deadline = time.monotonic() + LOG_SEARCH_SECONDS
    try:
        found = chain.authorization_log(
            settlement.payer, nonce, (settlement.start_block or 0) - 5, head, log_range or log_block_range(), deadline
        )
    except LogSearchIncomplete as exc:
        log.info("settlement %s: log search out of time after block %d; goes on next time", settlement.id,
                 exc.searched_to)  # fmt: skip
        return Outcome.NOT_FINAL, None  # used (authorizationState says so) and not found yet: never released
    if found is None:
        # Used, but the log is out of our search range (or the RPC's log index lags: the search keeps no cursor,
        # so the next look asks every block again), and our own transaction did not execute it (yet): until the
        # transaction is found and final, the money may have moved: never release.
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
    return not _EVM.may_still_execute(settlement_terms(settlement), chain.block_timestamp(chain.final_block(head)))


def settle_from_chain(chain: EvmChain, settlement: Settlement, deadline: float | None = None) -> Outcome:
    """Finish the settlement if the chain has decided it (USED: paid; CANCELED, EXPIRED: failed, the
    intent released); NOT_FINAL and UNUSED leave it open. Returns the outcome. ``deadline``: of the log
    search (``onchain_outcome``)."""
    relaybudget.charge_evm_transaction(chain, settlement)  # our mined transaction's gas, once (before it is finished)
    head = chain.block_number()
    outcome, tx_hash = onchain_outcome(chain, settlement, head, deadline=deadline)
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


class ChainPass:
    """The time one reconcile pass gives each chain, so one slow or hung RPC cannot hold the others.

    A chain gets ``seconds`` of the pass (RECONCILE_CHAIN_SECONDS): once spent, its remaining settlements
    wait for the next pass (they are the least recently handled then). A chain whose RPC timed out or could
    not be reached is skipped for the rest of the pass: a hung RPC costs one call's timeout per pass, not one
    per settlement. Chains that were in trouble in the previous pass go last (``order``).
    """

    _troubled: set[str] = set()  # in trouble in this process's previous pass (the worker's memory, no more)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spent: dict[str, float] = {}
        self.down: set[str] = set()

    def order(self, settlements: list[Settlement]) -> list[Settlement]:
        return sorted(settlements, key=lambda s: s.network in ChainPass._troubled)  # stable: oldest first within

    def allows(self, network: str) -> bool:
        return network not in self.down and self.spent.get(network, 0.0) < self.seconds

    def deadline(self, network: str, started: float) -> float:
        """When the chain's time in this pass runs out, for work on it that began at ``started`` (a log search
        checks it between its windows: one settlement cannot overrun the chain's time)."""
        return started + max(self.seconds - self.spent.get(network, 0.0), 0.0)

    def charge(self, network: str, started: float, error: BaseException | None = None) -> None:
        self.spent[network] = self.spent.get(network, 0.0) + time.monotonic() - started
        if error is not None and _unreachable(error):
            self.down.add(network)

    def end(self) -> None:
        ChainPass._troubled = self.down | {n for n, spent in self.spent.items() if spent >= self.seconds}


def _unreachable(error: BaseException) -> bool:
    """A timeout or a connection that failed: the RPC, not this settlement, is in trouble."""
    if isinstance(error, SolanaRpcError):
        return error.unreachable
    return isinstance(error, requests.Timeout | requests.ConnectionError)


def watch_released(
    registry: ChainRegistry, limit: int = WATCH_PER_TICK, chains: ChainPass | None = None
) -> dict[str, int]:
    """Settlements released without executing (a revert, or their intent paid by another) may still
    execute until validBefore (their signature is out): if one does, the database follows the chain
    (the intent is paid, or the second payment is recorded as a duplicate).

    Watched until the chain has decided, not until a clock of ours runs out: a settlement leaves the
    watch when a check finds it executed (recorded), its nonce used by other terms or cancelled (final),
    or unused with the newest final block past validBefore (+ grace), so an execution seen late (an
    outage, a lagging RPC) is still recorded. Visited round-robin (least recently watched first), at
    most ``limit`` per tick and for at most ``WATCH_SECONDS_PER_TICK``: many released settlements can
    delay a late execution's record by a few ticks, never hide it. A chain ``chains`` (the pass's time
    per chain) has no time left for, or found unreachable, is skipped. Returns ``{"late": recorded,
    "watched": visited}``.
    """
    chains = chains or ChainPass(CHAIN_SECONDS_PER_PASS)
    found = visited = 0
    heads: dict[str, int] = {}
    final_times: dict[str, int] = {}
    deadline = time.monotonic() + WATCH_SECONDS_PER_TICK
    for settlement in services.watched_settlements(limit):
        if time.monotonic() > deadline:
            break  # the rest keep their turn: they are the least recently watched next tick
        if not chains.allows(settlement.network):
            continue  # keeps its turn: it is among the least recently watched next tick
        visited += 1
        services.mark_watched(settlement.id)  # to the back of the line, whatever this visit finds
        network = registry.get(settlement.network)
        if network is None:
            continue  # not configured now (it may come back): keep watching
        if not rail_for(network).released_may_execute():
            services.end_watch(settlement.id)  # a failed Solana transaction can never land again
            continue
        started = time.monotonic()
        error: BaseException | None = None
        try:
            chain = evm_chain(network)
            if network.network not in heads:
                heads[network.network] = chain.block_number()  # read before any state or log of this tick
            head = heads[network.network]
            outcome, tx_hash = onchain_outcome(
                chain, settlement, head, deadline=min(deadline, chains.deadline(network.network, started))
            )
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
                if not rail_for(network).may_still_execute(settlement_terms(settlement), final_times[network.network]):
                    services.end_watch(settlement.id)  # no block that can still join the chain may execute it
        except JobTimeoutException:
            raise  # RQ ends the job: not one settlement's error
        except Exception as exc:
            error = exc
            log.warning("could not watch settlement %s (%s)", settlement.id, type(exc).__name__)
        finally:
            chains.charge(network.network, started, error)
    return {"late": found, "watched": visited}


def reconcile(
    registry: ChainRegistry,
    redis: Redis | None,
    queue_name: str = "relayer",
    *,
    chain_seconds: float = CHAIN_SECONDS_PER_PASS,
) -> dict[str, int]:
    """Periodic: finish or re-send every settlement left open by a crash, a timeout or a lost job.

    Each chain gets ``chain_seconds`` of the pass (``ChainPass``): the settlements of a chain that is out of
    time or unreachable are ``deferred`` to the next pass, and the other chains are reconciled meanwhile.
    """
    chains = ChainPass(chain_seconds)
    counts = {"finished": 0, "resent": 0, "waiting": 0, "errors": 0, "deferred": 0}
    for settlement in chains.order(services.open_settlements(clock.now() - STALE_AFTER)):
        network = registry.get(settlement.network)
        if network is None:
            counts["errors"] += 1
            continue
        if not chains.allows(network.network):
            counts["deferred"] += 1  # untouched: the least recently handled, first of its chain next pass
            continue
        started = time.monotonic()
        error: BaseException | None = None
        try:
            deadline = chains.deadline(network.network, started)
            _reconcile_one(network, settlement, redis, queue_name, counts, enqueue_settlement, notify_settled, deadline)
        except JobTimeoutException:
            raise  # RQ ends the job (its timeout): not one settlement's error to log and go on from
        except Exception as exc:  # logged without the message: RPC errors carry the RPC URL
            error = exc
            log.warning("could not reconcile settlement %s (%s)", settlement.id, type(exc).__name__)
            counts["errors"] += 1
        finally:
            chains.charge(network.network, started, error)
    # After the open ones, bounded: the watch cannot hold them up.
    counts.update(watch_released(registry, chains=chains))
    chains.end()
    if chains.down:
        log.warning("reconcile: unreachable this pass, retried next pass: %s", ", ".join(sorted(chains.down)))
    return counts


def _reconcile_one(
    network: Network,
    settlement: Settlement,
    redis: Redis | None,
    queue_name: str,
    counts: dict[str, int],
    enqueue_settlement: Callable[..., None],
    notify_settled: Callable[..., None],
    deadline: float | None = None,
) -> None:
    if network.kind == "solana":
        finished = finish_solana(solana_chain(network), settlement)
    else:
        outcome = settle_from_chain(evm_chain(network), settlement, deadline)
        finished = outcome in FINISHED
        if outcome is Outcome.NOT_FINAL:
            # On chain but not final: nothing to send, nothing to release; look again later.
            services.touch(settlement.id)
            counts["waiting"] += 1
            return
    if finished:
        counts["finished"] += 1
        if redis is not None:
            notify_settled(redis, settlement.id)
        return
    if redis is not None:
        # Not executed and still valid: (re)send. Sending the same authorization twice is
        # harmless: the token executes a nonce once.
        services.touch(settlement.id)
        enqueue_settlement(redis, settlement.id, queue_name, settlement.network)
        counts["resent"] += 1
    else:
        counts["waiting"] += 1


__all__ = [
    "FINISHED",
    "ChainPass",
    "Outcome",
    "finish_from_chain",
    "onchain_outcome",
    "reconcile",
    "settle_from_chain",
    "watch_released",
]
