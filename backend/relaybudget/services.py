"""Relay spending on a merchant's behalf: recorded in a ledger, bounded by a budget per network.

The relay pays to settle a merchant's payments: EVM gas (wei) and Solana transaction fees
(lamports). A merchant who can make it pay (by paying itself in a loop, say) would otherwise drain
the relay accounts that every merchant's payments need. So what the relay spends for each merchant
is recorded here, once per transaction, when the settlement finishes (``charge``), and a payment is
admitted (``admit``) only if what is already committed on that network leaves room for it:

    spent in the last RELAY_BUDGET_WINDOW_SECONDS
      + open settlements (claimed, not finished) x the most one settlement can cost
      + this payment's most                                          <= the network's budget

else ``429 RELAY_BUDGET_EXHAUSTED`` with ``Retry-After``, before anything is claimed or sent. The
settlement claim runs ``admit`` inside its transaction under a lock per (merchant, network)
(``backend.settlement.services.claim``), so concurrent payments are admitted one after the other
and the relay spends at most the budget, as long as no settlement costs more than
``max_settlement_cost`` says (Solana: exact; EVM: an estimate from the relay's own limits and the
merchant's own history, never another merchant's, see there). A merchant also has at
most ``MAX_OPEN_SETTLEMENTS`` open settlements per network (``429 TOO_MANY_OPEN_SETTLEMENTS``),
budget or not: one merchant's backlog cannot hold the relay accounts every merchant needs.

Plain functions any relayer calls: ``charge`` once it knows what a transaction cost (the rails say:
``TxStatus.cost`` / ``ChainOutcome.cost``, as ``Rail.spend_kind``; EVM: ``evm_gas_cost`` of a receipt,
``rails.evm.watch.gas_cost``; Solana: ``payintent.solana_tx.transaction_fee`` of the message).
"""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta
from decimal import ROUND_FLOOR

from sqlalchemy import bindparam, func, select
from sqlalchemy.dialects import postgresql, sqlite

from backend import clock
from backend.chains.registry import Network
from backend.config import Settings
from backend.errors import DomainError
from backend.extensions import UTCDateTime, db, rowcount
from backend.rails.evm.watch import gas_cost as evm_gas_cost  # noqa: F401  (tests and tools use the name)
from backend.rails.registry import rail_for
from backend.relaybudget.metrics import OPEN_SETTLEMENT_REFUSALS, RELAY_BUDGET_REFUSALS
from backend.relaybudget.models import KINDS, RelaySpend

log = logging.getLogger(__name__)

_RETRY_SCAN_ROWS = 1000


def native_decimals(network: Network) -> int:
    return rail_for(network).native_decimals(network)


def budget_atomic(network: Network, settings: Settings) -> int | None:
    """The budget per merchant per window on ``network``, in its smallest native unit; None: unlimited."""
    overrides = dict(settings.relay_budgets)
    if network.network in overrides:
        coins = overrides[network.network]
    else:
        coins = rail_for(network).relay_budget_coins(settings)
    if coins is None:
        return None
    return int(coins.scaleb(native_decimals(network)).to_integral_value(rounding=ROUND_FLOOR))


def window(settings: Settings) -> timedelta:
    return timedelta(seconds=settings.relay_budget_window_seconds)


# The merchant's spending on a network in the window: its sum (admit) and its largest charge (the EVM estimate).
# Built once on the table (each /pay runs both, in and before its claim): no expression building per call.
_SPENDING = RelaySpend.__table__
_IN_WINDOW = (
    _SPENDING.c.merchant_id == bindparam("merchant_id"),
    _SPENDING.c.network == bindparam("network"),
    _SPENDING.c.created_at > bindparam("since", type_=UTCDateTime()),
)
_SPENT = select(func.coalesce(func.sum(_SPENDING.c.amount_atomic), 0)).where(*_IN_WINDOW)
_LARGEST_CHARGE = select(func.max(_SPENDING.c.amount_atomic)).where(*_IN_WINDOW)


