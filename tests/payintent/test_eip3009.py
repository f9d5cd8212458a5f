"""What a buyer signs: the one EIP-3009 definition shared by client and service."""

from __future__ import annotations

import pytest
from eth_account import Account
from hypothesis import given, settings
from hypothesis import strategies as st

from payintent.eip3009 import SECP256K1_HALF_N, domain_of, recover_authorizer, sign_authorization

REQUIREMENT = {
    "scheme": "exact",
    "network": "eip155:84532",
    "asset": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
    "payTo": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    "maxAmountRequired": "10500000",
    "usdcDomainName": "USDC",
    "extra": {"name": "USDC", "version": "2"},
}
BUYER = Account.from_key("0x" + "11" * 32)


def test_domain_comes_from_the_requirement():
    assert domain_of(REQUIREMENT) == {
        "name": "USDC",
        "version": "2",
        "chainId": 84532,
        "verifyingContract": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
    }
    assert domain_of({**REQUIREMENT, "usdcDomainName": "USD Coin"})["name"] == "USD Coin"


def test_signed_payload_shape_and_recovery():
    payload = sign_authorization(BUYER.key, REQUIREMENT, now=1_000_000)
    assert payload["from"] == BUYER.address
    assert payload["to"] == REQUIREMENT["payTo"]
    assert payload["value"] == "10500000"
    assert payload["validAfter"] == "0"
    assert payload["validBefore"] == str(1_000_000 + 900)
    assert len(bytes.fromhex(payload["nonce"][2:])) == 32
    assert recover_authorizer(domain_of(REQUIREMENT), payload) == BUYER.address


def test_every_signature_has_a_fresh_nonce():
    nonces = {sign_authorization(BUYER.key, REQUIREMENT)["nonce"] for _ in range(50)}
    assert len(nonces) == 50


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("value", "10500001"),
        ("to", "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"),
        ("validBefore", "1"),
        ("nonce", "0x" + "00" * 32),
    ],
)
def test_any_tampering_changes_the_signer(field, value):
    payload = {**sign_authorization(BUYER.key, REQUIREMENT), field: value}
    assert recover_authorizer(domain_of(REQUIREMENT), payload) != BUYER.address


@pytest.mark.parametrize(
    "changed",
    [
        {"network": "eip155:11155111"},
        {"asset": "0x1c7D4B196Cb0C7B01d743Fbc6116a902379C7238"},
        {"usdcDomainName": "USD Coin"},
        {"extra": {"name": "USDC", "version": "1"}},
    ],
)
def test_a_signature_is_bound_to_its_domain(changed):
    payload = sign_authorization(BUYER.key, REQUIREMENT)
    assert recover_authorizer(domain_of({**REQUIREMENT, **changed}), payload) != BUYER.address


def test_high_s_signatures_are_refused():
    payload = sign_authorization(BUYER.key, REQUIREMENT)
    sig = bytes.fromhex(payload["signature"][2:])
    s = int.from_bytes(sig[32:64], "big")
    flipped = sig[:32] + (0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141 - s).to_bytes(32, "big")
    flipped += bytes([sig[64] ^ 1])
    assert int.from_bytes(flipped[32:64], "big") > SECP256K1_HALF_N
    with pytest.raises(ValueError, match="high s"):
        recover_authorizer(domain_of(REQUIREMENT), {**payload, "signature": "0x" + flipped.hex()})


@settings(max_examples=25, deadline=None)
@given(amount=st.integers(min_value=1, max_value=10**15), valid_for=st.integers(min_value=1, max_value=10**6))
def test_round_trip_for_any_amount_and_window(amount, valid_for):
    requirement = {**REQUIREMENT, "maxAmountRequired": str(amount)}
    payload = sign_authorization(BUYER.key, requirement, valid_for=valid_for)
    assert payload["value"] == str(amount)
    assert recover_authorizer(domain_of(requirement), payload) == BUYER.address
