"""Payment links: create, read, list and deactivate a merchant's links, and a visit that makes an intent.

A link is a price (amount, description, optional redirect) at ``{checkout host}/l/{link_id}``. Each visit creates a
fresh pending intent, carrying ``payment_link_id``, through the same code as ``POST /api/v1/x402/intents`` (one
requirement per network the merchant has a wallet on, at the time of the visit), and the visitor is sent to its
checkout. A deactivated link makes no intent. Links are never deleted: their intents name them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select, update

from backend import clock
from backend.chains.registry import ChainRegistry
from backend.errors import DomainError, not_found
from backend.extensions import db
from backend.ids import prefixed_id
from backend.intents import services as intents
from backend.intents.models import PENDING, Intent
from backend.merchants.models import Merchant
from backend.money import from_atomic, to_atomic
from backend.paymentlinks.models import PaymentLink
from backend.ratelimit import client_key, enforce

LINK_ID_PATTERN = "pl_[0-9a-f]{32}"  # ids.prefixed_id("pl")
_LINK_ID = re.compile(f"^{LINK_ID_PATTERN}$")
# Visits are public and each makes a row (and, unpaid, a payment.expired event): bounded three ways. Each client
# (an IPv4 address, an IPv6 /48) may make VISITS_PER_MINUTE intents a minute through links; a link has at most
# PENDING_PER_LINK intents pending at once (its visitors then get a "busy" page until some expire, after
# intents.INTENT_TTL); and only a browser's top-level navigation makes one (pages.py: previews, crawlers and
# embedded requests get the link's page without an intent).
VISITS_PER_MINUTE = 30
VISIT_IPV6_PREFIX = 48
PENDING_PER_LINK = 500


def link_inactive() -> DomainError:
    """The link was deactivated: its page says so (410), and no intent is made."""
    return DomainError("PAYMENT_LINK_INACTIVE", "This payment link is no longer active")


@dataclass(frozen=True)
class NewLink:
    amount_usdc: Decimal
    description: str
    redirect_url: str | None = None


def link_url(checkout_host: str, link_id: str) -> str:
    return f"{checkout_host}/l/{link_id}"


def link_to_dict(link: PaymentLink, checkout_host: str) -> dict[str, Any]:
    return {
        "link_id": link.id,
        "url": link_url(checkout_host, link.id),
        "amount_usdc": from_atomic(link.amount_atomic),
        "description": link.description,
        "redirect_url": link.redirect_url,
        "active": link.active,
        "created_at": clock.isoformat(link.created_at),
        "deactivated_at": clock.isoformat(link.deactivated_at),
    }


def create_link(merchant_id: str, params: NewLink) -> PaymentLink:
    link = PaymentLink(
        id=prefixed_id("pl"),
        merchant_id=merchant_id,
        amount_atomic=to_atomic(params.amount_usdc),
        description=params.description,
        redirect_url=params.redirect_url,
        active=True,
        created_at=clock.now(),
        deactivated_at=None,
    )
    db.session.add(link)
    db.session.commit()
    return link


def get_link(merchant_id: str, link_id: str) -> PaymentLink:
    link = db.session.get(PaymentLink, link_id)
    if link is None or link.merchant_id != merchant_id:
        raise not_found("Payment link")
    return link


def list_links(
    merchant_id: str, *, active: bool | None = None, limit: int, offset: int
) -> tuple[list[PaymentLink], int]:
    """A page of the merchant's links, newest first, and how many match."""
    conditions = [PaymentLink.merchant_id == merchant_id]
    if active is not None:
        conditions.append(PaymentLink.active.is_(active))
    total = db.session.scalar(select(func.count()).select_from(PaymentLink).where(*conditions)) or 0
    rows = db.session.scalars(
        select(PaymentLink)
        .where(*conditions)
        .order_by(PaymentLink.created_at.desc(), PaymentLink.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(rows), total


def deactivate_link(merchant_id: str, link_id: str) -> PaymentLink:
    """Stop the link making intents (intents it made stay payable until they expire). Deactivating an inactive
    link changes nothing and answers the same."""
    link = get_link(merchant_id, link_id)
    now = clock.now()
    db.session.execute(
        update(PaymentLink)
        .where(PaymentLink.id == link.id, PaymentLink.active.is_(True))
        .values(active=False, deactivated_at=now)
    )
    db.session.commit()
    db.session.refresh(link)
    return link


def limit_visits(kind: str = "visit") -> None:
    """429 RATE_LIMITED with Retry-After past VISITS_PER_MINUTE requests of ``kind`` from this client (counted
    before any lookup: a request for an unknown link counts too)."""
    enforce(f"links:{kind}:{client_key(ipv6_prefix=VISIT_IPV6_PREFIX)}", VISITS_PER_MINUTE)


def check_link(link_id: str) -> PaymentLink:
    """The active link ``link_id``: an unknown one (or one not even of an id's form: no lookup) is NOT_FOUND, an
    inactive one PAYMENT_LINK_INACTIVE."""
    link = db.session.get(PaymentLink, link_id) if _LINK_ID.match(link_id) else None
    if link is None:
        raise not_found("Payment link")
    if not link.active:
        raise link_inactive()
    return link


def link_page(link_id: str) -> dict[str, Any]:
    """What the link's own page shows (no intent is made): amount, description and the merchant's name."""
    link = check_link(link_id)
    merchant = db.session.get(Merchant, link.merchant_id)
    return {
        "link_id": link.id,
        "amount_usdc": from_atomic(link.amount_atomic),
        "description": link.description,
        "merchant_name": merchant.name if merchant else None,
    }


def _pending_of(link_id: str, now: datetime) -> int:
    """The link's intents whose effective status is pending (the list filter's own rule)."""
    pending = intents._status_condition(PENDING, now)
    return (
        db.session.scalar(select(func.count()).select_from(Intent).where(Intent.payment_link_id == link_id, pending))
        or 0
    )


def visit(link_id: str, registry: ChainRegistry, checkout_host: str, max_amount_usdc: Decimal) -> str:
    """A visit of a link: a fresh pending intent for its price, written; returns the intent's checkout URL.

    Refused as :func:`check_link` says; PAYMENT_LINK_UNPAYABLE when its amount is over the service's maximum
    now; NO_PAYOUT_WALLET when the merchant has no wallet left; RATE_LIMITED when the link has PENDING_PER_LINK
    intents pending (nothing is written). A deactivation that commits while the intent is being written wins:
    the link is read again after the INSERT, and an intent made after it is cancelled at once (PAYMENT_LINK_INACTIVE).
    """
    link = check_link(link_id)
    amount = from_atomic(link.amount_atomic)
    if amount > max_amount_usdc:
        raise DomainError(
            "PAYMENT_LINK_UNPAYABLE", f"The link's amount is over the service's maximum ({max_amount_usdc})"
        )
    now = clock.now()
    if _pending_of(link.id, now) >= PENDING_PER_LINK:
        raise DomainError("RATE_LIMITED", "This link has the most payments open at once", headers={"Retry-After": "60"})
    params = intents.NewIntent(
        amount_usdc=amount, description=link.description, redirect_url=link.redirect_url, payment_link_id=link.id
    )
    merchant_id = link.merchant_id
    row = intents.new_intent(merchant_id, params, registry, checkout_host)
    intents.insert_intent(row)
    db.session.expire_all()
    if not db.session.scalar(select(PaymentLink.active).where(PaymentLink.id == link_id)):
        intents.cancel_intent(merchant_id, row["id"])
        raise link_inactive()
    return intents.checkout_url(checkout_host, row["id"])
