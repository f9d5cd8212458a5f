"""The x402 facilitator API: ``supported``, ``verify`` and ``settle`` for resource servers that use the official
x402 middlewares, on top of the same checks, claim and relayer as ``POST /api/v1/x402/pay``.

A resource server sends what its buyer sent (``paymentPayload``) and what it asked for (``paymentRequirements``).
Here the requirement is checked against the calling merchant (scheme ``exact``, a configured EVM network, the
network's USDC, a ``payTo`` that is the merchant's wallet there, an amount within the service's bounds) and
turned into our own requirement (``intents.services.requirement_on``: the token's EIP-712 domain as we know it).
Then the payload goes through the checks ``/pay`` runs (``settlement.x402``, the rail's ``parse_payment`` and,
for ``verify``, its ``check_on_chain``). ``settle`` records the payment as an intent of the merchant, paid through
``settlement.flow.submit_payment``: the exactly-once claim, the pipelined relayer, ``payment.completed``.

The intent's id is derived from the payment (an HMAC under a key derived from the server's secret, shaped as a
UUID4, so it is no more guessable than a random one): the same authorization settled again finds the same intent,
and the money moves once. ``success`` is answered once per payment (a resource server serves each success), the
others carry the first result's transaction; the x402 ``payment-identifier`` extension's id, when sent, keys the
intent instead, and a retry of the same payment under it gets the paid result again (the extension's contract),
while the same id with another payment is refused. docs/x402.md, "Facilitator API".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from sqlalchemy.exc import IntegrityError

from backend.chains.registry import ChainRegistry, Network, resolve_x402_network
from backend.config import Settings
from backend.errors import CATALOG, DomainError
from backend.extensions import db
from backend.intents import services as intents
from backend.intents.models import PAID, Intent
from backend.money import from_atomic, to_atomic
from backend.rails.registry import rail_for
from backend.settlement import services as settlements
from backend.settlement.flow import submit_payment
from backend.settlement.solana import PayeeLedger
from backend.settlement.x402 import X402_VERSIONS, X402Payment, check_accepted, normalize_payment_signature

PAYMENT_IDENTIFIER = "payment-identifier"
PAYMENT_ID_PATTERN = r"^[A-Za-z0-9_-]{16,128}\Z"  # the extension's own rule
RESOURCE_MAX_LENGTH = 2048
DESCRIPTION_MAX_LENGTH = 500  # an intent's description
METADATA_VALUE_MAX = 500  # an intent's metadata value (backend.schemas)
_UINT = r"^[0-9]{1,78}\Z"

# Our error codes as the x402 facilitator spec's reasons (those the spec names; the rest: the closest).
REASONS: dict[str, str] = {
    "INVALID_PAYLOAD": "invalid_payload",
    "PAYER_IS_RECIPIENT": "invalid_payload",
    "PAYER_HAS_CODE": "invalid_payload",
    "UNSUPPORTED_X402_VERSION": "invalid_x402_version",
    "UNSUPPORTED_SCHEME": "unsupported_scheme",
    "UNSUPPORTED_NETWORK": "invalid_network",
    "RECIPIENT_MISMATCH": "invalid_exact_evm_payload_recipient_mismatch",
    "AMOUNT_MISMATCH": "invalid_exact_evm_payload_authorization_value",
    "ASSET_MISMATCH": "invalid_payment_requirements",
    "REQUIREMENT_OUTDATED": "invalid_payment_requirements",
    "AUTHORIZATION_NOT_YET_VALID": "invalid_exact_evm_payload_authorization_valid_after",
    "AUTHORIZATION_EXPIRED": "invalid_exact_evm_payload_authorization_valid_before",
    "AUTHORIZATION_TOO_LONG": "invalid_exact_evm_payload_authorization_valid_before",
    "INVALID_SIGNATURE": "invalid_exact_evm_payload_signature",
    "NONCE_ALREADY_USED": "invalid_exact_evm_nonce_already_used",
    "INTENT_EXPIRED": "invalid_transaction_state",
    "INTENT_CANCELLED": "invalid_transaction_state",
    "ALREADY_PAID": "invalid_transaction_state",
    "SETTLEMENT_PENDING": "settlement_pending",
    "PAYMENT_IN_PROGRESS": "settlement_pending",
}
# Our refusals for a want of room, not a bad payment (429, Retry-After): answered with their status.
_BUSY = ("RELAY_BUDGET_EXHAUSTED", "TOO_MANY_OPEN_SETTLEMENTS", "PAYER_TOO_MANY_OPEN_PAYMENTS", "RATE_LIMITED")


class Refusal(Exception):
    """The spec's answer that a payment is not valid or not settled: ``reason`` (its code), ``message``, and the HTTP
    status (200: a refusal the client reads; 400: the request itself cannot be read; 5xx: our own trouble)."""

    def __init__(self, reason: str, code: str, message: str, *, status: int = 200, payer: str | None = None) -> None:
        if code not in CATALOG:
            raise ValueError(f"error code {code!r} is not in backend.errors.CATALOG")
        super().__init__(message)
        self.reason, self.code, self.message, self.status, self.payer = reason, code, message, status, payer
        self.headers: dict[str, str] = {}
        self.transaction = ""  # settle: the transaction sent, when one was (a settlement still pending)

    @classmethod
    def of(cls, err: DomainError, payer: str | None = None, *, settle: bool = True) -> Refusal:
        """``err`` in the spec's terms: its reason; 200 for a refusal of the payment, its own status for our trouble
        (5xx) or a want of room (429, with Retry-After)."""
        reason = REASONS.get(err.code)
        if (
            reason is None
            and err.code == "SETTLEMENT_FAILED"
            and "insufficient balance" in str(err.extra.get("reason"))
        ):
            reason = "insufficient_funds"
        ours = (err.http_status >= 500 or err.code in _BUSY) and err.code != "SETTLEMENT_PENDING"
        status = err.http_status if ours else 200
        if reason is None:
            unexpected = "unexpected_settle_error" if settle else "unexpected_verify_error"
            reason = unexpected if ours else "invalid_payload"
        reasons = err.extra.get("reason")
        refusal = cls(reason, err.code, f"{err.message} ({reasons})" if reasons else err.message, status=status)
        refusal.payer, refusal.headers = payer, dict(err.headers)
        tx_hash = err.extra.get("tx_hash")
        refusal.transaction = tx_hash if isinstance(tx_hash, str) else ""
        return refusal


def _bad_requirements(message: str) -> Refusal:
    return Refusal("invalid_payment_requirements", "INVALID_PAYMENT_REQUIREMENTS", message)


@dataclass(frozen=True)
class Checked:
    """A facilitator request read and checked offline: our requirement, the payment, its terms."""

    network: Network
    network_as_sent: str  # as the resource server wrote it (a v1 name, or the CAIP-2 id)
    requirement: dict[str, Any]
    payment: X402Payment
    terms: Any
    payer: str
    resource: str | None
    description: str | None
    payment_id: str | None
    digest: str  # of what the payment moves (``_digest``): a payment-identifier's retry must carry the same


def supported(wallets: Mapping[str, str], registry: ChainRegistry) -> dict[str, Any]:
    """What this merchant can be paid with here: ``exact`` on each configured EVM network it has a wallet on, in x402
    v2 (CAIP-2) and, where the network has a v1 name, v1."""
    kinds: list[dict[str, Any]] = []
    for network in registry:
        # A rail that prepares the buyer's transaction (Solana: ours carries the intent's memo) cannot settle a
        # payload a public client built by itself.
        if rail_for(network).prepares_transaction or network.network not in wallets:
            continue
        extra = requirement_template(network, wallets[network.network])
        kinds.append({"x402Version": 2, "scheme": "exact", "network": network.network, "extra": extra})
        if network.x402_v1_name:
            kinds.append({"x402Version": 1, "scheme": "exact", "network": network.x402_v1_name, "extra": extra})
    return {"kinds": kinds, "extensions": [PAYMENT_IDENTIFIER], "signers": {}}


# A requirement's fields that name the resource and its price: the rest is the network's and the merchant's.
_PER_RESOURCE = frozenset({"scheme", "network", "maxAmountRequired", "resource", "description", "mimeType"})


def requirement_template(network: Network, wallet: str) -> dict[str, Any]:
    """A kind's ``extra`` (ours): the fields of a requirement for this merchant on ``network`` that do not depend on
    the resource (``payTo``, ``asset``, ``maxTimeoutSeconds``, the token's domain), so that a resource server (our
    paywall) builds its 402s without an API call per request. The official middlewares ignore it."""
    requirement = intents.requirement_on(network, wallet, 0, "", "")
    return {key: value for key, value in requirement.items() if key not in _PER_RESOURCE}


def _mapping(value: Any, reason: str, code: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise Refusal(reason, code, f"{what} must be a JSON object", status=400)
    return value


def _text(container: Mapping[str, Any], key: str, limit: int) -> str | None:
    value = container.get(key)
    return value[:limit] if isinstance(value, str) and value else None


def _amount(requirements: Mapping[str, Any], version: int, settings: Settings) -> int:
    keys = ("amount", "maxAmountRequired") if version == 2 else ("maxAmountRequired", "amount")
    value = next((requirements[key] for key in keys if key in requirements), None)
    if isinstance(value, bool) or not isinstance(value, str | int) or not re.match(_UINT, str(value)):
        raise _bad_requirements(
            f"paymentRequirements.{keys[0]} must be a decimal string of an unsigned integer (atomic units)"
        )
    amount = int(str(value))
    if amount <= 0 or amount > to_atomic(settings.max_amount_usdc):
        raise _bad_requirements(
            f"the amount must be above 0 and at most {settings.max_amount_usdc} USDC ({amount} atomic units asked)"
        )
    return amount


def _payment_id(payload: Mapping[str, Any]) -> str | None:
    """The x402 ``payment-identifier`` extension's id, if the payload carries one (a malformed one is refused)."""
    extensions = payload.get("extensions")
    if not isinstance(extensions, Mapping) or PAYMENT_IDENTIFIER not in extensions:
        return None
    info = extensions[PAYMENT_IDENTIFIER]
    info = info.get("info") if isinstance(info, Mapping) else None
    if not isinstance(info, Mapping) or "id" not in info:
        return None
    payment_id = info["id"]
    if not isinstance(payment_id, str) or not re.match(PAYMENT_ID_PATTERN, payment_id):
        malformed = "extensions.payment-identifier.info.id must be 16 to 128 characters of A-Z, a-z, 0-9, _ and -"
        raise Refusal("invalid_payload", "INVALID_PAYLOAD", malformed)
    return payment_id


