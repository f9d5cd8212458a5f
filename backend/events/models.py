from __future__ import annotations

from datetime import datetime

from sqlalchemy import Boolean, ForeignKey, Index, String, Text, false
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import Model, UTCDateTime


class Event(Model):
    """One event, stored as the exact envelope bytes that webhooks will deliver and sign."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_merchant_created", "merchant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(64))
    intent_id: Mapped[str | None] = mapped_column(String(36), index=True)
    payload: Mapped[str] = mapped_column(Text)
    # Simulated events (POST /api/v1/webhooks/test) go to one endpoint and describe nothing real.
    simulated: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