def spent(merchant_id: str, network_id: str, since: datetime) -> int:
    """What the relay spent for the merchant on the network since ``since`` (smallest native unit)."""
    total = db.session.scalar(_SPENT, {"merchant_id": merchant_id, "network": network_id, "since": since})
    return int(total or 0)


# Where a refusal happened, for the refusal metrics: /pay (a signed payment) or the public Solana
# transaction call (anyone may make it refuse, so only "pay" is a signal of an attack).
PAY = "pay"
PREPARE = "prepare"

# How far the merchant's own recorded charges may raise its EVM estimate above the gas bound at today's price.
EVM_HISTORY_CAP = 4
# Retry-After when only settlements in flight block a payment (they finish within seconds to minutes).
IN_FLIGHT_RETRY_SECONDS = 30


def max_settlement_cost(network: Network, settings: Settings, merchant_id: str) -> int:
    """The most one of the merchant's settlements on ``network`` costs the relay, in its smallest native unit.

    Solana: exact, two signatures and the largest priority fee the rules let a buyer sign
    (``payintent.solana_tx.MAX_TRANSACTION_FEE``, 10,500 lamports).

    EVM: an estimate that needs no RPC call per payment (the gas price is read at most every
    ``COST_CACHE_SECONDS`` per network and process). Its floor is what the relay's own limits allow:
    ``EVM_SETTLEMENT_GAS`` at twice the node's gas price (the relayer's fee cap is twice the base fee
    plus the tip). What those limits do not bound (an OP-stack chain's L1 data fee, a rise of the base
    fee since the price was read) is learned from **this merchant's own** charges in the window, up to
    ``EVM_HISTORY_CAP`` times the floor:

    - never another merchant's: one merchant's costly settlement (a fee spike, a payer whose code burns
      gas) would otherwise raise every merchant's cost and reservations on the network for the whole
      window, and refuse all their payments (hostile review F3);
    - capped: a charge far above the floor is a past spike, not what the next settlement costs (the
      charge itself is in the merchant's spending anyway); it must not hold the merchant's own
      reservations up for a day after fees came down.

    So the budget can be passed by what a settlement costs above the estimate (a new merchant's first
    settlements on an L1-fee chain, a spike), once per open settlement: ``MAX_OPEN_SETTLEMENTS`` bounds
    it, and the real cost is charged when the settlement finishes. Raises 503 CHAIN_UNAVAILABLE if the
    gas price cannot be read and none was read before.
    """
    rail = rail_for(network)
    floor = rail.cost_floor(network)  # EVM_SETTLEMENT_GAS at twice the gas price (rails.evm); Solana: exact
    if not rail.cost_learned_from_history():
        return floor
    recorded = db.session.scalar(
        _LARGEST_CHARGE,
        {"merchant_id": merchant_id, "network": network.network, "since": clock.now() - window(settings)},
    )
    return max(floor, min(int(recorded or 0), EVM_HISTORY_CAP * floor))


