from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import Model, UTCDateTime


class PaymentLink(Model):
    """A price a merchant shares as a URL. Never deleted (its intents name it); deactivated instead."""

    __tablename__ = "payment_links"
    __table_args__ = (Index("ix_payment_links_merchant_created", "merchant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"))
    amount_atomic: Mapped[int] = mapped_column(BigInteger)
    description: Mapped[str] = mapped_column(String(500))
    redirect_url: Mapped[str | None] = mapped_column(String(2048))
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    deactivated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
