"""Webhook endpoints, deliveries (one event to one endpoint) and their attempts.

The database is the queue: a delivery is due when it is ``pending`` with ``next_attempt_at`` in the
past and no live lease. RQ jobs only wake the workers that claim due deliveries.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Boolean, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import JSONType, Model, UTCDateTime

# A delivery's life: pending (waiting for its next attempt) -> succeeded | failed (5 attempts
# failed) | cancelled (its endpoint was deleted before it succeeded).
PENDING = "pending"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
DELIVERY_STATUSES = (PENDING, SUCCEEDED, FAILED, CANCELLED)


class WebhookEndpoint(Model):
    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[Any]] = mapped_column(JSONType)
    # Kept in clear: every delivery is signed with it. Shown to the merchant once (create, rotate).
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Deleted endpoints are kept (soft delete) so their delivery log stays readable.
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class WebhookDelivery(Model):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint_created", "endpoint_id", "created_at"),
        # Live leases per endpoint (the in-flight cap); finished attempts clear the column.
        Index("ix_webhook_deliveries_lease", "lease_expires_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"), index=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("events.id", ondelete="CASCADE"), index=True)
    event_type: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A worker owns a delivery while sending it: token and expiry of its lease.
    lease_token: Mapped[str | None] = mapped_column(String(40))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(String(500))
    replay_of: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class WebhookAttempt(Model):
    __tablename__ = "webhook_attempts"
    # One row per attempt number: a second worker can never record the same attempt twice.
    __table_args__ = (UniqueConstraint("delivery_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    attempted_at: Mapped[datetime] = mapped_column(UTCDateTime)
    succeeded: Mapped[bool] = mapped_column(Boolean)
    status_code: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(String(500))
    response_body: Mapped[str | None] = mapped_column(Text)
