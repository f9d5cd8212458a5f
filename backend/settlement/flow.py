"""``POST /api/v1/x402/pay`` as one plain function: verify, check, claim, relay, answer.

Order: the intent's state first (so a retry of a settled payment gets ALREADY_PAID, as the
spec's error table asks, whatever it carries), then the payment payload is read in any form
x402 clients send (``settlement.x402``), matched to the intent's requirement and its signature
verified (offline) and the chain asked (the rail: ``backend.rails``), then the
intent is claimed (if the merchant's relay budget and open settlements leave room: ``relay_admission``)
and the relayer is asked to submit. The answer waits for the relayer
up to ``wait_seconds``; after that the reconciler finishes the job in the background.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from backend import appstate, clock
from backend.chains.registry import ChainRegistry, Network
from backend.config import Settings
from backend.errors import DomainError, not_found
from backend.extensions import db
from backend.intents.models import Intent
from backend.logs import current_request_id
from backend.money import from_atomic
from backend.rails.base import Terms
from backend.rails.registry import rail_for
from backend.relaybudget import services as relaybudget
from backend.settlement import intake, services
from backend.settlement import models as st
from backend.settlement.services import PaymentSubmission
from backend.settlement.solana import PayeeLedger
from backend.settlement.x402 import X402Payment, normalize_payment_signature
from backend.timing import step

log = logging.getLogger(__name__)

PAY_WAIT_SECONDS = 30.0
SETTLED_KEY = "payintent:settled:{}"
_NO_FAILURE_EVENT = ("ALREADY_PAID", "PAYMENT_IN_PROGRESS")


def load_payable_intent(merchant_id: str | None, intent_id: str) -> Intent:
    """The intent to pay; scoped to the merchant when a key made the call (404 otherwise)."""
    intent = db.session.get(Intent, intent_id, populate_existing=True) if isinstance(intent_id, str) else None
    if intent is None or (merchant_id is not None and intent.merchant_id != merchant_id):
        raise not_found("Intent")
    return intent


def enqueue_settlement(redis: Redis, settlement_id: str, queue_name: str, network: str) -> None:
    """Wake a relayer of ``network`` for this settlement: its id on the network's intake list (settlement.intake),
    with this /pay call's request id, which the relayer's log lines for it carry. Nothing else is retried here:
    a settlement left open (a lost push, a failed try) is pushed again by the reconciler once STALE_AFTER old."""
    intake.push(redis, settlement_id, network, current_request_id(), base=queue_name)


def notify_settled(redis: Redis, settlement_id: str) -> None:
    """Wake the /pay call waiting for this settlement (if any)."""
    key = SETTLED_KEY.format(settlement_id)
    pipe = redis.pipeline()
    pipe.lpush(key, "1")
    pipe.expire(key, 300)
    pipe.execute()


def submit_payment(
    merchant_id: str | None,
    intent_id: str,
    payment_signature: Mapping[str, Any] | X402Payment,
    registry: ChainRegistry,
    redis: Redis,
    *,
    wait_seconds: float = PAY_WAIT_SECONDS,
    queue_name: str = "relayer",
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Settle a payment for an intent: ``payment_signature`` as any x402 client sends it (v1 or v2,
    flat or nested payload, CAIP-2 or v1 network name), or already normalised.

    ``settings`` (the app's by default) bound what the relay may spend for the merchant
    (``relaybudget.admit``, inside the claim)."""
    settings = settings or appstate.settings()
    with step("load_payable_intent"):
        intent = load_payable_intent(merchant_id, intent_id)
    now = clock.now()
    try:
        # The intent's state first: a retry of a settled payment is ALREADY_PAID whatever it carries.
        with step("check_payable"):
            services.check_payable(intent, now)
        with step("normalize_payment_signature"):
            payment = (
                payment_signature
                if isinstance(payment_signature, X402Payment)
                else normalize_payment_signature(payment_signature, registry)
            )
        with step("requirement_for"):
            submission = PaymentSubmission.of(intent.id, payment)
            requirement = services.requirement_for(intent, submission, registry)
            network = services.network_of(registry, submission.network)
        with step("check_pay_to_current"):
            # The payTo the buyer is asked to sign must still be the merchant's wallet (checked again in the claim).
            services.check_pay_to_current(intent.merchant_id, network.network, requirement["payTo"])
        with step("check_asset_current"):
            services.check_asset_current(requirement, network, "intent")
        # The rail: the payment's terms checked offline, then the chain's state before the claim.
        rail = rail_for(network)
        with step("parse_payment"):
            terms = rail.parse_payment(network, requirement, submission.payload, intent.id, now)
        # The chain's checks wait on RPCs: no database connection is held across them (a gunicorn worker runs more
        # threads than its pool has connections). Rollback, not close: the intent stays in the session (expired,
        # read again only if a refusal needs it: the claim is given its id and merchant). Nothing is pending:
        # everything so far only read.
        claimed_id, merchant = intent.id, intent.merchant_id
        db.session.rollback()
        with step("check_on_chain"):
            checked = rail.check_on_chain(network, requirement, terms, ReadThenRelease())
        with step("budget"):
            admit = relay_admission(merchant, network, checked.terms, settings)
        with step("claim"):
            settlement_id = services.claim(
                claimed_id,
                merchant,
                network,
                checked.terms,
                checked.start_block,
                admit,
                max_open_per_payer=settings.max_open_settlements_per_payer,
            )
    except DomainError as err:
        # A 5xx is the service's own trouble (a chain RPC down), not the payment failing: no payment.failed.
        if err.code not in _NO_FAILURE_EVENT and err.http_status < 500:
            db.session.rollback()
            services.record_failed_attempt(intent, err.extra.get("reason") or err.message, err.code)
        raise
    try:
        with step("enqueue_settlement"):
            enqueue_settlement(redis, settlement_id, queue_name, network.network)
        db.session.rollback()  # the claim committed: no connection is held while the relayer works
        with step("wait_settled"):
            wait_settled(redis, settlement_id, wait_seconds)
    except RedisError as exc:
        log.warning("queue unavailable for settlement %s (the reconciler will send it): %s", settlement_id, exc)
    with step("settlement_result"):
        return settlement_result(settlement_id)


