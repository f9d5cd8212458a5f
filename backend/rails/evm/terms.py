"""The EVM rail's terms: a buyer's EIP-3009 authorization, checked against a requirement (the one place
EVM signatures are checked).

Everything here is offline (no RPC): shape, recipient, amount, validity window (unix times), signature.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from eth_utils import to_checksum_address

from backend.errors import DomainError
from payintent.eip3009 import domain_of, recover_authorizer

# validBefore must leave at least this long for the transaction to be mined...
VALIDITY_MARGIN_SECONDS = 30
# ... and may be at most this far ahead: an unexecuted authorization holds its intent until then.
MAX_VALIDITY_SECONDS = 3600
# \Z, not $: $ also matches before a trailing newline ("0x…\n" would pass, then crash the checksum).
_ADDRESS_RE = re.compile(r"^0x[0-9a-fA-F]{40}\Z")
_BYTES32_RE = re.compile(r"^0x[0-9a-fA-F]{64}\Z")
_SIGNATURE_RE = re.compile(r"^0x[0-9a-fA-F]{130}\Z")
_UINT_RE = re.compile(r"^[0-9]{1,78}\Z")
MAX_TIMESTAMP = 2**63 - 1  # what the database stores; far beyond any real validity window
PAYLOAD_FIELDS = ("from", "to", "value", "validAfter", "validBefore", "nonce", "signature")


@dataclass(frozen=True)
class EvmTerms:
    """An EIP-3009 ``transferWithAuthorization``: ``valid_after``/``valid_before`` are unix times."""

    payer: str
    pay_to: str
    value: int
    valid_after: int
    valid_before: int
    nonce: bytes
    signature_hex: str
    raw: dict[str, str]

    @property
    def nonce_hex(self) -> str:
        return "0x" + self.nonce.hex()


EvmAuthorization = EvmTerms  # the name settlement code and tests know


def _invalid(message: str, field: str) -> DomainError:
    return DomainError("INVALID_PAYLOAD", message, field=f"payment_signature.payload.{field}")


def _uint(payload: dict[str, Any], field: str) -> int:
    value = payload.get(field)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _invalid(f"{field} must be a decimal string of an unsigned integer", field)
    text = str(value)
    if not _UINT_RE.match(text) or int(text) >= 2**256:
        raise _invalid(f"{field} must be a decimal string of an unsigned integer", field)
    return int(text)


def parse_evm_payload(payload: Any) -> EvmTerms:
    """The payload's shape: addresses, uint256 strings, a 32-byte nonce, a 65-byte signature."""
    if not isinstance(payload, dict):
        raise _invalid("payload must be an object", "")
    for field in PAYLOAD_FIELDS:
        if field not in payload:
            raise _invalid(f"{field} is required", field)
    for field in ("from", "to"):
        if not isinstance(payload[field], str) or not _ADDRESS_RE.match(payload[field]):
            raise _invalid(f"{field} must be a 0x-prefixed 20-byte hex address", field)
    if not isinstance(payload["nonce"], str) or not _BYTES32_RE.match(payload["nonce"]):
        raise _invalid("nonce must be 0x followed by 64 hex characters (32 random bytes)", "nonce")
    if not isinstance(payload["signature"], str) or not _SIGNATURE_RE.match(payload["signature"]):
        raise _invalid("signature must be a 0x-prefixed 65-byte hex signature", "signature")
    value = _uint(payload, "value")
    valid_after = _uint(payload, "validAfter")
    valid_before = _uint(payload, "validBefore")
    for field, moment in (("validAfter", valid_after), ("validBefore", valid_before)):
        if moment > MAX_TIMESTAMP:
            raise _invalid(f"{field} must be a unix time in seconds", field)
    return EvmTerms(
        payer=to_checksum_address(payload["from"]),
        pay_to=to_checksum_address(payload["to"]),
        value=value,
        valid_after=valid_after,
        valid_before=valid_before,
        nonce=bytes.fromhex(payload["nonce"][2:]),
        signature_hex=payload["signature"].lower(),
        raw={field: str(payload[field]) for field in PAYLOAD_FIELDS},
    )


def verify_evm_authorization(auth: EvmTerms, requirement: dict[str, Any], now: int) -> None:
    """Refuse an authorization that does not pay exactly this requirement, now, signed by ``from``."""
    if auth.pay_to != to_checksum_address(requirement["payTo"]):
        raise DomainError("RECIPIENT_MISMATCH", f"to must be the requirement's payTo {requirement['payTo']}")
    if auth.value != int(requirement["maxAmountRequired"]):
        raise DomainError("AMOUNT_MISMATCH", f"value must equal maxAmountRequired ({requirement['maxAmountRequired']})")
    if auth.payer == auth.pay_to:
        raise DomainError("PAYER_IS_RECIPIENT", "from and to are the same address: nothing would be paid")
    if auth.valid_after > now:
        raise DomainError("AUTHORIZATION_NOT_YET_VALID", "validAfter is in the future")
    if auth.valid_before <= now + VALIDITY_MARGIN_SECONDS:
        raise DomainError(
            "AUTHORIZATION_EXPIRED",
            f"validBefore has passed or leaves under {VALIDITY_MARGIN_SECONDS} s to settle; sign a new authorization",
        )
    if auth.valid_before > now + MAX_VALIDITY_SECONDS:
        raise DomainError(
            "AUTHORIZATION_TOO_LONG",
            f"validBefore may be at most {MAX_VALIDITY_SECONDS} s ahead (sign with validBefore = now + 900)",
        )
    try:
        signer = recover_authorizer(domain_of(requirement), auth.raw)
    except Exception as exc:  # any failure to recover (bad v, off-curve r) means an invalid signature
        raise DomainError("INVALID_SIGNATURE", f"The signature cannot be checked: {exc}") from None
    if signer != auth.payer:
        raise DomainError(
            "INVALID_SIGNATURE", "The signature does not match from for this requirement's EIP-712 domain"
        )
