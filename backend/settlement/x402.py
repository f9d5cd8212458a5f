"""Every form of x402 payment payload we accept, turned into the one form settlement uses.

x402 clients send a ``PaymentPayload`` (the JSON inside an ``X-PAYMENT`` or ``PAYMENT-SIGNATURE``
header, or ``payment_signature`` in our API). The forms met in practice:

* **v1, flat EVM payload** (our own client, the spec's table)::

    {"x402Version": 1, "scheme": "exact", "network": "eip155:84532",
     "payload": {"from", "to", "value", "validAfter", "validBefore", "nonce", "signature"}}

* **v1, nested EVM payload** (the public x402 libraries)::

    {"x402Version": 1, "scheme": "exact", "network": "base-sepolia",
     "payload": {"signature": "0x…", "authorization": {"from", "to", "value", "validAfter", "validBefore", "nonce"}}}

* **v2**: no top-level scheme or network; the requirement the client accepted comes with it::

    {"x402Version": 2, "payload": {…either EVM form…},
     "accepted": {"scheme", "network", "amount", "asset", "payTo", "maxTimeoutSeconds", "extra"},
     "resource": {…}, "extensions": {…}}

* **Solana**, in v1 or v2: ``payload`` is ``{"transaction": "<base64>"}``.

``network`` may be a CAIP-2 id or an x402 v1 name (``base-sepolia``, ``sepolia``,
``solana-devnet``…): both resolve through the chain registry. :func:`normalize_payment_signature`
is the one place these forms are told apart; it only reshapes (no chain, no database), so the
paywall middleware can use it on a decoded header. What the payload then has to satisfy (the
requirement, the signature, the chain) is checked by the settlement flow as for every payment,
plus :func:`check_accepted` for a v2 payload's ``accepted``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend.chains.registry import ChainRegistry, resolve_x402_network
from backend.errors import DomainError, echo

X402_VERSIONS = (1, 2)
AUTHORIZATION_FIELDS = ("from", "to", "value", "validAfter", "validBefore", "nonce")
MAX_NAME_LENGTH = 64
_UINT_RE = re.compile(r"^[0-9]{1,78}\Z")  # \Z: $ would accept a trailing newline


@dataclass(frozen=True)
class X402Payment:
    """A payment payload in the form settlement uses, whichever form it came in."""

    x402_version: int  # 1 or 2
    scheme: str  # "exact" (refused later if not)
    network: str  # CAIP-2 id, resolved from a v1 name if one was sent (unknown names stay as sent)
    payload: dict[str, Any]  # EVM: flat {from, to, value, validAfter, validBefore, nonce, signature}; Solana: as sent
    accepted: dict[str, Any] | None = None  # v2: the requirement the client says it signed for
    network_as_sent: str = ""  # what the client wrote (a v1 name, or the CAIP-2 id)


def _invalid(message: str, field: str) -> DomainError:
    return DomainError("INVALID_PAYLOAD", message, field=f"payment_signature.{field}" if field else "payment_signature")


def _name(container: Mapping[str, Any], key: str, where: str) -> str:
    value = container.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_LENGTH:
        raise _invalid(f"{where}{key} must be a non-empty string of at most {MAX_NAME_LENGTH} characters", where + key)
    return value


def flatten_payload(payload: Any) -> dict[str, Any]:
    """A spec-style nested EVM payload ``{signature, authorization: {...}}`` as our flat one.

    A flat payload, and a Solana ``{transaction}``, are returned as they are (copied); the fields'
    values are checked later (``rails.evm.terms.parse_evm_payload``).
    """
    if not isinstance(payload, Mapping):
        raise _invalid("payload must be an object", "payload")
    if "authorization" not in payload:
        return dict(payload)
    authorization = payload["authorization"]
    if not isinstance(authorization, Mapping):
        raise _invalid(
            "payload.authorization must be an object {from, to, value, validAfter, validBefore, nonce}",
            "payload.authorization",
        )
    mixed = [field for field in (*AUTHORIZATION_FIELDS, "transaction") if field in payload]
    if mixed:
        raise _invalid(
            f"payload has both authorization and top-level {', '.join(mixed)}: send one form, "
            "{signature, authorization} or the flat fields",
            f"payload.{mixed[0]}",
        )
    if "signature" not in payload:
        raise _invalid("payload.signature is required next to payload.authorization", "payload.signature")
    flat = {field: authorization[field] for field in AUTHORIZATION_FIELDS if field in authorization}
    flat["signature"] = payload["signature"]
    return flat


def normalize_payment_signature(signature: Any, registry: ChainRegistry | None = None) -> X402Payment:
    """Any accepted x402 payment payload (a decoded JSON object) -> :class:`X402Payment`.

    Raises :class:`~backend.errors.DomainError` (400) for what cannot be read:
    ``UNSUPPORTED_X402_VERSION`` for an ``x402Version`` other than 1 or 2, ``INVALID_PAYLOAD``
    (with ``error.field``) for a missing or malformed scheme, network, payload or v2 ``accepted``,
    or a v2 top-level scheme/network that contradicts ``accepted``. Unknown fields, ``resource``
    and ``extensions`` are ignored. ``registry`` resolves the v1 names configured in the chains
    file; without it, the public libraries' names are used.
    """
    if not isinstance(signature, Mapping):
        raise _invalid("payment_signature must be an object", "")
    version = signature.get("x402Version")
    if type(version) is not int or version not in X402_VERSIONS:  # not True, not 1.0, not "1"
        raise DomainError(
            "UNSUPPORTED_X402_VERSION",
            f"x402Version must be one of {list(X402_VERSIONS)}, not {echo(version)}",
        )
    accepted: dict[str, Any] | None = None
    if version == 1:
        scheme = _name(signature, "scheme", "")
        network = _name(signature, "network", "")
    else:
        raw_accepted = signature.get("accepted")
        if not isinstance(raw_accepted, Mapping):
            raise _invalid(
                "x402Version 2 needs accepted: the payment requirement the payload was signed for "
                "{scheme, network, amount, asset, payTo, ...}",
                "accepted",
            )
        accepted = dict(raw_accepted)
        scheme = _name(accepted, "scheme", "accepted.")
        network = _name(accepted, "network", "accepted.")
        # v2 has no top-level scheme/network; a client that adds them must not contradict accepted.
        if "scheme" in signature and signature["scheme"] != scheme:
            raise _invalid("scheme differs from accepted.scheme", "scheme")
        if "network" in signature and (
            not isinstance(signature["network"], str)
            or resolve_x402_network(signature["network"], registry) != resolve_x402_network(network, registry)
        ):
            raise _invalid("network differs from accepted.network", "network")
    return X402Payment(
        x402_version=version,
        scheme=scheme,
        network=resolve_x402_network(network, registry),
        payload=flatten_payload(signature.get("payload")),
        accepted=accepted,
        network_as_sent=network,
    )


def _same_address(a: str, b: str, evm: bool) -> bool:
    return a.lower() == b.lower() if evm else a == b


def check_accepted(
    accepted: Mapping[str, Any], requirement: Mapping[str, Any], registry: ChainRegistry | None = None
) -> None:
    """A v2 payload's ``accepted`` must be this requirement, field by field.

    Compared: ``scheme``, ``network`` (CAIP-2 or v1 name), ``amount`` (and ``maxAmountRequired``
    if sent), ``asset`` and ``payTo`` (EVM addresses case-insensitively). Anything else
    (``maxTimeoutSeconds``, ``extra``, fields we do not know) is ignored: the signature is checked
    against the requirement's own EIP-712 domain anyway. The codes are the ones a mismatching
    authorization gets.
    """
    evm = str(requirement["network"]).startswith("eip155:")
    if accepted.get("scheme") != requirement["scheme"]:
        raise DomainError("UNSUPPORTED_SCHEME", f"accepted.scheme must be {requirement['scheme']!r}")
    network = accepted.get("network")
    if not isinstance(network, str) or resolve_x402_network(network, registry) != requirement["network"]:
        raise DomainError("UNSUPPORTED_NETWORK", f"accepted.network must be {requirement['network']}")
    amounts = {key: accepted[key] for key in ("amount", "maxAmountRequired") if key in accepted}
    if not amounts:
        raise _invalid("accepted.amount is required (the requirement's amount in atomic units)", "accepted.amount")
    for key, value in amounts.items():
        if isinstance(value, bool) or not isinstance(value, str | int) or not _UINT_RE.match(str(value)):
            raise _invalid(f"accepted.{key} must be a decimal string of an unsigned integer", f"accepted.{key}")
        if int(str(value)) != int(requirement["maxAmountRequired"]):
            raise DomainError(
                "AMOUNT_MISMATCH",
                f"accepted.{key} must equal the requirement's amount ({requirement['maxAmountRequired']})",
            )
    for key, code in (("asset", "ASSET_MISMATCH"), ("payTo", "RECIPIENT_MISMATCH")):
        value = accepted.get(key)
        if not isinstance(value, str) or not _same_address(value, str(requirement[key]), evm):
            raise DomainError(code, f"accepted.{key} must be the requirement's {key} {requirement[key]}")


__all__ = [
    "X402_VERSIONS",
    "X402Payment",
    "check_accepted",
    "flatten_payload",
    "normalize_payment_signature",
]