class ReadThenRelease(PayeeLedger):
    """The ledger for the checks before the claim: each read ends its transaction, so the RPC calls after it (a
    Solana simulation) hold no database connection. Only there: elsewhere (the relayer) a read may sit inside
    a transaction that must go on."""

    def landed_before(self, network_id: str, owner: str, mint: str, genesis_hash: str) -> bool:
        landed = super().landed_before(network_id, owner, mint, genesis_hash)
        db.session.rollback()
        return landed


# A pool's connection class's default socket timeout (making a connection object costs a /pay 3-4 % of its CPU).
_DEFAULT_SOCKET_TIMEOUT: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def client_socket_timeout(redis: Redis) -> float | None:
    """The socket timeout of the client's connections: the one it was made with, else its connection class's
    default (redis-py 8: 5 s, which ``from_url`` does not put in ``connection_kwargs``)."""
    pool = redis.connection_pool
    if "socket_timeout" in pool.connection_kwargs:
        timeout = pool.connection_kwargs["socket_timeout"]
    else:  # a connection object as the pool would make it (not connected, not counted by the pool), once per pool
        if pool not in _DEFAULT_SOCKET_TIMEOUT:
            made = pool.connection_class(**pool.connection_kwargs)
            _DEFAULT_SOCKET_TIMEOUT[pool] = getattr(made, "socket_timeout", None)
        timeout = _DEFAULT_SOCKET_TIMEOUT[pool]
    return float(timeout) if isinstance(timeout, int | float) and timeout > 0 else None


def wait_settled(redis: Redis, settlement_id: str, wait_seconds: float) -> bool:
    """Wait up to ``wait_seconds`` for the relayer's word on this settlement (``notify_settled``); whether it came.

    In BLPOPs each shorter than the client's socket timeout: redis-py's default is 5 s, and a BLPOP that blocks
    longer raises TimeoutError when it runs out (the /pay then answered 504 after 5 s, not PAY_WAIT_SECONDS).
    The word stays in its list (5 minutes) between two of them: none is missed."""
    key = SETTLED_KEY.format(settlement_id)
    socket_timeout = client_socket_timeout(redis)
    longest = max(socket_timeout - 1.0, socket_timeout / 2) if socket_timeout else wait_seconds
    deadline = time.monotonic() + wait_seconds
    while (left := deadline - time.monotonic()) > 0:
        # Never 0: a BLPOP timeout of 0 blocks for ever.
        if redis.blpop([key], timeout=max(min(left, longest), 0.01)) is not None:
            return True
    return False


def relay_admission(merchant_id: str, network: Network, terms: Terms, settings: Settings) -> Callable[[int], None]:
    """What the claim asks before it commits the relay to this settlement: the merchant's relay budget on
    the network must hold what it spent, what its open settlements may still cost, and this one's most
    (Solana: its exact fee; EVM: ``relaybudget.max_settlement_cost``). Costs are worked out here, before
    the claim takes its lock: the EVM estimate may read the chain (the gas price, before its one query, so
    no transaction is open across that RPC; ``merchant_id`` is handed in, not read from the intent, whose
    reload would open one first)."""
    if relaybudget.budget_atomic(network, settings) is None:
        open_cost = cost = 0  # unlimited: only the cap on open settlements applies
    else:
        open_cost = relaybudget.max_settlement_cost(network, settings, merchant_id)
        cost = rail_for(network).settlement_cost(terms, open_cost)

    def admit(open_settlements: int) -> None:
        relaybudget.admit(
            merchant_id, network, settings, cost=cost, open_settlements=open_settlements, open_cost=open_cost
        )

    return admit


def settlement_result(settlement_id: str) -> dict[str, Any]:
    """The /pay answer for a settlement: its success data, or the error it ended with."""
    settlement = services.settlement_outcome(settlement_id)  # one statement, its intent's paid_at with it
    assert settlement is not None
    if settlement.status == st.CONFIRMED:
        return {
            "tx_hash": settlement.tx_hash,
            "settled_at": clock.isoformat(settlement.paid_at),
            "amount_usdc": from_atomic(settlement.amount_atomic),
            "network": settlement.network,
            "intent_id": settlement.intent_id,
            "buyer_address": settlement.payer,
        }
    if settlement.status == st.FAILED:
        raise DomainError(
            "SETTLEMENT_FAILED",
            "The payment could not be settled on chain; the intent is still payable",
            reason=settlement.failure_reason,
        )
    raise DomainError(
        "SETTLEMENT_PENDING",
        "The payment is accepted and still settling; read the intent for its outcome (it finishes in the background)",
        intent_id=settlement.intent_id,
        tx_hash=settlement.tx_hash,
    )
