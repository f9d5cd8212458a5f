"""The dashboard's own table: secrets waiting to be shown once (``backend.dashboard.reveals``)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, LargeBinary, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import Model, UTCDateTime


class PendingReveal(Model):
    """A new API key or webhook secret between the POST that made it and the page that shows it.

    Neither the handle (in the merchant's session cookie) nor the secret is stored: the id is a hash of
    the handle and the secret is encrypted with a key derived from it; ``ciphertext`` starts with an
    HMAC-SHA256 tag (another key derived from the handle) over the row's fields and the encrypted
    secret. Deleted when shown, on logout, or once expired (by the worker's sweep at the latest).
    """

    __tablename__ = "dashboard_reveals"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="CASCADE"), index=True)
    session_hash: Mapped[str] = mapped_column(String(64), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    subject: Mapped[str] = mapped_column(Text)
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