def _digest(network: Network, terms: Any) -> str:
    """What the payment moves, whatever shape it came in: the network, the token, who pays whom how much, and the
    authorization's window and nonce (a retry in another form, or with other requirement fields, is the same)."""
    moved = [network.network, network.usdc_address.lower(), terms.payer.lower(), terms.pay_to.lower(),
             str(terms.value), str(terms.valid_after), str(terms.valid_before), terms.nonce.hex()]  # fmt: skip
    return hashlib.sha256(json.dumps(moved).encode()).hexdigest()


def check(
    merchant_id: str,
    wallets: Mapping[str, str],
    body: Any,
    registry: ChainRegistry,
    settings: Settings,
    now: datetime,
) -> Checked:
    """Read a ``verify``/``settle`` body and run every offline check (no chain, no write). Raises ``Refusal``."""
    body = _mapping(body, "invalid_payload", "INVALID_PAYLOAD", "The body")
    payload = _mapping(body.get("paymentPayload"), "invalid_payload", "INVALID_PAYLOAD", "paymentPayload")
    requirements = _mapping(
        body.get("paymentRequirements"),
        "invalid_payment_requirements",
        "INVALID_PAYMENT_REQUIREMENTS",
        "paymentRequirements",
    )
    version = body.get("x402Version", payload.get("x402Version"))
    if type(version) is not int or version not in X402_VERSIONS:
        raise Refusal(
            "invalid_x402_version", "UNSUPPORTED_X402_VERSION", f"x402Version must be one of {list(X402_VERSIONS)}"
        )
    if payload.get("x402Version") != version:
        raise Refusal(
            "invalid_x402_version",
            "UNSUPPORTED_X402_VERSION",
            "paymentPayload.x402Version must be the request's x402Version",
        )
    if requirements.get("scheme") != "exact":
        raise Refusal("unsupported_scheme", "UNSUPPORTED_SCHEME", "Only the 'exact' scheme is supported")
    network_as_sent = requirements.get("network")
    network = (
        registry.get(resolve_x402_network(network_as_sent, registry))
        if isinstance(network_as_sent, str) and len(network_as_sent) <= 64
        else None
    )
    if network is None or rail_for(network).prepares_transaction:
        message = (
            "paymentRequirements.network must be one of this facilitator's EVM networks (GET /supported); "
            f"got {str(network_as_sent)[:64]!r}"
        )
        raise Refusal("invalid_network", "UNSUPPORTED_NETWORK", message)
    assert isinstance(network_as_sent, str)
    amount = _amount(requirements, version, settings)
    asset, pay_to = requirements.get("asset"), requirements.get("payTo")
    rail = rail_for(network)
    if not isinstance(asset, str) or not rail.same_address(asset, network.usdc_address):
        raise _bad_requirements(
            f"paymentRequirements.asset must be the USDC contract on {network.network}, {network.usdc_address}"
        )
    wallet = wallets.get(network.network)
    if not isinstance(pay_to, str) or wallet is None or not rail.same_address(pay_to, wallet):
        raise _bad_requirements(
            f"paymentRequirements.payTo must be your wallet on "
            f"{network.network} (this facilitator relays only to its merchants' wallets)"
        )
    resource_info = payload.get("resource") if version == 2 else None
    resource_info = resource_info if isinstance(resource_info, Mapping) else requirements
    resource = _text(resource_info, "url" if resource_info is not requirements else "resource", RESOURCE_MAX_LENGTH)
    description = _text(resource_info, "description", DESCRIPTION_MAX_LENGTH)
    try:
        requirement = intents.requirement_on(network, wallet, amount, resource or "", description or "")
        payment = normalize_payment_signature(payload, registry)
        if payment.scheme != "exact":
            raise Refusal("unsupported_scheme", "UNSUPPORTED_SCHEME", "the payment's scheme must be 'exact'")
        if payment.network != network.network:
            raise Refusal("invalid_network", "UNSUPPORTED_NETWORK", "the payment's network is not the requirement's")
        if payment.accepted is not None:
            check_accepted(payment.accepted, requirement, registry)
        terms = rail.parse_payment(network, requirement, payment.payload, "", now)
    except DomainError as err:
        raise Refusal.of(err) from None
    return Checked(
        network=network,
        network_as_sent=network_as_sent,
        requirement=requirement,
        payment=payment,
        terms=terms,
        payer=terms.payer,
        resource=resource,
        description=description,
        payment_id=_payment_id(payload),
        digest=_digest(network, terms),
    )


