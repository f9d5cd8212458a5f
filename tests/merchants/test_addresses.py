"""Address validation (``backend.chains.addresses``): the one place an address is accepted."""

from __future__ import annotations

import pytest

from backend.chains.addresses import AddressError
from backend.rails.registry import rail_of_kind


def normalize_address(kind: str, address: str) -> str:
    return rail_of_kind(kind).normalize_address(address)


EVM = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
SOLANA = "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM"


@pytest.mark.parametrize(("kind", "address"), [("evm", EVM), ("evm", EVM.lower()), ("solana", SOLANA)])
def test_valid_addresses_are_kept(kind, address):
    assert normalize_address(kind, address).lower() == address.lower()


@pytest.mark.parametrize("suffix", ["\n", " ", "\r\n", "\t"])
@pytest.mark.parametrize(("kind", "address"), [("evm", EVM), ("solana", SOLANA)])
def test_surrounding_whitespace_is_an_address_error_not_a_crash(kind, address, suffix):
    # Found by tests/test_fuzz_api.py: "$" matched before a final "\n", so "0x…\n" passed the pattern and
    # the checksum then raised a plain ValueError (the checkout balance answered 500).
    for text in (address + suffix, suffix + address):
        with pytest.raises(AddressError):
            normalize_address(kind, text)
