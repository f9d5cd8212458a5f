from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import Model, UTCDateTime
from backend.ids import prefixed_id


class IdempotencyRecord(Model):
    """The first response to a request made with an ``Idempotency-Key``, replayed on retries."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("merchant_id", "key"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: prefixed_id("idk"))
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    endpoint: Mapped[str] = mapped_column(String(64))
    request_hash: Mapped[str] = mapped_column(String(64))
    response_status: Mapped[int] = mapped_column(Integer)
    response_body: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