def verify(checked: Checked, *, settle: bool = False) -> dict[str, Any]:
    """The chain's checks ``/pay`` runs before its claim (nonce unused, validAfter passed on chain, a plain payer,
    the balance), without moving money."""
    network = checked.network
    try:
        rail_for(network).check_on_chain(network, checked.requirement, checked.terms, PayeeLedger())
    except DomainError as err:
        raise Refusal.of(err, checked.payer, settle=settle) from None
    finally:
        db.session.rollback()  # only reads: no connection held after the answer
    return {"isValid": True, "payer": checked.payer}


def payment_intent_id(secret: str, merchant_id: str, checked: Checked) -> str:
    """The intent a payment is recorded as: keyed by its payment-identifier if sent, else by its authorization
    (network, payer, nonce)."""
    nonce = checked.terms.nonce.hex()
    return derived_intent_id(secret, merchant_id, checked.network.network, checked.payer, nonce, checked.payment_id)


def derived_intent_id(
    secret: str, merchant_id: str, network_id: str, payer: str, nonce_hex: str, payment_id: str | None = None
) -> str:
    """An HMAC under the server's secret of the payment's key, as a UUID4 (as unguessable as a random one: the
    hosted checkout takes an intent id as its capability). ``nonce_hex``: the authorization's nonce, no 0x."""
    if payment_id is not None:
        key = f"{merchant_id}|payment-identifier|{payment_id}"
    else:
        key = f"{merchant_id}|authorization|{network_id}|{payer.lower()}|{nonce_hex.lower().removeprefix('0x')}"
    own = hmac.new(secret.encode(), b"payintent facilitator intent id", hashlib.sha256).digest()  # this use's key
    digest = hmac.new(own, key.encode(), hashlib.sha256).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


