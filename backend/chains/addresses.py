"""Address validation: the one place that decides what a valid payout address is."""

from __future__ import annotations

import re

from eth_utils import to_checksum_address
from solders.pubkey import Pubkey

# \Z, not $: $ also matches before a trailing newline, which the checksum would then choke on.
_EVM_RE = re.compile(r"^0x[0-9a-fA-F]{40}\Z")
_BASE58_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,44}\Z")


class AddressError(ValueError):
    """Not a valid address for the network; the message is safe to show."""


def normalize_evm_address(address: str) -> str:
    """Return the EIP-55 checksummed form; refuse malformed or wrongly checksummed input."""
    if not isinstance(address, str) or not _EVM_RE.match(address):
        raise AddressError("must be 0x followed by 40 hex characters")
    checksummed = to_checksum_address(address)
    body = address[2:]
    mixed_case = body != body.lower() and body != body.upper()
    if mixed_case and address != checksummed:
        raise AddressError("has an invalid EIP-55 checksum (check for a typo)")
    if int(address, 16) == 0:
        raise AddressError("must not be the zero address")
    return checksummed


def normalize_solana_address(address: str) -> str:
    """A base58-encoded 32-byte public key."""
    if not isinstance(address, str) or not _BASE58_RE.match(address):
        raise AddressError("must be a base58-encoded 32-byte public key")
    try:
        key = Pubkey.from_string(address)
    except ValueError:
        raise AddressError("must be a base58-encoded 32-byte public key") from None
    if key == Pubkey.default():
        raise AddressError("must not be the all-zero key (the System Program)")
    return str(key)
