"""Settlement rules as plain functions: verify, claim, finish. The relayer and the reconciler
call the same finishing functions, so an authorization ends the same way whoever sees it land.

Exactly once: an intent is *claimed* by one settlement (``intents.settlement_id``) with a
conditional update before anything is sent to a chain. While claimed, no other payment, no
cancel and no expiry can touch it. The claim is released only when the authorization can no
longer execute (it reverted in a final block, was cancelled by the buyer, its nonce was used by
another authorization of the buyer, or its ``validBefore`` has passed unused).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row, bindparam, func, select, update
from sqlalchemy.exc import IntegrityError

from backend import clock
from backend.chains.registry import ChainRegistry, Network
from backend.errors import DomainError, echo
from backend.events.models import Event
from backend.events.services import record_event
from backend.extensions import UTCDateTime, db, rowcount
from backend.ids import prefixed_id
from backend.intents import refunds
from backend.intents.models import PAID, PENDING, Intent
from backend.intents.services import effective_status
from backend.merchants.models import Wallet
from backend.money import from_atomic
from backend.rails.base import RelayNonceTaken, Terms
from backend.rails.registry import rail_for, rail_of_network_id
from backend.settlement import models as st
from backend.settlement.models import Settlement
from backend.settlement.x402 import X402_VERSIONS, X402Payment, check_accepted

log = logging.getLogger(__name__)

# failure_code of a settlement that executed after its intent was paid by another (a second charge).
DUPLICATE_PAYMENT = "DUPLICATE_PAYMENT"


@dataclass(frozen=True)
class PaymentSubmission:
    """A payment for an intent, in the one form settlement reads (see ``settlement.x402``)."""

    intent_id: str
    scheme: str
    network: str  # CAIP-2 id
    x402_version: int
    payload: dict[str, Any]  # EVM: the flat authorization; Solana: {transaction}
    accepted: dict[str, Any] | None = None  # x402 v2: the requirement the client accepted

    @classmethod
    def of(cls, intent_id: str, payment: X402Payment) -> PaymentSubmission:
        return cls(intent_id, payment.scheme, payment.network, payment.x402_version, payment.payload, payment.accepted)


def requirement_for(
    intent: Intent, submission: PaymentSubmission, registry: ChainRegistry | None = None
) -> dict[str, Any]:
    """The intent's requirement the submission answers; refuses other schemes and networks.

    A v2 submission's ``accepted`` must also be that requirement (``x402.check_accepted``).
    """
    return match_requirement(intent.payment_requirements, submission, registry, "intent")


def match_requirement(
    requirements: list[dict[str, Any]], submission: PaymentSubmission, registry: ChainRegistry | None, what: str
) -> dict[str, Any]:
    """The requirement among ``requirements`` (of an intent, or a refund: ``what``) that the submission answers."""
    if submission.x402_version not in X402_VERSIONS:
        raise DomainError("UNSUPPORTED_X402_VERSION", f"x402Version must be one of {list(X402_VERSIONS)}")
    if submission.scheme != "exact":
        raise DomainError("UNSUPPORTED_SCHEME", "Only the 'exact' scheme is supported")
    for requirement in requirements:
        if requirement["network"] == submission.network:
            if submission.accepted is not None:
                check_accepted(submission.accepted, requirement, registry)
            return requirement
    offered = [r["network"] for r in requirements]
    raise DomainError(
        "UNSUPPORTED_NETWORK",
        f"This {what} cannot be paid on {submission.network!r}; it offers {', '.join(offered)}",
        networks=offered,
    )


# Built once, on the tables (Core: no ORM compile or result machinery per run; a /pay runs each once or twice): the
# merchant's wallet on a network, open settlements, and the claim's own statements.
_WALLETS, _SETTLEMENTS, _INTENTS = Wallet.__table__, Settlement.__table__, Intent.__table__
_CURRENT_WALLET = select(_WALLETS.c.address).where(
    _WALLETS.c.merchant_id == bindparam("merchant_id"), _WALLETS.c.network == bindparam("network")
)
_CURRENT_WALLET_LOCKED = _CURRENT_WALLET.with_for_update()
_OPEN = select(func.count()).select_from(_SETTLEMENTS).where(_SETTLEMENTS.c.status.in_(st.OPEN))
_OPEN_OF_PAYER = _OPEN.where(_SETTLEMENTS.c.payer == bindparam("payer"))
_OPEN_OF_MERCHANT = _OPEN.where(
    _SETTLEMENTS.c.merchant_id == bindparam("merchant_id"), _SETTLEMENTS.c.network == bindparam("network")
)
# The claim's counts, both in one statement when it needs both (read under both locks).
_OPEN_OF_BOTH = select(_OPEN_OF_MERCHANT.scalar_subquery(), _OPEN_OF_PAYER.scalar_subquery())
_INSERT_SETTLEMENT = _SETTLEMENTS.insert()
_NOW = bindparam("now", type_=UTCDateTime())
# The claim's conditional update: the one place an intent gets its settlement (exactly once, see the module).
_CLAIM_INTENT = (
    _INTENTS.update()
    .where(
        _INTENTS.c.id == bindparam("intent_id"),
        _INTENTS.c.merchant_id == bindparam("of_merchant"),  # the pair the claim was given: never another's intent
        _INTENTS.c.status == PENDING,
        _INTENTS.c.settlement_id.is_(None),
        _INTENTS.c.expires_at > _NOW,
    )
    .values(settlement_id=bindparam("settlement_id"), updated_at=_NOW)
)
# SQLite's claim lock: a write, which takes the database's write lock at once and holds it to the commit.
_TOUCH_INTENT = (
    _INTENTS.update().where(_INTENTS.c.id == bindparam("intent_id")).values(updated_at=_INTENTS.c.updated_at)
)
_ADVISORY_LOCK = select(func.pg_advisory_xact_lock(bindparam("lock_class"), func.hashtext(bindparam("key"))))


def check_pay_to_current(merchant_id: str, network_id: str, pay_to: str, *, lock: bool = False) -> None:
    """Refuse a payment to a payTo that is no longer the merchant's wallet on the network (409
    REQUIREMENT_OUTDATED): the merchant changed or removed it after the intent was created.

    The intent keeps the payTo it was created with (the buyer signs it: it is never redirected to a new
    wallet), but a new payment to a wallet the merchant gave up is refused; the merchant creates a fresh
    intent. ``lock`` (inside the claim): the wallet row is locked until the claim commits, so a wallet
    change waits for a claim in progress, and a claim after the change sees the new wallet (PostgreSQL;
    SQLite serializes writers anyway).
    """
    params = {"merchant_id": merchant_id, "network": network_id}
    current = db.session.scalar(_CURRENT_WALLET_LOCKED if lock else _CURRENT_WALLET, params)
    if current is None or not rail_of_network_id(network_id).same_address(current, pay_to):
        raise DomainError(
            "REQUIREMENT_OUTDATED",
            f"The merchant's payout wallet on {network_id} changed or was removed since this intent was created; "
            "nothing was paid. Ask the merchant for a new payment intent",
            network=network_id,
        )


def check_asset_current(requirement: dict[str, Any], network: Network, what: str) -> None:
    """Refuse a requirement (of an intent, or a refund: ``what``) whose asset is no longer the network's USDC (409
    REQUIREMENT_OUTDATED): the operator moved the network to another contract or mint since it was made."""
    if requirement["asset"].lower() != network.usdc_address.lower():
        raise DomainError(
            "REQUIREMENT_OUTDATED",
            f"The USDC contract configured for {network.network} changed since this {what} was created",
        )


def check_payable(intent: Intent, now: datetime) -> None:
    """Refuse a payment for an intent that is not pending (or is held by a settlement in flight)."""
    if intent.status == PAID:
        raise DomainError("ALREADY_PAID", "This intent is already paid", tx_hash=intent.tx_hash)
    if intent.status == PENDING and intent.settlement_id is not None:
        raise DomainError("PAYMENT_IN_PROGRESS", "A payment for this intent is being settled; read the intent")
    status = effective_status(intent.status, intent.expires_at, now, intent.settlement_id)
    if status == "cancelled":
        raise DomainError("INTENT_CANCELLED", "This intent was cancelled and accepts no payment")
    if status == "expired":
        raise DomainError("INTENT_EXPIRED", "This intent expired and accepts no payment")


# Anyone with an intent id can make payment attempts fail (the public checkout route needs no key), so the
# payment.failed events of refused attempts are capped per intent: within FAILED_EVENT_WINDOW, at most one
# per error code and at most FAILED_EVENTS_PER_WINDOW in all (settlement failures count, and are always written).
FAILED_EVENT_WINDOW = timedelta(hours=1)
FAILED_EVENTS_PER_WINDOW = 5


def record_failed_attempt(intent: Intent, reason: str, code: str) -> bool:
    """payment.failed for an attempt refused before any claim; the intent stays as it was.

    Returns whether the event was written: not when the intent already had one with this code, or
    ``FAILED_EVENTS_PER_WINDOW`` of them, in the last ``FAILED_EVENT_WINDOW`` (see docs/webhooks.md).
    """
    now = clock.now()
    # Take the intent's row lock (PostgreSQL) or the write lock (SQLite) first: concurrent attempts on
    # one intent then count one after the other and cannot all slip under the cap.
    db.session.execute(update(Intent).where(Intent.id == intent.id).values(updated_at=Intent.updated_at))
    recent = db.session.scalars(
        select(Event.payload)
        .where(
            Event.intent_id == intent.id,
            Event.type == "payment.failed",
            Event.simulated.is_(False),
            Event.created_at > now - FAILED_EVENT_WINDOW,
        )
        .limit(FAILED_EVENTS_PER_WINDOW)
    ).all()
    codes = {json.loads(payload)["data"].get("code") for payload in recent}
    if len(recent) >= FAILED_EVENTS_PER_WINDOW or code in codes:
        db.session.commit()
        log.debug("payment.failed for intent %s (%s) not sent: already told in the last hour", intent.id, code)
        return False
    record_event(
        intent.merchant_id,
        "payment.failed",
        {"intent_id": intent.id, "order_id": intent.order_id, "reason": reason, "code": code,
         "amount_usdc": from_atomic(intent.amount_atomic)},
        intent_id=intent.id,
    )  # fmt: skip
    db.session.commit()
    return True


# pg_advisory_xact_lock's first key for claims: one (merchant, network) at a time (see ``claim``).
_CLAIM_LOCK_CLASS = 0x5354


def claim_locks(intent_id: str, locks: list[tuple[int, str]]) -> None:
    """Until this transaction ends, no other claim holding any of ``locks`` ((lock class, key), taken in their
    order) passes this point."""
    if not locks:
        return
    if db.engine.dialect.name == "postgresql":
        for lock_class, key in locks:
            db.session.execute(_ADVISORY_LOCK, {"lock_class": lock_class, "key": key})
    else:
        # SQLite: a write takes the database's write lock at once and holds it to the commit (claims queue there):
        # one write holds every lock.
        db.session.execute(_TOUCH_INTENT, {"intent_id": intent_id})


def lock_intent_row(intent_id: str) -> None:
    """Until this transaction ends, no other transaction writes the intent (PostgreSQL: its row lock; SQLite: the
    database's write lock): a refund's claim counts the intent's refunds under it."""
    db.session.execute(_TOUCH_INTENT, {"intent_id": intent_id})


def merchant_network_lock(merchant_id: str, network_id: str) -> tuple[int, str]:
    """No other claim of the merchant on the network passes while this is held."""
    return _CLAIM_LOCK_CLASS, f"{merchant_id}|{network_id}"


# pg_advisory_xact_lock's first key for the cap per payer: one claim of a payer at a time (see ``claim``).
_PAYER_LOCK_CLASS = 0x5350
# Retry-After of PAYER_TOO_MANY_OPEN_PAYMENTS: open settlements finish within seconds to minutes.
PAYER_RETRY_SECONDS = 30


def payer_lock(payer: str) -> tuple[int, str]:
    """No other claim by the payer passes while this is held (taken after the (merchant, network) lock, never
    before it: no two claims wait on each other in opposite order)."""
    return _PAYER_LOCK_CLASS, payer


def count_open_of_payer(payer: str) -> int:
    """The payer's settlements that are claimed and not finished, over every merchant and network."""
    return int(db.session.scalar(_OPEN_OF_PAYER, {"payer": payer}) or 0)


def refuse_busy_payer(payer: str, open_of_payer: int) -> DomainError:
    log.warning("payer %s: %d payments open (the cap)", payer, open_of_payer)
    return DomainError(
        "PAYER_TOO_MANY_OPEN_PAYMENTS",
        f"This paying address already has {open_of_payer} payments settling, the most allowed at once; "
        "try again once they finish",
        headers={"Retry-After": str(PAYER_RETRY_SECONDS)},
        retry_after=PAYER_RETRY_SECONDS,
    )


def count_open(merchant_id: str, network_id: str) -> int:
    """The merchant's settlements on the network that are claimed and not finished."""
    return int(db.session.scalar(_OPEN_OF_MERCHANT, {"merchant_id": merchant_id, "network": network_id}) or 0)


def settlement_row(
    settlement_id: str,
    intent_id: str,
    merchant_id: str,
    network: Network,
    terms: Terms,
    start_block: int | None,
    now: datetime,
    refund_id: str | None = None,
) -> dict[str, Any]:
    """A new pending settlement's row (a payment's, or a refund's with ``refund_id``), as its claim inserts it."""
    return {
        "id": settlement_id,
        "intent_id": intent_id,
        "merchant_id": merchant_id,
        "network": network.network,
        "asset": network.usdc_address,
        **rail_for(network).columns_of(terms),  # payer, pay_to, amount_atomic, nonce and the rail's own
        "status": st.PENDING,
        "start_block": start_block,
        "created_at": now,
        "updated_at": now,
        "refund_id": refund_id,
    }


def claim(
    intent_id: str,
    merchant_id: str,
    network: Network,
    terms: Terms,
    start_block: int | None,
    admit: Callable[[int], None] | None = None,
    *,
    max_open_per_payer: int = 0,
) -> str:
    """Atomically make a new settlement the holder of the intent ``intent_id`` (of ``merchant_id``); returns its id.

    Works the same on SQLite and PostgreSQL: the conditional UPDATE succeeds for one caller only.
    ``admit(open_settlements)``, if given, decides in the same transaction whether the merchant may commit the
    relay to one more settlement on the network (it raises to refuse; nothing is then claimed), given how many
    are open: under a lock per (merchant, network) (PostgreSQL: an advisory lock; SQLite: the write lock), so
    concurrent payments are counted one after the other and cannot all pass a limit together.

    ``max_open_per_payer`` (0: none): the payer may have at most that many settlements open at once, over
    every merchant and network (429 PAYER_TOO_MANY_OPEN_PAYMENTS), counted under a lock per payer.

    Core statements built once, no ORM object: the intent is read again only when the conditional update fails
    (to say why). On any refusal the transaction is rolled back: nothing is half-written.
    """
    now = clock.now()
    open_settlements = open_of_payer = 0
    try:
        check_pay_to_current(merchant_id, network.network, terms.pay_to, lock=True)
    except DomainError:
        db.session.rollback()
        raise
    locks = [merchant_network_lock(merchant_id, network.network)] if admit is not None else []
    if max_open_per_payer:
        locks.append(payer_lock(terms.payer))
    claim_locks(intent_id, locks)
    # Counted once every lock is held (one statement when both are wanted).
    if admit is not None and max_open_per_payer:
        counted = db.session.execute(
            _OPEN_OF_BOTH, {"merchant_id": merchant_id, "network": network.network, "payer": terms.payer}
        ).one()
        open_settlements, open_of_payer = int(counted[0] or 0), int(counted[1] or 0)
    elif admit is not None:
        open_settlements = count_open(merchant_id, network.network)
    elif max_open_per_payer:
        open_of_payer = count_open_of_payer(terms.payer)
    settlement_id = prefixed_id("stl")
    row = settlement_row(settlement_id, intent_id, merchant_id, network, terms, start_block, now)
    try:
        db.session.execute(_INSERT_SETTLEMENT, row)
    except IntegrityError:
        db.session.rollback()
        raise DomainError("NONCE_ALREADY_USED", "This authorization (payer and nonce) was already submitted") from None
    claimed = db.session.execute(
        _CLAIM_INTENT, {"intent_id": intent_id, "of_merchant": merchant_id, "now": now, "settlement_id": settlement_id}
    )
    if rowcount(claimed) != 1:
        db.session.rollback()
        intent = db.session.get(Intent, intent_id, populate_existing=True)
        if intent is not None:
            check_payable(intent, now)
        raise DomainError("PAYMENT_IN_PROGRESS", "A payment for this intent is being settled; read the intent")
    if max_open_per_payer and open_of_payer >= max_open_per_payer:
        db.session.rollback()  # after the claim: a payment already in progress is told so first
        raise refuse_busy_payer(terms.payer, open_of_payer)
    if admit is not None:
        try:
            admit(open_settlements)  # after the claim: a payment already in progress is told so first
        except BaseException:
            db.session.rollback()
            raise
    db.session.commit()
    return settlement_id


def get_settlement(settlement_id: str) -> Settlement | None:
    return db.session.get(Settlement, settlement_id, populate_existing=True)


# A settlement's outcome with its intent's paid_at (the /pay answer): one statement, read fresh (no ORM object).
_OUTCOME = (
    select(
        *(_SETTLEMENTS.c[name] for name in ("status", "tx_hash", "amount_atomic", "network", "intent_id", "payer")),
        _SETTLEMENTS.c.failure_reason,
        _INTENTS.c.paid_at,
    )
    .join_from(_SETTLEMENTS, _INTENTS, _INTENTS.c.id == _SETTLEMENTS.c.intent_id)
    .where(_SETTLEMENTS.c.id == bindparam("settlement_id"))
)


def settlement_outcome(settlement_id: str) -> Row[*tuple[Any, ...]] | None:
    """The settlement's status, tx_hash, amount_atomic, network, intent_id, payer and failure_reason, and its
    intent's paid_at; None if there is no such settlement."""
    return db.session.execute(_OUTCOME, {"settlement_id": settlement_id}).first()


def settlement_counts() -> dict[tuple[str, str], int]:
    """Settlements by (network, status) (for /metrics)."""
    rows = db.session.execute(
        select(Settlement.network, Settlement.status, func.count()).group_by(Settlement.network, Settlement.status)
    )
    return {(network, status): count for network, status, count in rows}


def oldest_open_at() -> datetime | None:
    """When the oldest settlement still in flight (pending or submitted) was created; None if none is."""
    return db.session.scalar(select(func.min(Settlement.created_at)).where(Settlement.status.in_(st.OPEN)))


def mark_submitted(
    settlement_id: str, tx_hash: str, relay_address: str, *, relay_nonce: int | None, expect_tx: str | None = None
) -> bool:
    """Record the transaction hash (and its sender and, on EVM, its nonce) before it is broadcast, so a crash after
    sending is recoverable. ``relay_nonce`` is always given (None on Solana): an EVM caller that forgot it would
    blank the recorded nonce. ``expect_tx`` (the EVM fee bump's record of a replacement and its put-back): only if
    the row still names ``expect_tx`` at (``relay_address``, ``relay_nonce``): after a lock loss another attempt may
    have recorded its own transaction since, and that record stands. Returns whether the row was written."""
    now = clock.now()
    where = [Settlement.id == settlement_id, Settlement.status.in_(st.OPEN)]
    if expect_tx is not None:
        where += [func.lower(Settlement.tx_hash) == expect_tx.lower(),
                  func.lower(Settlement.relay_address) == relay_address.lower(),
                  Settlement.relay_nonce == relay_nonce]  # fmt: skip
    try:
        written = db.session.execute(
            update(Settlement)
            .where(*where)
            .values(status=st.SUBMITTED, tx_hash=tx_hash, relay_address=relay_address, relay_nonce=relay_nonce,
                    submitted_at=now, updated_at=now)
        )  # fmt: skip
        db.session.commit()
    except IntegrityError as exc:
        db.session.rollback()
        if "relay_nonce" in str(exc):  # the index uq_settlements_open_relay_nonce (names vary by engine)
            # Another open settlement holds this (account, nonce): never broadcast there (migration 0012).
            raise RelayNonceTaken(
                f"nonce {relay_nonce} of {relay_address} is recorded by another open settlement"
            ) from None
        raise
    return rowcount(written) == 1


def max_relay_nonce(network: str, relay_address: str) -> int | None:
    """The highest ``relay_nonce`` any settlement recorded for (network, relay account), whatever its status (None:
    none): a relay account's nonce manager starts above it (backend/rails/evm/accounts.py).

    On a connection of its own, returned at once: an account starts inside a settlement's send, whose chain calls
    follow, and a read in the caller's session would hold its connection (in a transaction) across them."""
    with db.engine.connect() as connection:
        found = connection.execute(
            _MAX_RELAY_NONCE, {"network": network, "relay_address": relay_address.lower()}
        ).scalar()
    return None if found is None else int(found)


_MAX_RELAY_NONCE = select(func.max(Settlement.relay_nonce)).where(
    Settlement.network == bindparam("network"), func.lower(Settlement.relay_address) == bindparam("relay_address")
)


def complete_settlement(settlement_id: str, tx_hash: str) -> bool:
    """The authorization executed on chain in ``tx_hash``: the intent is paid, with its event. False if there is
    no such settlement.

    Idempotent (a second call changes nothing). The database follows the chain: the intent is
    marked paid whatever state it is in, unless it is already paid. Each UPDATE returns what the next step needs
    (no separate reads of the settlement and the intent: two round trips fewer on every settlement). A second
    call's UPDATE matches nothing but is still a write: on SQLite it waits for the database's write lock.
    """
    if not tx_hash:
        settlement = get_settlement(settlement_id)
        if settlement is None or settlement.status == st.CONFIRMED:
            return settlement is not None
        raise ValueError("a settlement is completed with the hash of the transaction that executed it")
    now = clock.now()
    done = db.session.execute(
        update(Settlement)
        .where(Settlement.id == settlement_id, Settlement.status != st.CONFIRMED)
        .values(status=st.CONFIRMED, tx_hash=tx_hash, finished_at=now, updated_at=now,
                failure_code=None, failure_reason=None)
        .returning(Settlement.intent_id, Settlement.payer, Settlement.network, Settlement.amount_atomic,
                   Settlement.refund_id)
        .execution_options(synchronize_session=False)  # no object of the session is told (none is read here)
    ).first()  # fmt: skip
    if done is None:  # no such settlement, or another process completed it in the meantime (and wrote its event)
        exists = db.session.scalar(select(Settlement.id).where(Settlement.id == settlement_id)) is not None
        db.session.rollback()
        return exists
    intent_id, payer, network, settled_atomic, refund_id = done
    if refund_id is not None:  # a refund's authorization executed: the refund succeeded (its intent stays paid)
        refunds.mark_succeeded(refund_id, tx_hash, now)
        db.session.commit()
        return True
    paid = db.session.execute(
        update(Intent)
        .where(Intent.id == intent_id, Intent.status != PAID)
        .values(status=PAID, settlement_id=settlement_id, tx_hash=tx_hash, buyer_address=payer,
                chain=network, paid_at=now, updated_at=now)
        .returning(Intent.merchant_id, Intent.amount_atomic, Intent.order_id)
        .execution_options(synchronize_session=False)
    ).first()  # fmt: skip
    if paid is not None:
        merchant_id, amount_atomic, order_id = paid
        record_event(
            merchant_id,
            "payment.completed",
            {
                "intent_id": intent_id,
                "status": PAID,
                "amount_usdc": from_atomic(amount_atomic),
                "order_id": order_id,
                "tx_hash": tx_hash,
                "buyer_address": payer,
                "chain": network,
                "paid_at": now,
            },
            intent_id=intent_id,
        )
    else:
        # The buyer paid twice (e.g. a released authorization was executed after another one paid the
        # intent): keep a durable mark, and tell the merchant, who must refund it. Written once: this
        # branch runs only for the call that moved the settlement to confirmed.
        db.session.execute(
            update(Settlement)
            .where(Settlement.id == settlement_id)
            .values(failure_code=DUPLICATE_PAYMENT, failure_reason="executed after the intent was already paid")
            .execution_options(synchronize_session=False)
        )
        merchant_id, order_id, paid_tx_hash = db.session.execute(
            select(Intent.merchant_id, Intent.order_id, Intent.tx_hash).where(Intent.id == intent_id)
        ).one()
        record_event(
            merchant_id,
            "payment.duplicate",
            {
                "intent_id": intent_id,
                "order_id": order_id,
                "amount_usdc": from_atomic(settled_atomic),
                "tx_hash": tx_hash,
                "buyer_address": payer,
                "chain": network,
                "settlement_id": settlement_id,
                "paid_tx_hash": paid_tx_hash,
                "detected_at": now,
            },
            intent_id=intent_id,
        )
        log.error("settlement %s executed on chain but intent %s was already paid", settlement_id, intent_id)
    db.session.commit()
    return True


def duplicate_payments(intent_id: str) -> list[Settlement]:
    """Authorizations that executed after the intent was already paid (the buyer was charged again)."""
    return list(
        db.session.scalars(
            select(Settlement)
            .where(Settlement.intent_id == intent_id, Settlement.failure_code == DUPLICATE_PAYMENT)
            .order_by(Settlement.finished_at)
        )
    )


def fail_settlement(settlement_id: str, code: str, reason: str) -> bool:
    """The authorization can no longer execute: release the intent and write payment.failed.

    Only for certain failures (a revert, a cancelled or expired authorization, a refusal before
    broadcast). Returns False if the settlement was already finished. A failure after which the
    authorization may still execute (``STILL_EXECUTABLE``) puts the settlement in the watch of released
    settlements. No payment.failed for an intent that is paid: nothing failed for the merchant.
    """
    settlement = get_settlement(settlement_id)
    if settlement is None or settlement.status not in st.OPEN:
        return False
    now = clock.now()
    watch = {"watched_at": now} if code in STILL_EXECUTABLE else {}
    done = db.session.execute(
        update(Settlement)
        .where(Settlement.id == settlement_id, Settlement.status.in_(st.OPEN))
        .values(status=st.FAILED, failure_code=code, failure_reason=reason[:500], finished_at=now, updated_at=now,
                **watch)
    )  # fmt: skip
    if rowcount(done) != 1:
        db.session.rollback()
        return False
    if settlement.refund_id is not None:  # a refund's: it never held its intent, and no payment failed
        refunds.mark_failed(settlement.refund_id, code, reason, now)
        db.session.commit()
        return True
    db.session.execute(
        update(Intent)
        .where(Intent.id == settlement.intent_id, Intent.settlement_id == settlement_id, Intent.status == PENDING)
        .values(settlement_id=None, updated_at=now)
    )
    intent = db.session.get(Intent, settlement.intent_id, populate_existing=True)
    assert intent is not None
    if intent.status != PAID:
        record_event(
            intent.merchant_id,
            "payment.failed",
            {"intent_id": intent.id, "order_id": intent.order_id, "reason": reason, "code": code,
             "amount_usdc": from_atomic(intent.amount_atomic), "settlement_id": settlement_id},
            intent_id=intent.id,
        )  # fmt: skip
    db.session.commit()
    return True


def touch(settlement_id: str) -> None:
    """Mark a settlement as just handled, so the reconciler waits before looking again."""
    db.session.execute(update(Settlement).where(Settlement.id == settlement_id).values(updated_at=clock.now()))
    db.session.commit()


# Failures after which the authorization can still execute (its signature is out): a revert, an intent
# paid by another settlement before this one was sent, or a payer whose code the relay does not trust (it
# may submit the authorization itself). Such a settlement is watched (``watched_at``).
STILL_EXECUTABLE = ("SETTLEMENT_FAILED", "ALREADY_PAID", "PAYER_HAS_CODE")


def watched_settlements(limit: int) -> list[Settlement]:
    """Released settlements whose authorization may still execute, least recently watched first."""
    return list(
        db.session.scalars(
            select(Settlement).where(Settlement.watched_at.is_not(None)).order_by(Settlement.watched_at).limit(limit)
        )
    )


def mark_watched(settlement_id: str) -> None:
    """Just looked at by the watch: the others come first next time (round-robin)."""
    db.session.execute(
        update(Settlement)
        .where(Settlement.id == settlement_id, Settlement.watched_at.is_not(None))
        .values(watched_at=clock.now())
    )
    db.session.commit()


def end_watch(settlement_id: str) -> None:
    """The chain has decided this released settlement (executed and recorded, or it can never execute)."""
    now = clock.now()
    db.session.execute(
        update(Settlement).where(Settlement.id == settlement_id).values(watched_at=None, watch_done_at=now)
    )
    db.session.commit()


def open_settlements(older_than: datetime, limit: int = 200) -> list[Settlement]:
    return list(
        db.session.scalars(
            select(Settlement)
            .where(Settlement.status.in_(st.OPEN), Settlement.updated_at <= older_than)
            .order_by(Settlement.updated_at)
            .limit(limit)
        )
    )


def network_of(registry: ChainRegistry, network_id: str) -> Network:
    network = registry.get(network_id)
    if network is None:
        raise DomainError("UNSUPPORTED_NETWORK", f"Network {echo(network_id)} is not configured on this service")
    return network


__all__ = [
    "X402_VERSIONS",
    "PaymentSubmission",
    "check_payable",
    "claim",
    "complete_settlement",
    "fail_settlement",
    "mark_submitted",
    "record_failed_attempt",
    "requirement_for",
]