def _intent_row(
    merchant_id: str, intent_id: str, checked: Checked, registry: ChainRegistry, settings: Settings
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"source": "x402-facilitator", "x402_payment_digest": checked.digest}
    if checked.resource:
        metadata["x402_resource"] = checked.resource[:METADATA_VALUE_MAX]
    if checked.payment_id:
        metadata["x402_payment_id"] = checked.payment_id
    params = intents.NewIntent(
        amount_usdc=from_atomic(int(checked.requirement["maxAmountRequired"])),
        description=checked.description,
        metadata=metadata,
    )
    return intents.new_intent(merchant_id, params, registry, settings.checkout_host, intent_id=intent_id,
                              requirements=[checked.requirement])  # fmt: skip


def _record(merchant_id: str, intent_id: str, checked: Checked, registry: ChainRegistry, settings: Settings) -> None:
    """The payment's intent, written now (a concurrent settle of the same payment that wrote it first wins; this one
    then finds it). It lives as long as the authorization may still be settled, at least INTENT_TTL."""
    row = _intent_row(merchant_id, intent_id, checked, registry, settings)
    row["expires_at"] = max(row["expires_at"], datetime.fromtimestamp(checked.terms.valid_before, UTC))
    try:
        intents.insert_intent(row)
    except IntegrityError:
        db.session.rollback()
        try:  # a concurrent settle wrote it first: with a payment-identifier, it must be for this very payment
            written = _current(intent_id)
            if written is not None:
                _check_same_payment(written, checked)
        finally:
            db.session.rollback()


