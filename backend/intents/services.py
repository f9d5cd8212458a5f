"""Payment-intent rules as plain functions: create, read, list, cancel, expire.

Every status change is a conditional ``UPDATE ... WHERE status = 'pending'`` so that two
actors (a cancel and the expiry sweep, later a settlement) can never both win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select, update

from backend import clock
from backend.chains.registry import ChainRegistry, Network
from backend.errors import APIError, not_found
from backend.events.services import record_event
from backend.extensions import db
from backend.ids import intent_id as new_intent_id
from backend.intents.models import CANCELLED, EXPIRED, PENDING, Intent
from backend.merchants.models import Wallet
from backend.money import from_atomic, to_atomic

INTENT_TTL = timedelta(minutes=30)
# How long the buyer's signed authorization may take to settle (x402 maxTimeoutSeconds).
MAX_TIMEOUT_SECONDS = 120
SWEEP_BATCH = 500


@dataclass(frozen=True)
class NewIntent:
    amount_usdc: Decimal
    redirect_url: str | None = None
    cancel_url: str | None = None
    description: str | None = None
    order_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def checkout_url(checkout_host: str, intent_id: str) -> str:
    return f"{checkout_host}/pay/{intent_id}"


def build_requirement(
    network: Network, pay_to: str, amount_atomic: int, resource: str, description: str
) -> dict[str, Any]:
    """One x402 ``exact`` payment requirement for a network."""
    requirement: dict[str, Any] = {
        "scheme": "exact",
        "network": network.network,
        "maxAmountRequired": str(amount_atomic),
        "resource": resource,
        "description": description,
        "mimeType": "application/json",
        "payTo": pay_to,
        "maxTimeoutSeconds": MAX_TIMEOUT_SECONDS,
        "asset": network.usdc_address,
    }
    if network.kind == "evm":
        requirement["usdcDomainName"] = network.usdc_domain_name
        requirement["extra"] = {"name": network.usdc_domain_name, "version": network.usdc_domain_version}
    else:
        extra: dict[str, Any] = {"decimals": network.decimals}
        if network.fee_payer:
            extra["feePayer"] = network.fee_payer
        requirement["extra"] = extra
    return requirement


def payable_networks(merchant_id: str, registry: ChainRegistry) -> list[tuple[Network, str]]:
    """(network, payout address) for each configured network the merchant has a wallet on."""
    wallets = {
        w.network: w.address
        for w in db.session.execute(select(Wallet.network, Wallet.address).where(Wallet.merchant_id == merchant_id))
    }
    return [(n, wallets[n.network]) for n in registry if n.network in wallets]


def create_intent(
    merchant_id: str, params: NewIntent, registry: ChainRegistry, checkout_host: str, *, commit: bool = True
) -> Intent:
    """Create a pending intent with one requirement per payable network."""
    networks = payable_networks(merchant_id, registry)
    if not networks:
        raise APIError(
            409,
            "NO_PAYOUT_WALLET",
            "The merchant has no wallet on any configured network; register one before creating intents",
            networks=registry.ids(),
        )
    intent_id = new_intent_id()
    amount_atomic = to_atomic(params.amount_usdc)
    url = checkout_url(checkout_host, intent_id)
    label = params.description or f"Payment {intent_id}"
    now = clock.now()
    intent = Intent(
        id=intent_id,
        merchant_id=merchant_id,
        status=PENDING,
        amount_atomic=amount_atomic,
        order_id=params.order_id,
        description=params.description,
        meta=params.metadata,
        redirect_url=params.redirect_url,
        cancel_url=params.cancel_url,
        payment_requirements=[
            build_requirement(network, address, amount_atomic, url, label) for network, address in networks
        ],
        created_at=now,
        updated_at=now,
        expires_at=now + INTENT_TTL,
    )
    db.session.add(intent)
    if commit:
        db.session.commit()
    return intent


def _is_overdue(intent: Intent, now: datetime) -> bool:
    return intent.status == PENDING and intent.expires_at <= now


def expire_intents(candidates: list[tuple[str, str, str | None]], now: datetime) -> int:
    """Expire the given (intent_id, merchant_id, order_id) rows that are still pending and due.

    Each change and its ``payment.expired`` event commit together. Returns how many expired.
    """
    expired = 0
    for intent_id, merchant_id, order_id in candidates:
        result = db.session.execute(
            update(Intent)
            .where(Intent.id == intent_id, Intent.status == PENDING, Intent.expires_at <= now)
            .values(status=EXPIRED, expired_at=now, updated_at=now)
        )
        if result.rowcount == 1:
            record_event(
                merchant_id,
                "payment.expired",
                {"intent_id": intent_id, "status": EXPIRED, "order_id": order_id, "expired_at": now},
                intent_id=intent_id,
            )
            expired += 1
    db.session.commit()
    return expired


def _overdue_query(now: datetime, merchant_id: str | None = None):  # type: ignore[no-untyped-def]
    query = select(Intent.id, Intent.merchant_id, Intent.order_id).where(
        Intent.status == PENDING, Intent.expires_at <= now
    )
    if merchant_id is not None:
        query = query.where(Intent.merchant_id == merchant_id)
    return query


def expire_overdue(merchant_id: str | None = None) -> int:
    """The expiry sweep: expire every overdue pending intent (optionally of one merchant)."""
    now = clock.now()
    total = 0
    while True:
        rows = [tuple(r) for r in db.session.execute(_overdue_query(now, merchant_id).limit(SWEEP_BATCH))]
        if not rows:
            return total
        total += expire_intents(rows, now)  # type: ignore[arg-type]
        if len(rows) < SWEEP_BATCH:
            return total


def _load(merchant_id: str, intent_id: str) -> Intent:
    intent = db.session.get(Intent, intent_id) if _looks_like_uuid(intent_id) else None
    if intent is None or intent.merchant_id != merchant_id:
        raise not_found("Intent")
    return intent


def _looks_like_uuid(value: str) -> bool:
    if len(value) != 36:
        return False
    try:
        int(value.replace("-", ""), 16)
    except ValueError:
        return False
    return value.count("-") == 4


def get_intent(merchant_id: str, intent_id: str) -> Intent:
    """The merchant's intent; an overdue pending intent is expired first, never shown pending."""
    intent = _load(merchant_id, intent_id)
    now = clock.now()
    if _is_overdue(intent, now):
        expire_intents([(intent.id, intent.merchant_id, intent.order_id)], now)
        db.session.refresh(intent)
    return intent


