"""EIP-3009 ``TransferWithAuthorization``: the one definition of what a buyer signs.

Used by the client (to sign) and by the service (to verify), so the two can never disagree.
The signing domain comes from the payment requirement: ``name`` = ``usdcDomainName`` (or
``extra.name``), ``version`` = ``extra.version`` (``"2"``), ``chainId`` = the number after the
colon of ``network``, ``verifyingContract`` = ``asset``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from eth_account import Account
from eth_account.messages import encode_typed_data
from eth_utils import to_checksum_address

PRIMARY_TYPE = "TransferWithAuthorization"
AUTHORIZATION_FIELDS = (
    ("from", "address"),
    ("to", "address"),
    ("value", "uint256"),
    ("validAfter", "uint256"),
    ("validBefore", "uint256"),
    ("nonce", "bytes32"),
)
MESSAGE_TYPES = {PRIMARY_TYPE: [{"name": name, "type": kind} for name, kind in AUTHORIZATION_FIELDS]}
DEFAULT_VALIDITY_SECONDS = 900
SECP256K1_HALF_N = 0x7FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF5D576E7357A4501DDFE92F46681B20A0


def evm_chain_id(network: str) -> int:
    namespace, _, reference = network.partition(":")
    if namespace != "eip155" or not reference.isdigit():
        raise ValueError(f"not an EVM network id: {network!r}")
    return int(reference)


def domain_of(requirement: Mapping[str, Any]) -> dict[str, Any]:
    """The EIP-712 domain a requirement asks the buyer to sign under."""
    extra = requirement.get("extra") or {}
    name = requirement.get("usdcDomainName") or extra.get("name")
    if not name:
        raise ValueError("the requirement names no EIP-712 domain (usdcDomainName)")
    return {
        "name": name,
        "version": str(extra.get("version") or "2"),
        "chainId": evm_chain_id(requirement["network"]),
        "verifyingContract": to_checksum_address(requirement["asset"]),
    }


def message_of(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The typed message from an x402 ``exact`` EVM payload (strings or ints accepted)."""
    return {
        "from": to_checksum_address(payload["from"]),
        "to": to_checksum_address(payload["to"]),
        "value": int(payload["value"]),
        "validAfter": int(payload["validAfter"]),
        "validBefore": int(payload["validBefore"]),
        "nonce": bytes.fromhex(str(payload["nonce"]).removeprefix("0x")),
    }


def recover_authorizer(domain: Mapping[str, Any], payload: Mapping[str, Any]) -> str:
    """The address whose key produced ``payload['signature']`` over the authorization.

    Refuses high-s signatures and a ``v`` other than 27/28 (or 0/1), as the token contract does,
    so that a signature we accept is one the chain accepts too.
    """
    signature = bytes.fromhex(str(payload["signature"]).removeprefix("0x"))
    if len(signature) != 65:
        raise ValueError("signature must be 65 bytes (r, s, v)")
    if int.from_bytes(signature[32:64], "big") > SECP256K1_HALF_N:
        raise ValueError("signature has a high s value")
    if signature[64] not in (0, 1, 27, 28):  # the token takes 27/28 (relayers send 0/1 as 27/28), not EIP-155 v
        raise ValueError("signature v must be 27 or 28")
    signable = encode_typed_data(
        domain_data=dict(domain), message_types=MESSAGE_TYPES, message_data=message_of(payload)
    )
    return str(Account.recover_message(signable, signature=signature))


def sign_authorization(
    private_key: Any,
    requirement: Mapping[str, Any],
    *,
    now: int | None = None,
    valid_for: int = DEFAULT_VALIDITY_SECONDS,
    nonce: bytes | None = None,
) -> dict[str, str]:
    """Sign the requirement's exact amount to its ``payTo``; returns the x402 EVM ``payload``.

    A fresh random 32-byte nonce every time (never a counter), ``validAfter`` 0 and
    ``validBefore`` = now + 900 seconds unless told otherwise.
    """
    account = Account.from_key(private_key) if not hasattr(private_key, "sign_message") else private_key
    issued = int(time.time()) if now is None else now
    payload = {
        "from": account.address,
        "to": to_checksum_address(requirement["payTo"]),
        "value": str(int(requirement["maxAmountRequired"])),
        "validAfter": "0",
        "validBefore": str(issued + valid_for),
        "nonce": "0x" + (nonce if nonce is not None else secrets.token_bytes(32)).hex(),
    }
    signable = encode_typed_data(
        domain_data=domain_of(requirement), message_types=MESSAGE_TYPES, message_data=message_of(payload)
    )
    signed = account.sign_message(signable)
    payload["signature"] = "0x" + bytes(signed.signature).hex()
    return payload
