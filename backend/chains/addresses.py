"""Address validation: the one place that decides what a valid payout address is."""

from __future__ import annotations

import re

from eth_utils import to_checksum_address
from solders.pubkey import Pubkey

# \Z, not $: $ also matches before a trailing newline, which the checksum would then choke on.
_EVM_RE = re.compile(r"^0x[0-9a-fA-F]{40}\Z")
_BASE58_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,44}\Z")


_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
EVM_ADDRESS_PATTERN = "^0x[0-9a-fA-F]{40}$"
EVM_ZERO_ADDRESS = "0x" + "0" * 40


def _digit_class(low: int, high: int) -> str:
    """A regex class of the base58 digits of values low..high ("" if none)."""
    chars = _BASE58[low : high + 1]
    if not chars:
        return ""
    runs: list[str] = []
    start = 0
    for i in range(1, len(chars) + 1):
        if i == len(chars) or ord(chars[i]) != ord(chars[i - 1]) + 1:
            run = chars[start:i]
            runs.append(run if len(run) <= 2 else f"{run[0]}-{run[-1]}")
            start = i
    return runs[0] if len(chars) == 1 else f"[{''.join(runs)}]"


def _digits(value: int, count: int) -> list[int]:
    out = []
    for _ in range(count):
        value, digit = divmod(value, 58)
        out.append(digit)
    return out[::-1]


def _bounded(bound: list[int], above: bool, depth: int, first: int) -> str:
    """Base58 strings of len(bound) digits at most (``above``: at least) ``bound``, digit by digit for ``depth``
    digits, then any: a subset of the exact set that misses about 58**-depth of it. The first digit is ``first``
    or more (at most, ``above``)."""
    any_rest = f"[1-9A-HJ-NP-Za-km-z]{{{len(bound) - 1}}}" if len(bound) > 1 else ""
    head = _digit_class(bound[0] + 1, first) if above else _digit_class(first, bound[0] - 1)
    alternatives = [head + any_rest] if head else []
    if depth > 1 and len(bound) > 1:
        alternatives.append(f"{_BASE58[bound[0]]}(?:{_bounded(bound[1:], above, depth - 1, 57 if above else 0)})")
    return "|".join(alternatives)


def _solana_address_pattern(depth: int = 3) -> str:
    """A regex of the base58 strings that decode to 32 bytes (what normalize_solana_address reads), for the OpenAPI
    document: those of a key whose first byte is not 0 ([2**248, 2**256): 43 or 44 digits) and of a key whose first
    byte is 0 and second is not ("1" then [2**240, 2**248)). Every string it matches is a key; it misses about one
    key in 60,000 (the digit-by-digit bounds stop after ``depth`` digits; two leading zero bytes)."""
    keys = [
        _bounded(_digits(2**256 - 1, 44), above=False, depth=depth, first=1),
        _bounded(_digits(2**248, 43), above=True, depth=depth, first=57),
    ]
    first_byte_zero = [
        _bounded(_digits(2**240, 41), above=True, depth=depth, first=57),
        f"{_digit_class(1, 57)}[1-9A-HJ-NP-Za-km-z]{{41}}",
        _bounded(_digits(2**248 - 1, 43), above=False, depth=depth, first=1),
    ]
    return f"^(?:{'|'.join(keys)}|1(?:{'|'.join(first_byte_zero)}))$"


SOLANA_ADDRESS_PATTERN = _solana_address_pattern()


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
