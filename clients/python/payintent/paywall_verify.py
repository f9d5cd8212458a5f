"""What the paywall checks offline, before a payment may cost the merchant an API call.

A forged payment header must be refused here, for free: the network must be one the requirement
offers, the amount, ``payTo`` and asset must be the requirement's (an x402 v2 ``accepted`` too), an
EVM authorization must be signed by its ``from`` under the requirement's EIP-712 domain (checked
with :mod:`payintent.eip3009`, as the API does) and still valid. What only the chain knows (balance,
nonce) is left to the facilitator's ``verify``. The paywall sells on EVM networks only (the
facilitator's: a Solana transaction names its intent in its memo).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from payintent import x402
from payintent.eip3009 import domain_of, recover_authorizer

__all__ = ["Checked", "Refused", "check_payment"]

_ADDRESS = re.compile(r"^0x[0-9a-fA-F]{40}\Z")
_BYTES32 = re.compile(r"^0x[0-9a-fA-F]{64}\Z")
_UINT = re.compile(r"^[0-9]{1,78}\Z")
_EVM_FIELDS = ("from", "to", "value", "validAfter", "validBefore", "nonce", "signature")
MIN_VALIDITY_SECONDS = 30  # what /pay asks of validBefore (backend.settlement.verify): less is refused there too


class Refused(ValueError):
    """A payment refused offline (the message says why); nothing was sent to the API."""


@dataclass(frozen=True)
class Checked:
    """A payment that passed the offline checks: who pays, on which network, with which nonce."""

    network: str
    payer: str
    nonce: str


def _network_of(payment: Mapping[str, Any]) -> str | None:
    accepted = payment.get("accepted")
    named = accepted.get("network") if isinstance(accepted, Mapping) else payment.get("network")
    return x402.caip2_network(named) if isinstance(named, str) and named else None


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, str) and isinstance(b, str) and a.lower() == b.lower()


def _check_accepted(payment: Mapping[str, Any], requirement: Mapping[str, Any]) -> None:
    accepted = payment.get("accepted")
    if accepted is None:
        return
    if not isinstance(accepted, Mapping):
        raise Refused("accepted is not an object")
    amount = accepted.get("amount", accepted.get("maxAmountRequired"))
    if str(amount) != str(requirement["maxAmountRequired"]):
        raise Refused(f"accepted.amount must be {requirement['maxAmountRequired']}")
    if not _same(accepted.get("asset"), requirement.get("asset")):
        raise Refused("accepted.asset is not this resource's asset")
    if not _same(accepted.get("payTo"), requirement.get("payTo")):
        raise Refused("accepted.payTo is not this resource's payTo")


def _evm_payload(payload: Mapping[str, Any]) -> dict[str, str]:
    authorization = payload.get("authorization")
    source: Mapping[str, Any] = (
        {**authorization, "signature": payload.get("signature")} if isinstance(authorization, Mapping) else payload
    )
    flat = {}
    for name in _EVM_FIELDS:
        value = source.get(name)
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise Refused(f"the authorization has no {name}")
        flat[name] = str(value)
    return flat


def _check_evm(payload: Mapping[str, Any], requirement: Mapping[str, Any], now: float) -> Checked:
    auth = _evm_payload(payload)
    if not _ADDRESS.match(auth["from"]) or not _ADDRESS.match(auth["to"]) or not _BYTES32.match(auth["nonce"]):
        raise Refused("from, to and nonce must be an address, an address and 32 bytes")
    if not all(_UINT.match(auth[f]) for f in ("value", "validAfter", "validBefore")):
        raise Refused("value, validAfter and validBefore must be whole numbers")
    if not _same(auth["to"], requirement.get("payTo")):
        raise Refused("the authorization pays someone other than this resource's payTo")
    if int(auth["value"]) != int(requirement["maxAmountRequired"]):
        raise Refused(f"the authorization's value must be {requirement['maxAmountRequired']}")
    if int(auth["validAfter"]) > now or int(auth["validBefore"]) <= now + MIN_VALIDITY_SECONDS:
        raise Refused("the authorization is not valid now (validAfter, validBefore)")
    try:
        signer = recover_authorizer(domain_of(requirement), auth)
    except Exception:  # a malformed or high-s signature, or a requirement naming no domain
        raise Refused("the authorization's signature is not valid") from None
    if not _same(signer, auth["from"]):
        raise Refused("the authorization is not signed by its from address")
    return Checked(network=str(requirement["network"]), payer=auth["from"], nonce=auth["nonce"].lower())


def check_payment(payment: Mapping[str, Any], requirements: Iterable[Mapping[str, Any]], now: float) -> Checked:
    """Check ``payment`` (a decoded payment header) against the requirements of the resource it pays."""
    network = _network_of(payment)
    if network is None:
        raise Refused("the payment names no network")
    requirement = next((r for r in requirements if r.get("network") == network), None)
    if requirement is None:
        raise Refused(f"this resource is not sold on {network}")
    accepted = payment.get("accepted")
    scheme = payment.get("scheme") or (accepted.get("scheme") if isinstance(accepted, Mapping) else None) or "exact"
    if scheme != "exact":
        raise Refused("only the exact scheme is accepted")
    _check_accepted(payment, requirement)
    payload = payment.get("payload")
    if not isinstance(payload, Mapping):
        raise Refused("the payment has no payload")
    if network.startswith("eip155:"):
        return _check_evm(payload, requirement, now)
    raise Refused(f"this paywall cannot check a payment on {network}")
