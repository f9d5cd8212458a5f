from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Integer, String, Text, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from backend.extensions import Model, UTCDateTime
from backend.rails.base import COMMON_COLUMNS, Claim, Terms
from backend.rails.registry import RAILS, rail_of_network_id

# A settlement's life: pending (the intent is claimed for it) -> submitted (a transaction with
# tx_hash was signed and sent) -> confirmed (the authorization executed on chain) | failed.
PENDING = "pending"
SUBMITTED = "submitted"
CONFIRMED = "confirmed"
FAILED = "failed"
OPEN = (PENDING, SUBMITTED)
_OPEN_WITH_NONCE = text("status IN ('pending', 'submitted') AND relay_nonce IS NOT NULL")
# Relay accounts compared whatever the case of their hex (an EVM address's checksum casing is not part of it), as
# ``max_relay_nonce`` compares them; both indexes below are on this expression.
_RELAY_ACCOUNT = text("lower(relay_address)")


def _terms_of_its_rail() -> str:
    """Each row has exactly its rail's terms columns (the rail of its network's CAIP-2 namespace), all of them."""
    rails = list(RAILS.values())
    clauses = []
    for rail in rails:
        others = [column for other in rails if other is not rail for column in other.columns]
        conditions = [f"network LIKE '{rail.namespace}:%'"]
        conditions += [f"{column} IS NOT NULL" for column in rail.columns]
        conditions += [f"{column} IS NULL" for column in others]
        clauses.append("(" + " AND ".join(conditions) + ")")
    return " OR ".join(clauses)


class Settlement(Model):
    """One buyer payment that passed verification and claimed its intent.

    Its terms are typed by its rail (``settlement_terms``): every row has the common columns (``payer``,
    ``pay_to``, ``amount_atomic``, ``nonce``) and its own rail's (``Rail.columns``), NULL on other rails' rows.
    """

    __tablename__ = "settlements"
    __table_args__ = (
        UniqueConstraint("network", "payer", "nonce"),
        CheckConstraint(_terms_of_its_rail(), name="terms_of_rail"),
        Index("ix_settlements_status_updated", "status", "updated_at"),
        Index("ix_settlements_watched_at", "watched_at"),
        Index("ix_settlements_refund", "refund_id"),
        # One open settlement per (account, nonce): the record is fenced even when two processes believe they own
        # the account (a lease lost unseen); a replacement of a settlement's own transaction keeps its row.
        Index(
            "uq_settlements_open_relay_nonce",
            "network",
            _RELAY_ACCOUNT,
            "relay_nonce",
            unique=True,
            sqlite_where=_OPEN_WITH_NONCE,
            postgresql_where=_OPEN_WITH_NONCE,
        ),
        # ``max_relay_nonce`` (an account's start, and the adoption's look at every free account each ADOPT_SECONDS):
        # the highest nonce of (network, account) read from the index's end, not a scan of every settlement.
        Index("ix_settlements_relay_nonce", "network", _RELAY_ACCOUNT, "relay_nonce"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    # RESTRICT: the record of money that moved is never deleted with its intent or merchant.
    intent_id: Mapped[str] = mapped_column(ForeignKey("intents.id", ondelete="RESTRICT"), index=True)
    merchant_id: Mapped[str] = mapped_column(ForeignKey("merchants.id", ondelete="RESTRICT"))
    network: Mapped[str] = mapped_column(String(64))
    asset: Mapped[str] = mapped_column(String(64))
    payer: Mapped[str] = mapped_column(String(64))
    pay_to: Mapped[str] = mapped_column(String(64))
    amount_atomic: Mapped[int] = mapped_column(BigInteger)
    # What makes the payment unique for its payer on its network: EVM the EIP-3009 nonce, Solana the sha256 of
    # the signed message (both 0x-hex, 32 bytes).
    nonce: Mapped[str] = mapped_column(String(66))
    # EVM (EvmRail.columns): the EIP-3009 window, unix times, and the buyer's signature (0x-hex).
    valid_after: Mapped[int | None] = mapped_column(BigInteger)
    valid_before: Mapped[int | None] = mapped_column(BigInteger)
    signature: Mapped[str | None] = mapped_column(Text)
    # Solana (SolanaRail.columns): the block height its blockhash surely expired by, and the buyer-signed
    # transaction (base64).
    last_valid_block_height: Mapped[int | None] = mapped_column(BigInteger)
    signed_transaction: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    tx_hash: Mapped[str | None] = mapped_column(String(128))
    # Chain height when the intent was claimed: the reconciler searches logs from here.
    start_block: Mapped[int | None] = mapped_column(BigInteger)
    relay_address: Mapped[str | None] = mapped_column(String(64))
    # EVM: the nonce of our transaction from relay_address (recorded with tx_hash, before the broadcast); a
    # replacement only ever goes at this (relay_address, relay_nonce). NULL on Solana and before it was sent.
    relay_nonce: Mapped[int | None] = mapped_column(BigInteger)
    failure_code: Mapped[str | None] = mapped_column(String(64))
    failure_reason: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    submitted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The watch of released settlements (``settlement.reconcile.watch_released``): set while the settlement is
    # in it (released, its authorization may still execute) to when it was last looked at; None otherwise.
    watched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # When the watch found the chain had decided (executed and recorded, or it can never execute).
    watch_done_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # A refund's settlement (backend.settlement.refunds): the merchant's wallet pays the intent's buyer back. It
    # never holds or pays its intent (already paid); its confirmation finishes the refund. None: a payment.
    refund_id: Mapped[str | None] = mapped_column(String(40))


def settlement_terms(settlement: Settlement) -> Terms:
    """The settlement's typed terms (``EvmTerms``, ``SolanaTerms``), read from its columns by its network's rail.

    The one way code outside the rails reads a row's terms: never its rail's columns directly."""
    rail = rail_of_network_id(settlement.network)
    return rail.terms_from_columns({name: getattr(settlement, name) for name in (*COMMON_COLUMNS, *rail.columns)})


def settlement_claim(settlement: Settlement) -> Claim:
    """The settlement as its rail sees it: terms and our own transaction (``rails.base.Claim``)."""
    return Claim(
        settlement_id=settlement.id,
        # What the payment names (Solana: its memo): the refund's id for a refund's settlement.
        intent_id=settlement.refund_id or settlement.intent_id,
        asset=settlement.asset,
        terms=settlement_terms(settlement),
        tx_id=settlement.tx_hash,
        relay_address=settlement.relay_address,
        start_block=settlement.start_block,
        relay_nonce=settlement.relay_nonce,
        pays_refund=settlement.refund_id is not None,
    )


class PayeeAccount(Model):
    """A merchant's Solana USDC account (of ``owner``, for the token ``mint``) that a payment of ours landed in, on
    the chain whose genesis hash is ``genesis_hash``.

    While it exists nothing reads this. Once it is gone again on the same chain (its owner closed it and took
    its rent back), a payment does not open it at the next buyer's cost: ``409 PAYEE_ACCOUNT_CLOSED`` until the
    merchant opens it again (``backend.settlement.solana``). A chain with another genesis hash (a local ledger
    started again under a kept database) is a new chain, and another mint (the operator moved the network to
    another USDC) is another account: the first payment opens it, as at first. Written before the settlement
    that landed is marked paid, so a finished payment always has its record.
    """

    __tablename__ = "solana_payee_accounts"
    __table_args__ = (UniqueConstraint("network", "owner", "mint", "genesis_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    network: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(64))
    mint: Mapped[str] = mapped_column(String(64))
    genesis_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