def admit(
    merchant_id: str,
    network: Network,
    settings: Settings,
    *,
    cost: int,
    open_settlements: int,
    open_cost: int,
    endpoint: str = PAY,
) -> None:
    """Refuse a payment (429, Retry-After) unless the merchant may commit the relay to one more settlement.

    ``cost``: the most this payment costs the relay; ``open_settlements``: the merchant's settlements on
    the network that are claimed and not finished, each reserving ``open_cost``. Refuses
    TOO_MANY_OPEN_SETTLEMENTS at ``settings.max_open_settlements`` open ones, and
    RELAY_BUDGET_EXHAUSTED when spent + reserved + ``cost`` would pass the budget. Race-free only when
    the caller holds the (merchant, network) claim lock (``settlement.services.claim`` does).
    """
    cap = settings.max_open_settlements
    if cap and open_settlements >= cap:
        OPEN_SETTLEMENT_REFUSALS.labels(network.network, endpoint).inc()
        log.warning("merchant %s: %d settlements open on %s (the cap)", merchant_id, open_settlements, network.network)
        raise DomainError(
            "TOO_MANY_OPEN_SETTLEMENTS",
            f"This merchant has {open_settlements} payments on {network.name} still settling, the most allowed; "
            f"try again once they finish",
            headers={"Retry-After": str(IN_FLIGHT_RETRY_SECONDS)},
            network=network.network,
            retry_after=IN_FLIGHT_RETRY_SECONDS,
        )
    budget = budget_atomic(network, settings)
    if budget is None:
        return
    now = clock.now()
    since = now - window(settings)
    used = spent(merchant_id, network.network, since)
    reserved = open_settlements * open_cost
    if used + reserved + cost <= budget:
        return
    RELAY_BUDGET_REFUSALS.labels(network.network, endpoint).inc()
    if used + cost <= budget:  # only the settlements in flight stand in the way: they finish soon
        retry_after = IN_FLIGHT_RETRY_SECONDS
    else:
        retry_after = _retry_after(merchant_id, network.network, since, used + cost - budget, now, window(settings))
    log.warning(
        "merchant %s: relay budget on %s used up (%d spent, %d reserved by %d open settlements, %d more asked, "
        "budget %d; %s)",
        merchant_id, network.network, used, reserved, open_settlements, cost, budget, endpoint,
    )  # fmt: skip
    raise DomainError(
        "RELAY_BUDGET_EXHAUSTED",
        f"This merchant cannot take more payments on {network.name} for now (the service's budget for network "
        f"fees on its behalf is used up); try again later or pay on another network",
        headers={"Retry-After": str(retry_after)},
        network=network.network,
        retry_after=retry_after,
    )


def _retry_after(
    merchant_id: str, network_id: str, since: datetime, excess: int, now: datetime, span: timedelta
) -> int:
    """Seconds until enough of the window's oldest spending (``excess``) has rolled out to leave room."""
    rows = db.session.execute(
        select(RelaySpend.created_at, RelaySpend.amount_atomic)
        .where(RelaySpend.merchant_id == merchant_id, RelaySpend.network == network_id, RelaySpend.created_at > since)
        .order_by(RelaySpend.created_at)
        .limit(_RETRY_SCAN_ROWS)
    )
    freed = 0
    for created_at, amount in rows:
        freed += amount
        if freed >= excess:
            return max(1, math.ceil((created_at + span - now).total_seconds()))
    return max(1, math.ceil(span.total_seconds()))


def charge(
    merchant_id: str,
    network_id: str,
    kind: str,
    amount_atomic: int,
    reference: str,
    settlement_id: str | None = None,
) -> bool:
    """Record that the relay paid ``amount_atomic`` for the merchant in transaction ``reference``.

    Idempotent: a (network, reference, kind) is recorded once, whoever reports it first (the
    relayer, the reconciler). Returns whether this call recorded it. Commits.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown relay spending kind {kind!r}")
    if amount_atomic <= 0 or not reference:
        return False
    values = {
        "merchant_id": merchant_id,
        "network": network_id,
        "kind": kind,
        "amount_atomic": int(amount_atomic),
        "reference": reference,
        "settlement_id": settlement_id,
        "created_at": clock.now(),
    }
    dialect = postgresql if db.engine.dialect.name == "postgresql" else sqlite
    statement = (
        dialect.insert(RelaySpend)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["network", "reference", "kind"])
    )
    recorded = rowcount(db.session.execute(statement)) == 1
    db.session.commit()
    return recorded


def totals() -> dict[tuple[str, str], int]:
    """Everything the relay spent, by (network, kind) (for /metrics)."""
    rows = db.session.execute(
        select(RelaySpend.network, RelaySpend.kind, func.sum(RelaySpend.amount_atomic)).group_by(
            RelaySpend.network, RelaySpend.kind
        )
    )
    return {(network, kind): int(total or 0) for network, kind, total in rows}
