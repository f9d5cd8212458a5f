from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend import clock
from backend.extensions import Model, UTCDateTime
from backend.ids import prefixed_id


class Merchant(Model):
    __tablename__ = "merchants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: prefixed_id("mer"))
    email: Mapped[str] = mapped_column(String(254), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    password_hash: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=clock.now)


class ApiKey(Model):
    """A secret API key. Only its SHA-256 is stored; ``display_prefix`` lets people tell keys apart."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: prefixed_id("key"))
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    display_prefix: Mapped[str] = mapped_column(String(24))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=clock.now)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Wallet(Model):
    """Where a merchant is paid on one network (at most one wallet per network)."""

    __tablename__ = "wallets"
    __table_args__ = (UniqueConstraint("merchant_id", "network"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: prefixed_id("wal"))
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"), index=True)
    network: Mapped[str] = mapped_column(String(64))
    address: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=clock.now)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=clock.now, onupdate=clock.now)
    # When the wallet proved it is the merchant's (it signed the service's message naming the merchant and the
    # network: backend.merchants.proofs); None: pasted, unverified. A new address starts unverified.
    verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
