"""Making the database tell the truth about the chain, whoever crashed.

What the chain says about a settlement's terms is read by its rail (``Rail.read_outcome``: on EVM the token's
``authorizationState`` and its AuthorizationUsed/Canceled events, on Solana the relay's signature and the
blockhash's height); this module writes what it decides: an authorization that executed means the intent is
paid, whatever our processes managed to record before dying.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import requests
from redis import Redis
from rq.timeouts import JobTimeoutException

from backend import clock
from backend.chains.registry import ChainRegistry, Network
from backend.chains.solana import SolanaRpcError
from backend.rails.base import FINISHED as FINISHED
from backend.rails.base import Claim, Rail
from backend.rails.base import Outcome as Outcome
from backend.rails.registry import rail_for
from backend.relaybudget import services as relaybudget
from backend.settlement import services
from backend.settlement.flow import enqueue_settlement, notify_settled
from backend.settlement.models import Settlement, settlement_claim
from backend.settlement.solana import PayeeLedger

log = logging.getLogger(__name__)

# A settlement untouched this long is looked at by the reconciler.
STALE_AFTER = timedelta(seconds=30)
# The watch of released settlements (``watch_released``) visits at most this many per tick, for at most this long
# (each visit costs one or two RPC calls; the open settlements are handled first).
WATCH_PER_TICK = 50
WATCH_SECONDS_PER_TICK = 5.0
# The time one reconcile pass gives each chain (RECONCILE_CHAIN_SECONDS; see ``ChainPass``).
CHAIN_SECONDS_PER_PASS = 20.0
# failure_code of a settlement whose nonce another authorization of the payer used.
USED_ELSEWHERE_CODE = "AUTHORIZATION_USED_ELSEWHERE"
# The failure_code of each outcome that fails a settlement (the reason is the rail's ``ChainOutcome.detail``).
FAILURE_CODES = {
    Outcome.CANCELED: "AUTHORIZATION_CANCELED",
    Outcome.USED_ELSEWHERE: USED_ELSEWHERE_CODE,
    Outcome.FAILED: "SETTLEMENT_FAILED",
    Outcome.EXPIRED: "AUTHORIZATION_EXPIRED",
}
LEDGER = PayeeLedger()


class _RefundLedger(PayeeLedger):
    """A refund's: the buyer's account is never taken for a merchant's that was closed after payments landed (the
    merchant's wallet pays its rent if it is missing), and a refund landing there records nothing."""

    def landed_before(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> bool:
        return False

    def record_landed(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> None:
        return None


REFUND_LEDGER = _RefundLedger()


def ledger_for(claim: Claim) -> PayeeLedger:
    """The payee ledger the rail is handed for this claim: a refund's has no payee-account rule."""
    return REFUND_LEDGER if claim.pays_refund else LEDGER


def paid(rail: Rail, network: Network, claim: Claim, tx_id: str) -> bool:
    """Mark the claim's settlement paid in ``tx_id``, after what its rail records first (Solana: the payee
    account); False (left open) if that cannot be recorded now."""
    if not rail.before_paid(network, claim, ledger_for(claim)):
        return False
    services.complete_settlement(claim.settlement_id, tx_id)
    return True


def settle_from_chain(network: Network, settlement: Settlement, deadline: float | None = None) -> Outcome:
    """Finish the settlement if the chain has decided it (USED: paid; CANCELED, USED_ELSEWHERE, FAILED, EXPIRED:
    failed, the intent released); NOT_FINAL, PENDING and UNUSED leave it open. Returns the outcome (PENDING when
    a landed payment could not be recorded yet). ``deadline``: of a log search (``Rail.read_outcome``)."""
    rail = rail_for(network)
    claim = settlement_claim(settlement)
    result = rail.read_outcome(network, claim, deadline=deadline)
    if result.cost and claim.tx_id:  # our landed transaction's cost, once (before the settlement is finished)
        relaybudget.charge(settlement.merchant_id, settlement.network, rail.spend_kind, result.cost, claim.tx_id,
                           settlement.id)  # fmt: skip
    if result.outcome is Outcome.USED:
        if not paid(rail, network, claim, result.tx_id or ""):
            return Outcome.PENDING
    elif result.outcome in FAILURE_CODES:
        services.fail_settlement(settlement.id, FAILURE_CODES[result.outcome], result.detail)
    return result.outcome


def finish_from_chain(network: Network, settlement: Settlement) -> bool:
    """Finish the settlement if the chain has decided it; returns whether it is finished."""
    return settle_from_chain(network, settlement) in FINISHED


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
        if error is not None and rpc_unreachable(error):
            self.down.add(network)

    def end(self) -> None:
        ChainPass._troubled = self.down | {n for n, spent in self.spent.items() if spent >= self.seconds}


def rpc_unreachable(error: BaseException) -> bool:
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
    pins: dict[str, dict[str, int]] = {}  # per network: the height (and final block's time) read once this tick
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
        rail = rail_for(network)
        if not rail.released_may_execute():
            services.end_watch(settlement.id)  # a failed Solana transaction can never land again
            continue
        started = time.monotonic()
        error: BaseException | None = None
        try:
            claim = settlement_claim(settlement)
            result = rail.read_outcome(
                network,
                claim,
                deadline=min(deadline, chains.deadline(network.network, started)),
                pins=pins.setdefault(network.network, {}),
                with_cost=False,
            )
            if result.outcome is Outcome.USED and result.tx_id:
                if paid(rail, network, claim, result.tx_id):
                    services.end_watch(settlement.id)
                    found += 1
            elif result.outcome in FAILURE_CODES:
                # The nonce is spent without paying this settlement's terms (used by other terms, cancelled), or
                # unused with no block that can still join the chain able to execute it: it can never execute.
                # Nothing to record (a nonce consumed by a 0-value self-transfer is no second charge).
                services.end_watch(settlement.id)
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
    outcome = settle_from_chain(network, settlement, deadline)
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
    "reconcile",
    "settle_from_chain",
    "watch_released",
]
