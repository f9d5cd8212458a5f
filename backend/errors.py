"""Domain errors and the error catalog: one table of every error code, its HTTP status and what it means.

Services raise :class:`DomainError` (or a subclass) with a code and a message; they never choose an HTTP
status. :data:`CATALOG` maps each code to its status and a description; each entry point translates:
the REST API (``backend.http_errors``: ``{success: false, error: {code, message, ...}}`` with the
catalog's status), the dashboard (an error page or a form error), the CLI (a JSON error and an exit code)
and the relayer (a 5xx kind is the service's trouble: the job is retried). This module imports no Flask
and no domain package. README's error tables and the views' docstrings are tested against the catalog
(tests/test_error_catalog.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

Where = Literal["api", "http", "admin"]


class ErrorKind(NamedTuple):
    status: int  # the HTTP status the REST API answers with (the dashboard and the CLI use its class too)
    description: str  # what it means; the message when a raise site gives none
    # "api": a REST API answer, listed in README's error tables; "http": the API's code for a plain HTTP error
    # Flask/Werkzeug raises (no service raises it; not listed); "admin": dashboard, CLI and public pages only (not
    # listed).
    where: Where = "api"


def _kinds(status: int, description: str, *codes: str, where: Where = "api") -> dict[str, ErrorKind]:
    return {code: ErrorKind(status, description, where) for code in codes}


# fmt: off
CATALOG: dict[str, ErrorKind] = {
    # Requests (any endpoint)
    "VALIDATION_ERROR": ErrorKind(400, "A field or query parameter is invalid; error.fields names each"),
    "INVALID_JSON": ErrorKind(400, "The body is not valid JSON (or is empty, too deep, or holds a NUL)"),
    "INVALID_REQUEST": ErrorKind(400, "The path or query contains a NUL character"),
    "INVALID_IDEMPOTENCY_KEY": ErrorKind(400, "The Idempotency-Key header is empty, too long or not ASCII"),
    "BAD_REQUEST": ErrorKind(400, "The request cannot be read", "http"),
    "UNAUTHORIZED": ErrorKind(401, "Missing, unknown or revoked API key"),
    "FORBIDDEN": ErrorKind(403, "Not allowed", "http"),
    "NOT_FOUND": ErrorKind(404, "No such resource for this merchant, or no such route"),
    "METHOD_NOT_ALLOWED": ErrorKind(405, "Wrong method for the route"),
    "CONFLICT": ErrorKind(409, "Conflict with the current state", "http"),
    "PAYLOAD_TOO_LARGE": ErrorKind(413, "The body is over the size limit"),
    "UNSUPPORTED_MEDIA_TYPE": ErrorKind(415, "The body is not sent as application/json"),
    "IDEMPOTENCY_KEY_REUSED": ErrorKind(422, "The Idempotency-Key was used with a different request"),
    "RATE_LIMITED": ErrorKind(429, "Too many requests; Retry-After says when to retry"),
    "INTERNAL_ERROR": ErrorKind(500, "Internal server error"),
    "SERVICE_UNAVAILABLE": ErrorKind(503, "The database cannot be reached right now; try again"),
    "SERVER_BUSY": ErrorKind(503, "Every password-hash slot is taken; Retry-After: 1", "admin"),
    # Intents and webhooks
    "INTENT_NOT_CANCELLABLE": ErrorKind(404, "Only pending intents can be cancelled; error.status says why"),
    "PAYMENT_IN_PROGRESS": ErrorKind(409, "A payment for the intent is being settled"),
    "NO_PAYOUT_WALLET": ErrorKind(409, "The merchant has no wallet on a configured network"),
    "WEBHOOK_LIMIT_REACHED": ErrorKind(409, "The merchant has the most webhook endpoints allowed"),
    "WEBHOOK_DELETED": ErrorKind(409, "The delivery's webhook endpoint was deleted"),
    # A payment link's public page (not the API: the API shows the link with active false)
    "PAYMENT_LINK_INACTIVE": ErrorKind(410, "The payment link was deactivated", "admin"),
    "PAYMENT_LINK_UNPAYABLE": ErrorKind(409, "The payment link's amount is over MAX_AMOUNT_USDC", "admin"),
    "TOO_MANY_PENDING_DELIVERIES": ErrorKind(409, "Too many test or replayed deliveries to the endpoint are pending"),
    # Refunds (backend.intents.refunds, backend.settlement.refunds)
    **_kinds(409, "Only a paid intent can be refunded; error.status", "INTENT_NOT_REFUNDABLE"),
    **_kinds(409, "The refund exceeds what is left to refund; error.refundable_usdc", "REFUND_EXCEEDS_PAYMENT"),
    **_kinds(409, "The refund was already signed and sent (or failed); error.status", "REFUND_NOT_PAYABLE"),
    **_kinds(400, "The refund is not signed by the intent's payout wallet (its payTo); error.pay_from",
             "REFUND_SIGNER_MISMATCH"),
    # Payments (/pay, the Solana transaction, the checkout balance)
    **_kinds(400, "A payment field is malformed; error.field names it", "INVALID_PAYLOAD"),
    **_kinds(400, "Not one of the intent's networks", "UNSUPPORTED_NETWORK"),
    **_kinds(400, "Not the 'exact' scheme", "UNSUPPORTED_SCHEME"),
    **_kinds(400, "Not a supported x402Version", "UNSUPPORTED_X402_VERSION"),
    **_kinds(400, "The payment does not match the requirement", "RECIPIENT_MISMATCH", "AMOUNT_MISMATCH",
             "ASSET_MISMATCH"),
    **_kinds(400, "The authorization is not valid yet (Retry-After when the chain lags)",
             "AUTHORIZATION_NOT_YET_VALID"),
    **_kinds(400, "validBefore has passed or is too close", "AUTHORIZATION_EXPIRED"),
    **_kinds(400, "validBefore is too far ahead", "AUTHORIZATION_TOO_LONG"),
    **_kinds(400, "The payer is the merchant's own wallet", "PAYER_IS_RECIPIENT"),
    **_kinds(400, "The signature is missing, invalid or not the payer's", "INVALID_SIGNATURE"),
    **_kinds(400, "Solana: the transaction breaks a rule", "FEE_PAYER_MISMATCH", "FEE_PAYER_MISUSED",
             "DISALLOWED_INSTRUCTION", "INVALID_TRANSACTION", "COMPUTE_BUDGET_TOO_HIGH"),
    **_kinds(400, "Solana: the transaction's blockhash expired; fetch a new transaction", "BLOCKHASH_EXPIRED"),
    **_kinds(400, "EVM: the paying address has contract code", "PAYER_HAS_CODE"),
    **_kinds(402, "The payment could not be settled; error.reason says why", "SETTLEMENT_FAILED"),
    **_kinds(402, "Solana: the payer holds too little SOL for the account rent", "PAYER_NEEDS_SOL"),
    **_kinds(409, "The intent is already paid; error.tx_hash", "ALREADY_PAID"),
    **_kinds(409, "This authorization was already submitted, used or cancelled", "NONCE_ALREADY_USED"),
    **_kinds(409, "The intent was cancelled", "INTENT_CANCELLED"),
    **_kinds(409, "The intent's requirement changed since it was created", "REQUIREMENT_OUTDATED"),
    **_kinds(409, "Solana: the merchant's USDC account is gone; fetch a new transaction", "PAYEE_ACCOUNT_MISSING"),
    **_kinds(409, "Solana: the merchant closed its USDC account after payments landed in it",
             "PAYEE_ACCOUNT_CLOSED"),
    **_kinds(410, "The intent expired", "INTENT_EXPIRED"),
    **_kinds(429, "The merchant's relay budget on this network has no room; Retry-After",
             "RELAY_BUDGET_EXHAUSTED"),
    **_kinds(429, "The merchant has the most payments settling on this network; Retry-After",
             "TOO_MANY_OPEN_SETTLEMENTS"),
    **_kinds(429, "The paying address has the most payments settling; Retry-After", "PAYER_TOO_MANY_OPEN_PAYMENTS"),
    **_kinds(503, "The chain's RPC cannot be reached; nothing was claimed, try again", "CHAIN_UNAVAILABLE"),
    **_kinds(503, "Settlement is not configured on this server (REDIS_URL)", "SETTLEMENT_UNAVAILABLE"),
    **_kinds(504, "Accepted, still settling; read the intent", "SETTLEMENT_PENDING"),
    # The x402 facilitator API (its answers are the spec's bodies; error.code there is one of these or the above)
    **_kinds(400, "The resource server's paymentRequirements cannot be paid here (its asset, payTo or amount)",
             "INVALID_PAYMENT_REQUIREMENTS"),
    **_kinds(409, "This payment-identifier was used with a different payment", "PAYMENT_IDENTIFIER_REUSED"),
    # Merchant administration (dashboard and CLI; backend.merchants.services.MerchantError)
    **_kinds(400, "Bad merchant input", "INVALID_EMAIL", "WEAK_PASSWORD", "INVALID_PASSWORD", "INVALID_NAME",
             "EMAIL_TAKEN", "UNKNOWN_NETWORK", "INVALID_ADDRESS", "ADDRESS_NOT_ALLOWED", where="admin"),
    **_kinds(404, "No such merchant, key or wallet", "MERCHANT_NOT_FOUND", "KEY_NOT_FOUND", "WALLET_NOT_FOUND",
             where="admin"),
    **_kinds(400, "The wallet's signature of the service's message is missing, expired or not the wallet's",
             "WALLET_NOT_PROVEN", where="admin"),
}
# fmt: on

# The codes a settlement may fail with (``failure_code``, and the ``code`` of its ``payment.failed``) that are no
# API answer: the chain decided after the claim. A settlement's other failure codes are the catalog's (above).
# docs/webhooks.md lists each ("Settlement failure codes"); tests/test_error_catalog.py checks both.
SETTLEMENT_FAILURES: dict[str, str] = {
    "AUTHORIZATION_CANCELED": "the buyer cancelled the authorization on chain before it executed",
    "AUTHORIZATION_USED_ELSEWHERE": "the buyer used the authorization's nonce for other terms first: nothing moved",
    "DUPLICATE_PAYMENT": "it executed after the intent was paid by another (a second charge: payment.duplicate)",
}


class DomainError(Exception):
    """A failure a service reports to its caller: a catalog ``code``, a message safe to show, and details.

    ``extra`` keys (``fields``, ``reason``, ``retry_after``...) travel with it into the REST body;
    ``headers`` (``Retry-After``, ``WWW-Authenticate``) are for the entry points that speak HTTP.
    The HTTP status is the catalog's, never the raise site's.
    """

    def __init__(
        self, code: str, message: str | None = None, *, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        if code not in CATALOG:
            raise ValueError(f"error code {code!r} is not in backend.errors.CATALOG")
        message = CATALOG[code].description if message is None else message
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.extra = extra

    @property
    def kind(self) -> ErrorKind:
        return CATALOG[self.code]

    @property
    def http_status(self) -> int:
        return self.kind.status

    def body(self) -> dict[str, Any]:
        return {"success": False, "error": {"code": self.code, "message": self.message, **self.extra}}


class ChainUnavailable(DomainError):
    """A chain's RPC cannot be reached (or is not configured): 503 CHAIN_UNAVAILABLE, nothing was done."""

    def __init__(self, network_name: str, message: str | None = None) -> None:
        super().__init__("CHAIN_UNAVAILABLE", message or f"{network_name} cannot be reached right now; try again")
        self.network_name = network_name


