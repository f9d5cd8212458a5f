"""Relay spending on a merchant's behalf: recorded in a ledger, bounded by a budget per network.

The relay pays to settle a merchant's payments: EVM gas (wei) and Solana transaction fees
(lamports). A merchant who can make it pay (by paying itself in a loop, say) would otherwise drain
the relay accounts that every merchant's payments need. So what the relay spends for each merchant
is recorded here, once per transaction, when the settlement finishes (``charge``); and ``check``
refuses a new payment of a merchant whose spending on that network over the last
``relay_budget_window_seconds`` reached the network's budget: ``429 RELAY_BUDGET_EXHAUSTED`` with
``Retry-After``, before anything is claimed or sent.

``check`` reads one indexed sum, cheap enough for every /pay. The bound is soft by the payments
already in flight when the budget runs out (each is recorded when it finishes): with N concurrent
payments the overshoot is at most N transactions.

Plain functions any relayer calls: ``check`` before it commits to a payment, ``charge`` once it
knows what a transaction cost (``evm_gas_cost`` of a receipt; a Solana fee is
``payintent.solana_tx.transaction_fee`` of the message).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from datetime import datetime, timedelta
from decimal import ROUND_FLOOR
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite

from backend import clock
from backend.chains.registry import Network
from backend.config import Settings
from backend.errors import APIError
from backend.extensions import db
from backend.observability.metrics import RELAY_BUDGET_REFUSALS
from backend.relaybudget.models import GAS, KINDS, RelaySpend

log = logging.getLogger(__name__)

SOLANA_DECIMALS = 9  # lamports per SOL: 10**9
_RETRY_SCAN_ROWS = 1000


def native_decimals(network: Network) -> int:
    return network.native_currency[2] if network.kind == "evm" else SOLANA_DECIMALS


def budget_atomic(network: Network, settings: Settings) -> int | None:
    """The budget per merchant per window on ``network``, in its smallest native unit; None: unlimited."""
    overrides = dict(settings.relay_budgets)
    if network.network in overrides:
        coins = overrides[network.network]
    else:
        coins = settings.relay_budget_evm if network.kind == "evm" else settings.relay_budget_solana
    if coins is None:
        return None
    return int(coins.scaleb(native_decimals(network)).to_integral_value(rounding=ROUND_FLOOR))


def window(settings: Settings) -> timedelta:
    return timedelta(seconds=settings.relay_budget_window_seconds)


def spent(merchant_id: str, network_id: str, since: datetime) -> int:
    """What the relay spent for the merchant on the network since ``since`` (smallest native unit)."""
    total = db.session.scalar(
        select(func.coalesce(func.sum(RelaySpend.amount_atomic), 0)).where(
            RelaySpend.merchant_id == merchant_id, RelaySpend.network == network_id, RelaySpend.created_at > since
        )
    )
    return int(total or 0)


def check(merchant_id: str, network: Network, settings: Settings) -> None:
    """Refuse (429 RELAY_BUDGET_EXHAUSTED, Retry-After) while the merchant's budget on ``network`` is used up."""
    budget = budget_atomic(network, settings)
    if budget is None:
        return
    now = clock.now()
    since = now - window(settings)
    used = spent(merchant_id, network.network, since)
    if used < budget:
        return
    RELAY_BUDGET_REFUSALS.labels(network.network).inc()
    retry_after = _retry_after(merchant_id, network.network, since, used - budget + 1, now, window(settings))
    log.warning("merchant %s: relay budget on %s used up (%d of %d)", merchant_id, network.network, used, budget)
    raise APIError(
        429,
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
    """Seconds until enough of the window's oldest spending has rolled out for the spent sum to fall below budget."""
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
    recorded = db.session.execute(statement).rowcount == 1
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


def evm_gas_cost(receipt: Mapping[str, Any]) -> int:
    """Wei a mined transaction cost its sender: gas used times the effective gas price, plus the L1
    data fee OP-stack chains (Base) add to the receipt."""

    def number(value: Any) -> int:
        if isinstance(value, str):
            return int(value, 16) if value.startswith("0x") else int(value)
        return int(value or 0)

    return number(receipt.get("gasUsed")) * number(receipt.get("effectiveGasPrice")) + number(receipt.get("l1Fee"))


def charge_evm_transaction(chain: Any, settlement: Any, receipt: Mapping[str, Any] | None = None) -> None:
    """Record the gas of the settlement's own transaction (``tx_hash``, sent from ``relay_address``)
    once it is mined, successful or reverted; nothing if it is not mined (yet) or not the relay's.

    ``chain`` needs ``receipt(tx_hash)``; pass ``receipt`` when it is at hand.
    """
    if not settlement.tx_hash or not settlement.relay_address:
        return
    if receipt is None:
        receipt = chain.receipt(settlement.tx_hash)
    if receipt is None or str(receipt.get("from") or "").lower() != settlement.relay_address.lower():
        return
    charge(settlement.merchant_id, settlement.network, GAS, evm_gas_cost(receipt), settlement.tx_hash, settlement.id)
