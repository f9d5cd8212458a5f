"""Payout wallets proven, not pasted: the wallet signs a message naming the merchant and the network.

A typo in a pasted payout address sends every later payment to an address nobody controls. The dashboard instead
asks the wallet itself (connected in the browser) to sign a short message in the style of Sign-In with Ethereum:
what it is for, the merchant, the network, the address, a random nonce and when it was issued. EVM wallets sign it
with EIP-191 ``personal_sign``, Solana wallets with ``signMessage``; the network's rail checks the signature
(``Rail.signed_message_by``). A signature proves the key holder agreed to receive this merchant's payments on this
network: it cannot be replayed for another merchant, network or address (they are in the text), nor after
``CHALLENGE_SECONDS`` or a second time (the challenge lives in the merchant's session and is used once).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from backend import clock
from backend.chains.addresses import AddressError
from backend.chains.registry import ChainRegistry, Network
from backend.errors import echo
from backend.merchants.models import Merchant, Wallet
from backend.merchants.services import MerchantError, get_merchant, set_wallet
from backend.rails.registry import rail_for

CHALLENGE_SECONDS = 600


@dataclass(frozen=True)
class Challenge:
    network: str
    address: str
    message: str
    expires_at: datetime

    def to_session(self) -> dict[str, Any]:
        return {"network": self.network, "address": self.address, "message": self.message,
                "expires_at": self.expires_at.timestamp()}  # fmt: skip

    @classmethod
    def from_session(cls, value: Any) -> Challenge | None:
        if not isinstance(value, dict):
            return None
        try:
            return cls(str(value["network"]), str(value["address"]), str(value["message"]),
                       datetime.fromtimestamp(float(value["expires_at"]), clock.now().tzinfo))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None


def _network(registry: ChainRegistry, network_id: str) -> Network:
    network = registry.get(network_id) if isinstance(network_id, str) else None
    if network is None:
        raise MerchantError("UNKNOWN_NETWORK", f"network {echo(str(network_id))} is not configured")
    return network


def challenge(merchant_id: str, network_id: str, address: str, registry: ChainRegistry) -> Challenge:
    """The message the wallet at ``address`` signs to become the merchant's payout wallet on the network."""
    merchant: Merchant = get_merchant(merchant_id)
    network = _network(registry, network_id)
    try:
        normalized = rail_for(network).normalize_address(address)
    except AddressError as exc:
        raise MerchantError("INVALID_ADDRESS", f"address {exc}") from None
    now = clock.now()
    message = (
        "payintent: register this wallet as a payout wallet.\n"
        "\n"
        f"Merchant: {merchant.name} ({merchant.id})\n"
        f"Network: {network.name} ({network.network})\n"
        f"Wallet: {normalized}\n"
        f"Nonce: {secrets.token_hex(16)}\n"
        f"Issued at: {clock.isoformat(now)}\n"
        "\n"
        "Signing moves no funds. Payments to this merchant on this network will go to this wallet."
    )
    return Challenge(network.network, normalized, message, now + timedelta(seconds=CHALLENGE_SECONDS))


def prove(
    merchant_id: str, issued: Challenge | None, network_id: str, address: str, signature: str, registry: ChainRegistry
) -> Wallet:
    """Register the wallet as proven if ``signature`` is its signature of the challenge ``issued`` (to this session,
    for this network and address, not expired); raises MerchantError (WALLET_NOT_PROVEN) otherwise. Commits."""
    network = _network(registry, network_id)
    rail = rail_for(network)
    if issued is None or issued.network != network.network or not rail.same_address(issued.address, str(address)):
        raise MerchantError("WALLET_NOT_PROVEN", "no message was issued for this wallet: connect it again")
    if issued.expires_at <= clock.now():
        raise MerchantError("WALLET_NOT_PROVEN", "the message expired: connect the wallet again")
    if not rail.signed_message_by(issued.address, issued.message, signature):
        raise MerchantError("WALLET_NOT_PROVEN", f"the signature is not {issued.address}'s signature of the message")
    return set_wallet(merchant_id, network.network, issued.address, registry, verified=True)
