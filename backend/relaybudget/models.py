from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import Model, UTCDateTime

# What the relay paid for: EVM gas (wei), a Solana transaction fee (lamports), an account's rent
# (lamports; the relay opens no accounts today, see payintent.solana_tx, but the kind is kept).
GAS = "gas"
FEE = "fee"
RENT = "rent"
KINDS = (GAS, FEE, RENT)


class RelaySpend(Model):
    """One payment the relay made on a merchant's behalf (append-only).

    ``reference`` is the transaction (EVM hash, Solana signature) that cost it: a transaction is
    recorded once per kind, however many processes see it finish.
    """

    __tablename__ = "relay_spending"
    __table_args__ = (
        UniqueConstraint("network", "reference", "kind"),
        # A merchant's spending in the window, and its largest recent charge (the EVM estimate, max_settlement_cost).
        Index("ix_relay_spending_merchant_window", "merchant_id", "network", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # RESTRICT: what the relay spent is kept, like the settlements it paid for.
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="RESTRICT"))
    network: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    # In the network's smallest native unit: wei (EVM), lamports (Solana).
    amount_atomic: Mapped[int] = mapped_column(BigInteger)
    reference: Mapped[str] = mapped_column(String(128))
    settlement_id: Mapped[str | None] = mapped_column(ForeignKey("settlements.id", ondelete="RESTRICT"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