# What an error message may repeat of the client's own text (a network id, a field name, a version): at most
# ECHO_LIMIT characters, of a set that cannot be read as markup, a control character or another line.
ECHO_LIMIT = 64
MAX_ERROR_FIELDS = 20
_UNSAFE = re.compile(r"[^A-Za-z0-9 _.,:;/@+=#~()\[\]-]")


def echo(value: object, limit: int = ECHO_LIMIT, *, quoted: bool = True) -> str:
    """Client-supplied ``value`` as an error message may show it: its first ``limit`` characters, every one
    outside a plain set (letters, digits, space, ``_.,:;/@+=#~()[]-``) shown as ``?``, ``...`` when cut,
    in single quotes unless ``quoted`` is false."""
    text = value if isinstance(value, str) else repr(value)
    shown = _UNSAFE.sub("?", text[:limit]) + ("..." if len(text) > limit else "")
    return f"'{shown}'" if quoted else shown


def _bounded_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Field names come from the client (an unknown field is named): at most MAX_ERROR_FIELDS, each echoed
    safely, two levels deep (where our schemas nest)."""
    bounded: dict[str, Any] = {}
    for name, detail in list(fields.items())[:MAX_ERROR_FIELDS]:
        if isinstance(detail, dict):
            detail = {echo(k, quoted=False): v for k, v in list(detail.items())[:MAX_ERROR_FIELDS]}
        bounded[echo(name, quoted=False)] = detail
    return bounded


def validation_error(fields: dict[str, Any], message: str | None = None) -> DomainError:
    """400 VALIDATION_ERROR naming each bad field (client-supplied names bounded: :func:`echo`)."""
    fields = _bounded_fields(fields)
    if message is None:
        first = next(iter(fields), "request")
        detail = fields[first]
        while isinstance(detail, dict) and detail:
            first, detail = f"{first}.{next(iter(detail))}", next(iter(detail.values()))
        if isinstance(detail, list) and detail:
            detail = detail[0]
        message = f"{first}: {detail}"
    return DomainError("VALIDATION_ERROR", message, fields=fields)


def not_found(what: str = "Resource") -> DomainError:
    return DomainError("NOT_FOUND", f"{what} not found")


def database_unavailable(exc: Exception) -> bool:
    """The database cannot be reached or answer now (down, restarting, refusing connections, a connection
    timeout, a dropped connection, SQLite busy, every connection of the process's pool taken past its
    ``pool_timeout``): worth retrying, unlike a failing statement."""
    if isinstance(exc, PoolTimeout):
        return True
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)
