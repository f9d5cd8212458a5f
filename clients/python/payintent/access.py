"""Access tokens for the paywall: a paid resource served again without paying again.

A settled payment's data is public (an EVM authorization is in the transaction's calldata), so it
proves nothing about who is asking. The paywall instead hands the buyer whose payment it settled an
**access token** (an HMAC only the paywall can make) that serves the same resource until it expires.

Token: ``pa1.<base64url JSON {k, a, r, v, i, p, e}>.<base64url HMAC-SHA256>``: kind (``access``),
audience (the paywall's name), resource key, price, the settlement's transaction, payer, expiry (unix
seconds). A token is served only by a paywall of that name, for that resource at that price.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
from dataclasses import dataclass

__all__ = ["ACCESS", "AccessError", "AccessKeys", "Grant", "resolve_secret"]

SECRET_ENV = "PAYINTENT_PAYWALL_SECRET"
MIN_SECRET_BYTES = 16
ACCESS = "access"  # serves until it expires, no lookup
TOKEN_PREFIX = "pa1"
MAX_TOKEN_CHARS = 2048
_SECRET_LABEL = b"payintent paywall secret v1"
_DERIVE_LABEL = b"payintent paywall derived id v1\x00"
_TOKEN_LABEL = b"payintent paywall token v3\x00"  # v3: the grant names the settlement's transaction


class AccessError(ValueError):
    """A token that cannot be accepted (the message says why)."""


def resolve_secret(secret: str | bytes | None, api_key: str | None) -> bytes:
    """The paywall's MAC key: ``secret``, else ``PAYINTENT_PAYWALL_SECRET``, else one derived from the
    merchant's API key (so every paywall process of a deployment shares it with no new setting)."""
    chosen = secret if secret is not None else os.environ.get(SECRET_ENV) or None
    if chosen is not None:
        raw = chosen.encode() if isinstance(chosen, str) else bytes(chosen)
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(f"the paywall secret must be at least {MIN_SECRET_BYTES} bytes")
        return raw
    if not api_key:
        raise ValueError(f"the paywall needs a secret: secret=, {SECRET_ENV}, or a client with an API key")
    return hmac.new(api_key.encode(), _SECRET_LABEL, hashlib.sha256).digest()


@dataclass(frozen=True)
class Grant:
    """What a token says: ``kind`` access to ``resource`` (a resource key) of the paywall named
    ``audience`` at ``price`` (USDC, as :func:`payintent.paywall_request.price_text` writes it), bought
    by ``payer`` in ``transaction``, until ``expires`` (unix seconds)."""

    kind: str
    resource: str
    transaction: str
    payer: str
    expires: int
    audience: str = ""
    price: str = ""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class AccessKeys:
    """Makes and checks tokens with one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, label: bytes, message: bytes) -> bytes:
        return hmac.new(self._secret, label + message, hashlib.sha256).digest()

    def derive(self, *parts: str) -> str:
        """An id derived from ``parts`` under the secret (base64url, 32 characters): unguessable without it."""
        return _b64(self._mac(_DERIVE_LABEL, "\x00".join(parts).encode())[:24])

    def issue(self, grant: Grant) -> str:
        body = {"k": grant.kind, "a": grant.audience, "r": grant.resource, "v": grant.price,
                "i": grant.transaction, "p": grant.payer, "e": grant.expires}  # fmt: skip
        payload = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        return f"{TOKEN_PREFIX}.{_b64(payload)}.{_b64(self._mac(_TOKEN_LABEL, payload))}"

    def read(self, token: str, resource: str, now: float, *, audience: str = "", price: str = "") -> Grant:
        """The grant of a token made by this secret for ``resource`` of the paywall ``audience`` at
        ``price``, not expired at ``now``."""
        parts = token.strip().split(".") if isinstance(token, str) and len(token) <= MAX_TOKEN_CHARS else []
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            raise AccessError("the access token is malformed")
        try:
            payload, mac = _unb64(parts[1]), _unb64(parts[2])
        except (binascii.Error, ValueError):
            raise AccessError("the access token is malformed") from None
        if not hmac.compare_digest(mac, self._mac(_TOKEN_LABEL, payload)):
            raise AccessError("the access token is not valid")
        try:
            body = json.loads(payload)
            grant = Grant(str(body["k"]), str(body["r"]), str(body["i"]), str(body["p"]), int(body["e"]),
                          str(body["a"]), str(body["v"]))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            raise AccessError("the access token is malformed") from None
        if not hmac.compare_digest(grant.audience.encode(), audience.encode()):
            raise AccessError("the access token is for another paywall")
        if not hmac.compare_digest(grant.resource.encode(), resource.encode()):
            raise AccessError("the access token is for another resource")
        if not hmac.compare_digest(grant.price.encode(), price.encode()):
            raise AccessError("the access token is for another price")
        if grant.expires <= now:
            raise AccessError("the access token has expired")
        return grant
