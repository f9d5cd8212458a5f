"""Webhook signatures: how the service signs deliveries and how receivers check them.

Each delivery carries two signatures made with the endpoint's secret (``whsec_`` + base64 of 32
random bytes) over the exact raw body bytes:

``Service-Signature: sha256=<hex>``
    HMAC-SHA256 of the raw body, keyed with the whole secret string as UTF-8 (the spec's scheme).
    It has no timestamp, so it does not stop replays by itself: deduplicate by the envelope ``id``.

``webhook-id`` / ``webhook-timestamp`` / ``webhook-signature: v1,<base64>`` (Standard Webhooks)
    HMAC-SHA256 of ``"<webhook-id>.<webhook-timestamp>.<body>"``, keyed with the base64-decoded part
    of the secret after ``whsec_``; standard verifiers accept it as is. Reject timestamps more than
    5 minutes away from your clock.

Receivers verify before parsing, with a constant-time comparison, over the bytes as received.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
TOLERANCE_SECONDS = 300


class WebhookVerificationError(ValueError):
    """The delivery is not authentic (or too old); answer 401 and do not process it."""


class WebhookSecretError(ValueError):
    """The configured secret is unusable (empty, or not ``whsec_`` + base64): a setup error, not a 401."""


def _check_secret(secret: str) -> str:
    if not isinstance(secret, str) or not secret.strip() or secret.strip() == SECRET_PREFIX:
        raise WebhookSecretError("the webhook secret is empty; set it to the whsec_... value shown at registration")
    return secret


def _raw(body: bytes | bytearray) -> bytes:
    if not isinstance(body, bytes | bytearray):
        raise TypeError("webhook verification needs the raw body bytes, not parsed or decoded text")
    return bytes(body)


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def _standard_key(secret: str) -> bytes:
    secret = _check_secret(secret)
    encoded = secret[len(SECRET_PREFIX) :] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(encoded, validate=True)
    except ValueError:
        raise WebhookSecretError(
            "the webhook secret is not whsec_ followed by base64 (check for stray spaces)"
        ) from None
    if not key:
        raise WebhookSecretError("the webhook secret is empty")
    return key


def service_signature(secret: str, body: bytes) -> str:
    """The ``Service-Signature`` header value for ``body``."""
    _check_secret(secret)
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def standard_signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value (one ``v1`` signature) for ``body``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_standard_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def signature_headers(secret: str, event_id: str, body: bytes, timestamp: int) -> dict[str, str]:
    """Every signature header of one delivery attempt."""
    return {
        "Service-Signature": service_signature(secret, body),
        "webhook-id": event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": standard_signature(secret, event_id, timestamp, body),
    }


def verify_signature(raw_body: bytes, header: str | None, secret: str) -> None:
    """Check a ``Service-Signature`` header against the raw body; raises WebhookVerificationError.

    ``raw_body`` must be the bytes as received (a re-serialised body fails, on purpose).
    """
    body = _raw(raw_body)
    header = (header or "").strip()
    if not header.startswith("sha256="):
        raise WebhookVerificationError("missing or malformed Service-Signature header")
    expected = service_signature(secret, body)
    if not hmac.compare_digest(expected.encode("ascii"), header.encode("ascii", "replace")):
        raise WebhookVerificationError("signature mismatch")


def verify_standard(
    raw_body: bytes,
    headers: Mapping[str, str],
    secret: str,
    *,
    tolerance: int = TOLERANCE_SECONDS,
    now: float | None = None,
) -> str:
    """Check the Standard Webhooks headers; returns the ``webhook-id``. Raises WebhookVerificationError.

    ``headers`` is looked up case-insensitively; the timestamp must be within ``tolerance`` seconds.
    """
    body = _raw(raw_body)
    lowered = {k.lower(): v for k, v in headers.items()}
    msg_id, stamp, signatures = (lowered.get(h) for h in ("webhook-id", "webhook-timestamp", "webhook-signature"))
    if not msg_id or not stamp or not signatures:
        raise WebhookVerificationError("missing webhook-id, webhook-timestamp or webhook-signature header")
    if not stamp.isascii() or not stamp.isdigit():
        raise WebhookVerificationError("malformed webhook-timestamp")
    timestamp = int(stamp)
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        raise WebhookVerificationError("webhook-timestamp is outside the tolerance window")
    expected = standard_signature(secret, msg_id, timestamp, body).encode("ascii")
    for candidate in signatures.split():
        if hmac.compare_digest(expected, candidate.encode("ascii", "replace")):
            return msg_id
    raise WebhookVerificationError("signature mismatch")
