"""Refunds of paid intents: the records (what is owed back, what was paid back) as plain functions.

A refund is paid from the merchant's own payout wallet (the intent's ``payTo`` on the network it was paid on) to
the buyer, signed by that wallet and relayed by us; the service never holds the USDC. Its life:

    requires_signature --(a signed authorization is claimed: settlement.refunds)--> processing
    processing --(the authorization executed on chain)--> succeeded
    processing --(it can no longer execute)--> failed

A failed refund is final: the merchant creates another one. Each refund has at most one settlement (the claim's
conditional update from ``requires_signature``), so it executes at most once. The refunds of an intent never
exceed what was paid: the claim counts, under the intent's lock, every refund that has moved money or still may
(``RESERVING``: processing, succeeded, and a failed one whose authorization may still execute: its signature is
out and the watch of released settlements records it if it does). Creating a refund checks the same sum, without
holding anything: only the claim decides.

``succeeded`` is written with the settlement's confirmation (``settlement.services.complete_settlement``), in its
transaction, with ``intents.refunded_atomic`` and the ``refund.issued`` event.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, bindparam, func, or_, select, update

from backend import clock
from backend.errors import DomainError, not_found
from backend.events.services import record_event
from backend.extensions import db, rowcount
from backend.ids import prefixed_id
from backend.intents.models import FAILED, PAID, PROCESSING, REQUIRES_SIGNATURE, SUCCEEDED, Intent, Refund
from backend.intents.services import looks_like_uuid
from backend.money import from_atomic, to_atomic

_refunds = Refund.__table__


def _reserving(may_still_execute: Any) -> Any:
    """Refunds that moved money or still may: processing, succeeded, and failed ones ``may_still_execute`` (a
    condition on the refund's row) says may still execute."""
    return or_(_refunds.c.status.in_((PROCESSING, SUCCEEDED)), and_(_refunds.c.status == FAILED, may_still_execute))


def reserved_atomic(intent_id: str, may_still_execute: Any) -> int:
    """What the intent's refunds have paid back or still may (atomic units)."""
    total = db.session.scalar(
        select(func.coalesce(func.sum(_refunds.c.amount_atomic), 0)).where(
            _refunds.c.intent_id == intent_id, _reserving(may_still_execute)
        )
    )
    return int(total or 0)


def refundable_atomic(intent: Intent, may_still_execute: Any) -> int:
    """What is left to refund on a paid intent: what was paid, less what its refunds have paid or still may."""
    return max(intent.amount_atomic - reserved_atomic(intent.id, may_still_execute), 0)


def check_refundable(intent: Intent) -> None:
    if intent.status != PAID or not intent.chain or not intent.buyer_address:
        raise DomainError("INTENT_NOT_REFUNDABLE", "Only a paid intent can be refunded", status=intent.status)


def exceeds(amount_atomic: int, left_atomic: int) -> DomainError:
    return DomainError(
        "REFUND_EXCEEDS_PAYMENT",
        f"A refund of {from_atomic(amount_atomic)} USDC exceeds what is left to refund on this intent "
        f"({from_atomic(left_atomic)} USDC): its refunds never exceed what was paid",
        refundable_usdc=from_atomic(left_atomic),
    )


def create_refund(
    merchant_id: str,
    intent_id: str,
    amount_usdc: Decimal | None,
    reason: str | None,
    resource: str,
    may_still_execute: Any,
) -> Refund:
    """A refund of the merchant's paid intent waiting for the payout wallet's signature (``amount_usdc``: by
    default all that is left to refund). ``resource``: the URL its requirement names, with ``{refund_id}``.

    Refused: another merchant's or an unknown intent (404), an intent that is not paid (409), an amount over what
    is left (409; checked again, under a lock, when the signature is claimed)."""
    intent = merchant_intent(merchant_id, intent_id)
    check_refundable(intent)
    left = refundable_atomic(intent, may_still_execute)
    amount = left if amount_usdc is None else to_atomic(amount_usdc)
    if amount <= 0 and amount_usdc is None:
        raise DomainError("REFUND_EXCEEDS_PAYMENT", "Nothing is left to refund on this intent", refundable_usdc=0)
    if amount > left:
        raise exceeds(amount, left)
    paid_requirement = next((r for r in intent.payment_requirements if r.get("network") == intent.chain), None)
    if paid_requirement is None:
        raise DomainError("INTENT_NOT_REFUNDABLE", "The intent's paid network has no requirement to refund on")
    refund_id = prefixed_id("re")
    requirement = {
        **paid_requirement,
        "maxAmountRequired": str(amount),
        "payTo": intent.buyer_address,
        "resource": resource.format(refund_id=refund_id),
        "description": f"Refund {refund_id} of intent {intent.id}",
    }
    now = clock.now()
    refund = Refund(
        id=refund_id,
        intent_id=intent.id,
        merchant_id=merchant_id,
        network=intent.chain,
        amount_atomic=amount,
        pay_from=paid_requirement["payTo"],
        pay_to=intent.buyer_address,
        requirement=requirement,
        reason=reason,
        status=REQUIRES_SIGNATURE,
        created_at=now,
        updated_at=now,
    )
    db.session.add(refund)
    db.session.commit()
    return refund


def merchant_intent(merchant_id: str, intent_id: str) -> Intent:
    """The merchant's intent; another merchant's or an unknown id is 404."""
    intent = db.session.get(Intent, intent_id, populate_existing=True) if looks_like_uuid(intent_id) else None
    if intent is None or intent.merchant_id != merchant_id:
        raise not_found("Intent")
    return intent


def get_refund(merchant_id: str | None, refund_id: str) -> Refund:
    """The merchant's refund (``merchant_id`` None: anyone's); another merchant's or an unknown id is 404."""
    refund = db.session.get(Refund, refund_id, populate_existing=True) if isinstance(refund_id, str) else None
    if refund is None or (merchant_id is not None and refund.merchant_id != merchant_id):
        raise not_found("Refund")
    return refund


def list_refunds(
    merchant_id: str, *, intent_id: str | None = None, limit: int = 20, offset: int = 0
) -> tuple[list[Refund], int]:
    """A page of the merchant's refunds (of one intent when given), newest first, and the total."""
    conditions = [Refund.merchant_id == merchant_id]
    if intent_id is not None:
        conditions.append(Refund.intent_id == intent_id)
    total = db.session.scalar(select(func.count()).select_from(Refund).where(*conditions)) or 0
    page = db.session.scalars(
        select(Refund)
        .where(*conditions)
        .order_by(Refund.created_at.desc(), Refund.id.desc())
        .limit(limit)
        .offset(offset)
    ).all()
    return list(page), int(total)


def refunds_of(intent_id: str) -> list[Refund]:
    """An intent's refunds, oldest first (the intent's own view)."""
    return list(db.session.scalars(select(Refund).where(Refund.intent_id == intent_id).order_by(Refund.created_at)))


def refund_to_dict(refund: Refund) -> dict[str, Any]:
    isoformat = clock.isoformat
    answer: dict[str, Any] = {
        "refund_id": refund.id,
        "intent_id": refund.intent_id,
        "amount_usdc": from_atomic(refund.amount_atomic),
        "status": refund.status,
        "network": refund.network,
        "pay_from": refund.pay_from,
        "pay_to": refund.pay_to,
        "reason": refund.reason,
        "tx_hash": refund.tx_hash,
        "created_at": isoformat(refund.created_at),
        "succeeded_at": isoformat(refund.succeeded_at),
        "failure_code": refund.failure_code,
        "failure_reason": refund.failure_reason,
    }
    if refund.status == REQUIRES_SIGNATURE:
        answer["payment_requirements"] = [refund.requirement]
    return answer


# The claim's step (settlement.refunds.claim_refund), in its transaction: one settlement per refund.
_BEGIN = (
    update(_refunds)
    .where(_refunds.c.id == bindparam("refund_id"), _refunds.c.status == REQUIRES_SIGNATURE)
    .values(status=PROCESSING, settlement_id=bindparam("settlement_id"), updated_at=bindparam("now"))
)


def begin(refund_id: str, settlement_id: str, now: datetime) -> bool:
    """requires_signature -> processing, held by ``settlement_id``; False if the refund was claimed already."""
    return (
        rowcount(db.session.execute(_BEGIN, {"refund_id": refund_id, "settlement_id": settlement_id, "now": now})) == 1
    )


def mark_succeeded(refund_id: str, tx_hash: str, now: datetime) -> None:
    """The refund's authorization executed in ``tx_hash``: succeeded, the intent's ``refunded_atomic`` raised and
    ``refund.issued`` recorded, in the caller's transaction (the settlement's confirmation). Once: a refund already
    succeeded is left alone. From failed too: a released authorization that executed late (the watch) paid it."""
    done = db.session.execute(
        update(_refunds)
        .where(_refunds.c.id == refund_id, _refunds.c.status != SUCCEEDED)
        .values(status=SUCCEEDED, tx_hash=tx_hash, succeeded_at=now, updated_at=now,
                failure_code=None, failure_reason=None)
        .returning(_refunds.c.intent_id, _refunds.c.merchant_id, _refunds.c.amount_atomic, _refunds.c.network,
                   _refunds.c.pay_to)
    ).first()  # fmt: skip
    if done is None:
        return
    intent_id, merchant_id, amount_atomic, network, pay_to = done
    order_id = db.session.execute(
        update(Intent)
        .where(Intent.id == intent_id)
        .values(refunded_atomic=Intent.refunded_atomic + amount_atomic, updated_at=now)
        .returning(Intent.order_id)
        .execution_options(synchronize_session=False)
    ).scalar()
    record_event(
        merchant_id,
        "refund.issued",
        {"refund_id": refund_id, "intent_id": intent_id, "order_id": order_id,
         "amount_usdc": from_atomic(amount_atomic), "tx_hash": tx_hash, "chain": network, "buyer_address": pay_to,
         "refunded_at": now},
        intent_id=intent_id,
    )  # fmt: skip


def mark_failed(refund_id: str, code: str, reason: str, now: datetime) -> None:
    """The refund's authorization can no longer be sent by us (in the caller's transaction): failed, final."""
    db.session.execute(
        update(_refunds)
        .where(_refunds.c.id == refund_id, _refunds.c.status == PROCESSING)
        .values(status=FAILED, failure_code=code, failure_reason=reason[:500], updated_at=now)
    )


__all__ = ["Refund", "create_refund", "get_refund", "list_refunds", "refund_to_dict"]
