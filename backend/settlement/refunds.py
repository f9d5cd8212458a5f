"""Paying a refund: the merchant's payout wallet signs an authorization to the buyer, and the relay settles it.

The same machinery as a payment, in the other direction (docs/architecture.md, "Refunds"): the signed payload is
read in any x402 form (``settlement.x402``), matched to the refund's one requirement and checked offline and on
chain by the network's rail, then *claimed*: a settlement row with ``refund_id`` set is written, in one transaction
with the refund's step from ``requires_signature`` to ``processing`` (``intents.refunds.begin``: one settlement per
refund) and under the intent's lock, after counting what the intent's other refunds have paid back or still may.
The relayer sends it like any settlement; its confirmation marks the refund succeeded
(``settlement.services.complete_settlement``), its failure marks it failed. A refund settlement never holds nor
pays its intent.

What is checked beyond a payment's checks: the authorization is from the wallet the payment landed in (the
intent's ``payTo`` on its paid network, ``Refund.pay_from``), to the buyer, for exactly the refund's amount.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import and_, exists, select
from sqlalchemy.exc import IntegrityError

from backend import appstate, clock
from backend.chains.registry import ChainRegistry, Network
from backend.config import Settings
from backend.errors import DomainError
from backend.extensions import db
from backend.ids import prefixed_id
from backend.intents import refunds
from backend.intents.models import FAILED, REQUIRES_SIGNATURE, SUCCEEDED, Intent, Refund
from backend.rails.base import Terms
from backend.rails.registry import rail_for
from backend.settlement import services, solana
from backend.settlement.flow import enqueue_settlement, relay_admission, wait_settled
from backend.settlement.models import Settlement
from backend.settlement.reconcile import REFUND_LEDGER
from backend.settlement.services import PaymentSubmission
from backend.settlement.x402 import normalize_payment_signature

log = logging.getLogger(__name__)

_SETTLEMENTS = Settlement.__table__
_REFUNDS = Refund.__table__
# A failed refund whose authorization may still execute: its settlement was released while its signature is out
# (a revert, a refusal before the send), so the watch of released settlements still looks at it.
MAY_STILL_EXECUTE = exists(
    select(_SETTLEMENTS.c.id).where(
        and_(_SETTLEMENTS.c.refund_id == _REFUNDS.c.id, _SETTLEMENTS.c.watched_at.is_not(None))
    )
)


def create_refund(merchant_id: str, intent_id: str, amount_usdc: Any, reason: str | None, base_url: str) -> Refund:
    """A refund of the merchant's paid intent, waiting for its payout wallet's signature (``intents.refunds``).
    ``base_url``: the service's public URL (CHECKOUT_HOST: never a host the client named)."""
    resource = f"{base_url.rstrip('/')}/api/v1/refunds/{{refund_id}}"
    return refunds.create_refund(merchant_id, intent_id, amount_usdc, reason, resource, MAY_STILL_EXECUTE)


def refundable_atomic(intent: Intent) -> int:
    return refunds.refundable_atomic(intent, MAY_STILL_EXECUTE)


def _not_payable(refund: Refund) -> DomainError:
    return DomainError(
        "REFUND_NOT_PAYABLE",
        f"This refund is {refund.status}: a refund is signed and sent once (create another one to refund more)",
        status=refund.status,
        tx_hash=refund.tx_hash,
    )


def claim_refund(
    refund_id: str,
    network: Network,
    terms: Terms,
    start_block: int | None,
    admit: Callable[[int], None] | None = None,
    *,
    max_open_per_payer: int = 0,
) -> str:
    """Make a new settlement the one that pays the refund ``refund_id``; returns its id.

    Under the locks a payment's claim takes ((merchant, network) and payer, when counting), then the intent's row
    (PostgreSQL: its row lock; SQLite: the database's write lock): every claim of a refund of the intent counts
    the others' amounts one after the other, so concurrent refunds cannot together exceed what was paid. On any
    refusal the transaction is rolled back: nothing is half-written."""
    now = clock.now()
    refund = db.session.get(Refund, refund_id, populate_existing=True)
    assert refund is not None
    intent_id, merchant_id, amount = refund.intent_id, refund.merchant_id, refund.amount_atomic
    locks = [services.merchant_network_lock(merchant_id, network.network)] if admit is not None else []
    if max_open_per_payer:
        locks.append(services.payer_lock(terms.payer))
    services.claim_locks(intent_id, locks)
    services.lock_intent_row(intent_id)
    try:
        settlement_id = prefixed_id("stl")
        # First the refund's own step, under the lock: a second payment of the same refund is told so (a replay),
        # not that the refunds are used up (they count this one, from here on).
        if not refunds.begin(refund_id, settlement_id, now):
            raise _not_payable(db.session.get(Refund, refund_id, populate_existing=True) or refund)
        intent = db.session.get(Intent, intent_id, populate_existing=True)
        assert intent is not None
        refunds.check_refundable(intent)
        # What the intent's other refunds reserve (this one is counted from its step above).
        others = refunds.reserved_atomic(intent_id, MAY_STILL_EXECUTE) - amount
        if others + amount > intent.amount_atomic:
            raise refunds.exceeds(amount, max(intent.amount_atomic - others, 0))
        open_settlements = services.count_open(merchant_id, network.network) if admit is not None else 0
        open_of_payer = services.count_open_of_payer(terms.payer) if max_open_per_payer else 0
        row = services.settlement_row(
            settlement_id, intent_id, merchant_id, network, terms, start_block, now, refund_id
        )
        try:
            db.session.execute(_SETTLEMENTS.insert(), row)
        except IntegrityError:
            raise DomainError(
                "NONCE_ALREADY_USED", "This authorization (payer and nonce) was already submitted"
            ) from None
        if max_open_per_payer and open_of_payer >= max_open_per_payer:
            raise services.refuse_busy_payer(terms.payer, open_of_payer)
        if admit is not None:
            admit(open_settlements)
    except BaseException:
        db.session.rollback()
        raise
    db.session.commit()
    return settlement_id