def list_intents(
    merchant_id: str, *, status: str | None, order_id: str | None, limit: int, offset: int
) -> tuple[list[Intent], int]:
    """A page of the merchant's intents, newest first, and the total matching the filters."""
    expire_overdue(merchant_id)
    conditions = [Intent.merchant_id == merchant_id]
    if status is not None:
        conditions.append(Intent.status == status)
    if order_id is not None:
        conditions.append(Intent.order_id == order_id)
    total = db.session.scalar(select(func.count()).select_from(Intent).where(*conditions)) or 0
    page = list(
        db.session.scalars(
            select(Intent)
            .where(*conditions)
            .order_by(Intent.created_at.desc(), Intent.id.desc())
            .limit(limit)
            .offset(offset)
        )
    )
    return page, total


def cancel_intent(merchant_id: str, intent_id: str) -> Intent:
    """pending -> cancelled. Paid, expired or already cancelled intents are 404, as the spec says."""
    intent = get_intent(merchant_id, intent_id)
    now = clock.now()
    result = db.session.execute(
        update(Intent)
        .where(Intent.id == intent.id, Intent.status == PENDING, Intent.expires_at > now)
        .values(status=CANCELLED, cancelled_at=now, updated_at=now)
    )
    db.session.commit()
    if result.rowcount != 1:
        db.session.refresh(intent)
        raise APIError(
            404,
            "INTENT_NOT_CANCELLABLE",
            f"Intent is {intent.status}; only pending intents can be cancelled",
            status=intent.status,
        )
    db.session.refresh(intent)
    return intent


def intent_to_dict(intent: Intent, checkout_host: str) -> dict[str, Any]:
    """The intent object as the API shows it (``amount_usdc`` is an exact JSON number)."""
    return {
        "intent_id": intent.id,
        "status": intent.status,
        "amount_usdc": from_atomic(intent.amount_atomic),
        "order_id": intent.order_id,
        "description": intent.description,
        "metadata": intent.meta or {},
        "redirect_url": intent.redirect_url,
        "cancel_url": intent.cancel_url,
        "checkout_url": checkout_url(checkout_host, intent.id),
        "created_at": clock.isoformat(intent.created_at),
        "expires_at": clock.isoformat(intent.expires_at),
        "payment_requirements": intent.payment_requirements,
        "tx_hash": intent.tx_hash,
        "buyer_address": intent.buyer_address,
        "chain": intent.chain,
        "paid_at": clock.isoformat(intent.paid_at),
    }