def _check_same_payment(intent: Intent, checked: Checked) -> None:
    """A payment-identifier's record names one payment: another one under the same id is refused (409)."""
    if checked.payment_id is not None and (intent.meta or {}).get("x402_payment_digest") != checked.digest:
        reused = "this payment-identifier was already used with a different payment; send a new id for a new payment"
        raise Refusal("invalid_payload", "PAYMENT_IDENTIFIER_REUSED", reused, status=409, payer=checked.payer)


def _earlier(intent: Intent, checked: Checked) -> dict[str, Any] | None:
    """An earlier settle of this payment, as this call's answer: with a payment-identifier, its paid result again
    (the extension's retry); else a refusal that carries its transaction: one payment is answered ``success`` once,
    so a resource server serves it once (N calls with one authorization would otherwise buy N resources). A
    settlement still in flight: ``settlement_pending``. None: nothing settled or in flight (settle it now)."""
    _check_same_payment(intent, checked)
    if intent.status == PAID:
        if checked.payment_id is not None:
            return _paid(intent, checked)
        settled = f"this authorization was already settled by an earlier call (transaction {intent.tx_hash}); " \
                  "a payment is settled, and answered success, once"  # fmt: skip
        refusal = Refusal("invalid_exact_evm_nonce_already_used", "NONCE_ALREADY_USED", settled, payer=checked.payer)
        refusal.transaction = intent.tx_hash or ""
        raise refusal
    if intent.settlement_id is not None:
        outcome = settlements.settlement_outcome(intent.settlement_id)
        pending = "an earlier call's settlement of this payment is still in flight; settle it again for its result"
        refusal = Refusal("settlement_pending", "PAYMENT_IN_PROGRESS", pending, payer=checked.payer)
        refusal.transaction = (outcome.tx_hash if outcome is not None else None) or ""
        raise refusal
    return None


