"""Proof of payment for the paywall: access tokens, server challenges and payer proofs.

A settled payment's data is public (the intent id is in a Solana memo, an EVM authorization is in
the transaction's calldata), so it proves nothing about who is asking. The paywall instead hands the
buyer who settled a payment an **access token** (an HMAC only the paywall can make), and lets a buyer
who lost that answer (a connection broken after paying) get a new one by **proving it holds the
payer's key**: a signature over a fresh server challenge that names the resource.

- Token: ``pa1.<base64url JSON {k, a, r, v, i, p, e}>.<base64url HMAC-SHA256>``: kind (``access``, or
  ``claim`` for a payment still settling), audience (the paywall's name), resource key, price, intent
  id, payer, expiry (unix seconds). A token is served only by a paywall of that name, for that
  resource at that price.
- Challenge: ``<unix seconds>.<base64url HMAC>`` bound to the resource key, valid for
  ``CHALLENGE_TTL`` seconds; stateless, so any paywall process sharing the secret accepts it.
- Proof: the payer signs :func:`proof_message` (EVM: EIP-191 ``personal_sign``; Solana: ed25519
  over the UTF-8 bytes, base58 signature), sent as base64 JSON ``{intent_id, payer, challenge,
  signature, origin}`` (plus ``network`` and ``nonce`` of the EVM authorization, as hints).

Every MAC carries its own label, so a token is never a valid challenge and the other way round.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACCESS",
    "CLAIM",
    "AccessError",
    "AccessKeys",
    "Grant",
    "proof_message",
    "resolve_secret",
    "same_payer",
    "sign_evm_proof",
    "signed_by",
]

SECRET_ENV = "PAYINTENT_PAYWALL_SECRET"
MIN_SECRET_BYTES = 16
ACCESS = "access"  # serves until it expires, no lookup
CLAIM = "claim"  # given with a 503 while the holder's own payment settles: serves once the intent is paid by the payer
TOKEN_PREFIX = "pa1"
CHALLENGE_TTL = 120
CHALLENGE_SKEW = 5
MAX_TOKEN_CHARS = 2048
_SECRET_LABEL = b"payintent paywall secret v1"
_TOKEN_LABEL = b"payintent paywall token v2\x00"  # v2: audience and price in the grant
_CHALLENGE_LABEL = b"payintent paywall challenge v1\x00"


class AccessError(ValueError):
    """A token, challenge or proof that cannot be accepted (the message says why)."""


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
    by ``payer`` with intent ``intent_id``, until ``expires`` (unix seconds)."""

    kind: str
    resource: str
    intent_id: str
    payer: str
    expires: int
    audience: str = ""
    price: str = ""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class AccessKeys:
    """Makes and checks tokens and challenges with one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, label: bytes, message: bytes) -> bytes:
        return hmac.new(self._secret, label + message, hashlib.sha256).digest()

    def issue(self, grant: Grant) -> str:
        body = {"k": grant.kind, "a": grant.audience, "r": grant.resource, "v": grant.price,
                "i": grant.intent_id, "p": grant.payer, "e": grant.expires}  # fmt: skip
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

    def challenge(self, resource: str, now: float) -> str:
        stamp = str(int(now))
        return f"{stamp}.{_b64(self._mac(_CHALLENGE_LABEL, f'{resource}|{stamp}'.encode())[:18])}"

    def check_challenge(self, challenge: str, resource: str, now: float) -> None:
        """Refuse a challenge this paywall did not make for ``resource`` within ``CHALLENGE_TTL``."""
        stamp, _, mac = challenge.partition(".") if isinstance(challenge, str) else ("", "", "")
        if not stamp.isdigit() or len(stamp) > 12:
            raise AccessError("the proof's challenge is malformed")
        try:
            expected = self._mac(_CHALLENGE_LABEL, f"{resource}|{stamp}".encode())[:18]
            valid = hmac.compare_digest(_unb64(mac), expected)
        except (binascii.Error, ValueError):
            valid = False
        if not valid:
            raise AccessError("the proof's challenge was not made by this paywall for this resource")
        if not now - CHALLENGE_TTL <= int(stamp) <= now + CHALLENGE_SKEW:
            raise AccessError("the proof's challenge has expired: ask for a new one (a request without payment)")


def proof_message(resource_label: str, intent_id: str, payer: str, challenge: str, origin: str = "") -> str:
    """The text a payer signs to prove it paid: the origin it asked (``https://shop.example``), the
    resource ("GET /path?query", percent-encoded), the intent, itself and the server's challenge."""
    return (
        "payintent paywall: proof of payment\n"
        f"origin: {origin}\n"
        f"resource: {resource_label}\n"
        f"intent: {intent_id}\n"
        f"payer: {payer}\n"
        f"challenge: {challenge}"
    )


def sign_evm_proof(
    account: Any, resource_label: str, intent_id: str, challenge: str, origin: str = ""
) -> dict[str, str]:
    """A proof signed with an eth-account account (EIP-191), as the ``X-Payment-Proof`` JSON."""
    from eth_account.messages import encode_defunct

    message = proof_message(resource_label, intent_id, account.address, challenge, origin)
    signature = account.sign_message(encode_defunct(text=message)).signature
    return {
        "intent_id": intent_id,
        "payer": account.address,
        "challenge": challenge,
        "signature": "0x" + bytes(signature).hex(),
        "origin": origin,
    }


def same_payer(a: str | None, b: str | None) -> bool:
    """Whether two payer addresses are the same account (EVM: any letter case; Solana: exact)."""
    if not a or not b:
        return False
    if a.startswith("0x") and b.startswith("0x"):
        return a.lower() == b.lower()
    return a == b


def signed_by(payer: str, message: str, signature: str) -> bool:
    """Whether ``signature`` over ``message`` was made by ``payer``'s key (EVM or Solana address)."""
    if not isinstance(payer, str) or not isinstance(signature, str) or len(signature) > 200:
        return False
    try:
        if payer.startswith("0x"):
            from eth_account import Account
            from eth_account.messages import encode_defunct

            recovered = Account.recover_message(encode_defunct(text=message), signature=signature)
            return same_payer(recovered, payer)
        from solders.pubkey import Pubkey
        from solders.signature import Signature

        return bool(Signature.from_string(signature).verify(Pubkey.from_string(payer), message.encode()))
    except Exception:  # any malformed key or signature is simply not a proof
        return False


def read_proof(value: Mapping[str, Any]) -> dict[str, str]:
    """The fields of a decoded ``X-Payment-Proof`` (strings), or :class:`AccessError`."""
    fields = {}
    for name in ("intent_id", "payer", "challenge", "signature"):
        item = value.get(name)
        if not isinstance(item, str) or not item or len(item) > 200 or "\n" in item:
            raise AccessError(f"the proof needs {name} (a string of one line)")
        fields[name] = item
    for name in ("network", "nonce"):
        item = value.get(name)
        if isinstance(item, str) and len(item) <= 200:
            fields[name] = item
    origin = value.get("origin", "")
    if not isinstance(origin, str) or len(origin) > 200 or "\n" in origin:
        raise AccessError("the proof's origin must be a string")
    fields["origin"] = origin
    return fields
