from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Index, String, text
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import JSONType, Model, UTCDateTime

PENDING = "pending"
PAID = "paid"
EXPIRED = "expired"
CANCELLED = "cancelled"
STATUSES = (PENDING, PAID, EXPIRED, CANCELLED)


class Intent(Model):
    __tablename__ = "intents"
    __table_args__ = (
        Index("ix_intents_merchant_created", "merchant_id", "created_at"),
        Index("ix_intents_merchant_order", "merchant_id", "order_id"),
        Index("ix_intents_status_expires", "status", "expires_at"),
        Index("ix_intents_payment_link", "payment_link_id"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16), default=PENDING)
    amount_atomic: Mapped[int] = mapped_column(BigInteger)
    order_id: Mapped[str | None] = mapped_column(String(128))
    description: Mapped[str | None] = mapped_column(String(500))
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONType, default=dict)
    redirect_url: Mapped[str | None] = mapped_column(String(2048))
    cancel_url: Mapped[str | None] = mapped_column(String(2048))
    # Snapshot taken at creation: a buyer pays exactly what was offered, even if the
    # merchant changes a wallet afterwards.
    payment_requirements: Mapped[list[dict[str, Any]]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    tx_hash: Mapped[str | None] = mapped_column(String(128))
    buyer_address: Mapped[str | None] = mapped_column(String(64))
    chain: Mapped[str | None] = mapped_column(String(64))
    paid_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The settlement holding the intent while its authorization is in flight (see backend.settlement).
    # While set, cancel and expiry leave the intent alone: a settlement in flight always wins.
    settlement_id: Mapped[str | None] = mapped_column(String(40))
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The payment link whose visit made this intent (backend.paymentlinks), if one did. Not a foreign key: links are
    # never deleted, and SQLite could add one only by rebuilding this table.
    payment_link_id: Mapped[str | None] = mapped_column(String(40))
    # What the intent's refunds paid back (atomic units; backend.intents.refunds): raised with each refund.issued.
    refunded_atomic: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))


# A refund's statuses (backend.intents.refunds).
REQUIRES_SIGNATURE = "requires_signature"
PROCESSING = "processing"
SUCCEEDED = "succeeded"
FAILED = "failed"
REFUND_STATUSES = (REQUIRES_SIGNATURE, PROCESSING, SUCCEEDED, FAILED)
REFUND_ID_PATTERN = r"re_[0-9a-f]{32}"


class Refund(Model):
    __tablename__ = "refunds"
    __table_args__ = (
        Index("ix_refunds_intent", "intent_id"),
        Index("ix_refunds_merchant_created", "merchant_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    # RESTRICT: the record of money that moved is never deleted with its intent or merchant.
    intent_id: Mapped[str] = mapped_column(ForeignKey("intents.id", ondelete="RESTRICT"))
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="RESTRICT"))
    network: Mapped[str] = mapped_column(String(64))
    amount_atomic: Mapped[int] = mapped_column(BigInteger)
    # The merchant's wallet the payment landed in (the intent's payTo on ``network``): the only signer accepted.
    pay_from: Mapped[str] = mapped_column(String(64))
    pay_to: Mapped[str] = mapped_column(String(64))  # the buyer (the intent's buyer_address)
    # The x402 ``exact`` requirement the merchant's wallet signs (the intent's, with payTo the buyer).
    requirement: Mapped[dict[str, Any]] = mapped_column(JSONType)
    reason: Mapped[str | None] = mapped_column(String(500))
    status: Mapped[str] = mapped_column(String(24))
    settlement_id: Mapped[str | None] = mapped_column(String(40))
    tx_hash: Mapped[str | None] = mapped_column(String(128))
    failure_code: Mapped[str | None] = mapped_column(String(64))
    failure_reason: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    succeeded_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