def _current(intent_id: str) -> Intent | None:
    return db.session.get(Intent, intent_id, populate_existing=True)


def _paid(intent: Intent, checked: Checked) -> dict[str, Any]:
    """The first result of a payment settled before (its intent paid): refused if the intent was paid by another
    payer (only the merchant's own ``/pay`` could do that)."""
    if intent.buyer_address and not rail_for(checked.network).same_address(intent.buyer_address, checked.payer):
        raise Refusal("invalid_transaction_state", "ALREADY_PAID", "this payment's record was paid by another payer",
                      payer=checked.payer)  # fmt: skip
    return _settled(intent.tx_hash or "", intent.buyer_address, str(intent.amount_atomic), checked)


def _settled(transaction: str, payer: str | None, amount: str, checked: Checked) -> dict[str, Any]:
    """The spec's answer for a settled payment."""
    return {
        "success": True,
        "transaction": transaction,
        "network": checked.network_as_sent,
        "payer": payer or checked.payer,
        "amount": amount,
    }


def settle(
    merchant_id: str,
    checked: Checked,
    registry: ChainRegistry,
    redis: Redis,
    settings: Settings,
    *,
    wait_seconds: float,
) -> dict[str, Any]:
    """Settle through ``/pay``'s engine, recorded as the merchant's intent. The money moves once; ``success`` is
    answered once per payment (``_earlier``), or again for a payment-identifier's retry."""
    intent_id = payment_intent_id(settings.secret_key, merchant_id, checked)
    try:
        intent = _current(intent_id)
        if intent is not None and intent.merchant_id != merchant_id:
            raise Refusal("unexpected_settle_error", "INTERNAL_ERROR", "the payment's record is not yours", status=500)
        answer = _earlier(intent, checked) if intent is not None else None
    finally:
        db.session.rollback()
    if answer is not None:
        return answer
    if intent is None:
        verify(checked, settle=True)  # the chain's checks first: a payment refused there leaves no record
        _record(merchant_id, intent_id, checked, registry, settings)
    try:
        result = submit_payment(merchant_id, intent_id, checked.payment, registry, redis, wait_seconds=wait_seconds,
                                queue_name=settings.relayer_queue, settings=settings)  # fmt: skip
    except DomainError as err:
        if err.code in ("ALREADY_PAID", "PAYMENT_IN_PROGRESS", "NONCE_ALREADY_USED"):
            # Another call of the same payment got the claim (or the authorization's row) first: its state now.
            try:
                current = _current(intent_id)
                answer = _earlier(current, checked) if current is not None else None
            finally:
                db.session.rollback()
            if answer is not None:
                return answer
        raise Refusal.of(err, checked.payer) from None
    return _settled(result["tx_hash"], result["buyer_address"], checked.requirement["maxAmountRequired"], checked)