def submit_refund(
    merchant_id: str,
    refund_id: str,
    payment_signature: Mapping[str, Any],
    registry: ChainRegistry,
    redis: Redis,
    *,
    wait_seconds: float,
    queue_name: str = "relayer",
    settings: Settings | None = None,
) -> tuple[Refund, bool]:
    """Settle the merchant's signed refund: (the refund as it is after the wait, whether it is finished).

    Raises as ``/pay`` does for a payload that does not pay the refund's requirement, and REFUND_SIGNER_MISMATCH
    for one not signed by the refund's ``pay_from`` wallet; REFUND_NOT_PAYABLE once it was claimed (a replay)."""
    settings = settings or appstate.settings()
    refund = refunds.get_refund(merchant_id, refund_id)
    if refund.status != REQUIRES_SIGNATURE:
        raise _not_payable(refund)
    now = clock.now()
    payment = normalize_payment_signature(payment_signature, registry)
    submission = PaymentSubmission.of(refund.id, payment)
    requirement = services.match_requirement([refund.requirement], submission, registry, "refund")
    network = services.network_of(registry, submission.network)
    services.check_asset_current(requirement, network, "refund")
    rail = rail_for(network)
    terms = rail.parse_payment(network, requirement, submission.payload, refund.id, now)
    if not rail.same_address(terms.payer, refund.pay_from):
        raise DomainError(
            "REFUND_SIGNER_MISMATCH",
            f"A refund is paid from the wallet the payment landed in ({refund.pay_from}), which must sign it; "
            f"this one is signed by {terms.payer}",
            pay_from=refund.pay_from,
        )
    refund_id, merchant = refund.id, refund.merchant_id
    db.session.rollback()  # only reads so far: no connection is held across the chain's reads
    checked = rail.check_on_chain(network, requirement, terms, REFUND_LEDGER)
    admit = relay_admission(merchant, network, checked.terms, settings)
    settlement_id = claim_refund(
        refund_id,
        network,
        checked.terms,
        checked.start_block,
        admit,
        max_open_per_payer=settings.max_open_settlements_per_payer,
    )
    try:
        enqueue_settlement(redis, settlement_id, queue_name, network.network)
        db.session.rollback()
        wait_settled(redis, settlement_id, wait_seconds)
    except RedisError as exc:
        log.warning("queue unavailable for refund %s (the reconciler will send it): %s", refund_id, exc)
    refund = refunds.get_refund(merchant_id, refund_id)
    if refund.status == FAILED:
        raise DomainError(
            "SETTLEMENT_FAILED",
            "The refund could not be settled on chain; nothing moved. Its signed authorization may still execute "
            "until its validBefore (anyone holding it can submit it: the service records it if so), so its amount "
            "stays reserved until then; create a new refund after that, or cancel the authorization on chain",
            reason=refund.failure_reason,
            refund_id=refund.id,
        )
    return refund, refund.status == SUCCEEDED


def prepare_refund_transaction(merchant_id: str, refund_id: str, settings: Settings) -> dict[str, Any]:
    """Solana: the transaction the merchant's payout wallet signs to pay the refund (relay as fee payer, the
    refund's amount from the wallet's USDC account to the buyer's, the refund id as memo)."""
    refund = refunds.get_refund(merchant_id, refund_id)
    if refund.status != REQUIRES_SIGNATURE:
        raise _not_payable(refund)
    network = services.network_of(appstate.chains(), refund.network)
    if not rail_for(network).prepares_transaction:
        raise DomainError(
            "UNSUPPORTED_NETWORK", f"The refund is on {network.network}, where the payout wallet signs typed data"
        )
    return solana.prepare_for(
        network, refund.requirement, refund.pay_from, refund.id, refund.merchant_id, settings, payee_rule=False
    )


__all__ = ["MAY_STILL_EXECUTE", "claim_refund", "create_refund", "prepare_refund_transaction", "submit_refund"]
