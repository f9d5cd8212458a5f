"""Properties of signature checking: ``payintent.eip3009`` and ``rails.evm.terms``, offline.

A correctly signed authorization for a requirement always passes; change any one thing it was
signed over (a field of the authorization, or the EIP-712 domain: chain id, token name, version,
contract) and it fails, even when the changed value would itself satisfy the requirement. Malformed
payloads are refused as ``INVALID_PAYLOAD``, never with another exception.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from eth_account import Account
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from backend.errors import DomainError
from backend.rails.evm.terms import PAYLOAD_FIELDS, parse_evm_payload, verify_evm_authorization
from backend.settlement.x402 import check_accepted
from payintent.eip3009 import SECP256K1_HALF_N, domain_of, recover_authorizer, sign_authorization

NOW = 1_800_000_000
SECP256K1_N = 2 * SECP256K1_HALF_N + 1
REQUIREMENT = {
    "scheme": "exact",
    "network": "eip155:84532",
    "asset": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
    "payTo": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    "maxAmountRequired": "5000000",
    "usdcDomainName": "USDC",
    "extra": {"name": "USDC", "version": "2"},
}
# Signing is a few milliseconds: a modest number of examples, no deadline.
SIGNING = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

keys = st.integers(min_value=1, max_value=SECP256K1_N - 1).map(lambda k: Account.from_key(k.to_bytes(32, "big")))
addresses = st.binary(min_size=20, max_size=20).map(lambda b: Account.from_key(b.rjust(32, b"\1")).address)
requirements = st.fixed_dictionaries(
    {
        "network": st.integers(min_value=1, max_value=2**53).map(lambda chain_id: f"eip155:{chain_id}"),
        "asset": addresses,
        "payTo": addresses,
        "maxAmountRequired": st.integers(min_value=1, max_value=10**15).map(str),
        "usdcDomainName": st.text(min_size=1, max_size=20),
        "extra": st.fixed_dictionaries({"version": st.sampled_from(["1", "2"])}),
    }
).map(lambda changed: {**REQUIREMENT, **changed})


def signed(buyer: Account, requirement: dict, valid_for: int = 900, nonce: bytes | None = None) -> dict[str, str]:
    return sign_authorization(buyer, requirement, now=NOW, valid_for=valid_for, nonce=nonce)


def verify(payload: dict, requirement: dict) -> None:
    verify_evm_authorization(parse_evm_payload(payload), requirement, NOW)


def error_code(payload: dict, requirement: dict) -> str | None:
    try:
        verify(payload, requirement)
    except DomainError as err:
        return err.code
    return None


@SIGNING
@given(buyer=keys, requirement=requirements, valid_for=st.integers(min_value=31, max_value=3600))
def test_a_correctly_signed_authorization_always_passes(buyer, requirement, valid_for):
    if buyer.address == requirement["payTo"]:
        return  # paying oneself is refused, whatever the signature
    payload = signed(buyer, requirement, valid_for)
    assert recover_authorizer(domain_of(requirement), payload) == buyer.address
    verify(payload, requirement)


# Each change: (field, new value in the authorization, the same change in the requirement so that
# only the signature can catch it).
CHANGES = {
    "value": lambda payload, req: (
        str(int(payload["value"]) + 1),
        {"maxAmountRequired": str(int(payload["value"]) + 1)},
    ),
    "to": lambda payload, req: (
        "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC",
        {"payTo": "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"},
    ),
    "from": lambda payload, req: ("0x90F79bf6EB2c4f870365E785982E1f101E93b906", {}),
    "validBefore": lambda payload, req: (str(int(payload["validBefore"]) - 1), {}),
    "validAfter": lambda payload, req: (str(int(payload["validAfter"]) + 1), {}),
    "nonce": lambda payload, req: ("0x" + bytes(a ^ 1 for a in bytes.fromhex(payload["nonce"][2:])).hex(), {}),
}


@SIGNING
@given(buyer=keys, field=st.sampled_from(sorted(CHANGES)), nonce=st.binary(min_size=32, max_size=32))
def test_changing_any_signed_field_fails_even_when_the_requirement_agrees(buyer, field, nonce):
    payload = signed(buyer, REQUIREMENT, nonce=nonce)
    value, requirement_change = CHANGES[field](payload, REQUIREMENT)
    tampered, requirement = {**payload, field: value}, {**REQUIREMENT, **requirement_change}
    assert error_code(tampered, requirement) == "INVALID_SIGNATURE"
    assert error_code(tampered, REQUIREMENT) is not None  # and against the original requirement, of course


DOMAIN_CHANGES = {
    "chain id": {"network": "eip155:11155111"},
    "domain name": {"usdcDomainName": "USD Coin", "extra": {"name": "USD Coin", "version": "2"}},
    "domain version": {"extra": {"name": "USDC", "version": "1"}},
    "token contract": {"asset": "0x1c7D4B196Cb0C7B01d743Fbc6116a902379C7238"},
}


@SIGNING
@given(buyer=keys, change=st.sampled_from(sorted(DOMAIN_CHANGES)))
def test_a_signature_for_another_domain_fails(buyer, change):
    payload = signed(buyer, {**REQUIREMENT, **DOMAIN_CHANGES[change]})
    assert error_code(payload, REQUIREMENT) == "INVALID_SIGNATURE"


@SIGNING
@given(buyer=keys, index=st.one_of(st.just(64), st.integers(0, 63)), flip=st.integers(min_value=1, max_value=255))
def test_changing_any_byte_of_the_signature_fails(buyer, index, flip):
    payload = signed(buyer, REQUIREMENT)
    signature = bytearray(bytes.fromhex(payload["signature"][2:]))
    # v written as 0 or 1 is the same signature as 27 or 28 (accepted: test_v_as_0_or_1_is_accepted_as_27_or_28);
    # 27 ^ 27 and 28 ^ 29 are such a rewrite, not a change.
    assume(not (index == 64 and signature[64] ^ flip == signature[64] - 27))
    signature[index] ^= flip
    assert error_code({**payload, "signature": "0x" + signature.hex()}, REQUIREMENT) == "INVALID_SIGNATURE"


@pytest.mark.parametrize("offset", [8, 32, 108])
def test_an_eip155_style_v_is_refused_as_the_token_refuses_it(offset):
    # Found by test_changing_any_byte_of_the_signature_fails: eth_account reads v >= 35 as EIP-155
    # (v + 8, v + 32... recover the same signer), but the token takes only 27 and 28.
    payload = signed(Account.from_key("0x" + "07" * 32), REQUIREMENT)
    signature = bytearray(bytes.fromhex(payload["signature"][2:]))
    signature[64] = (signature[64] + offset) % 256
    assert error_code({**payload, "signature": "0x" + signature.hex()}, REQUIREMENT) == "INVALID_SIGNATURE"


@pytest.mark.parametrize("v", [0, 1])
def test_v_as_0_or_1_is_accepted_as_27_or_28(v):
    payload = signed(Account.from_key("0x" + "07" * 32), REQUIREMENT)
    signature = bytearray(bytes.fromhex(payload["signature"][2:]))
    standard = signature[64] - 27
    signature[64] = v
    assert (error_code({**payload, "signature": "0x" + signature.hex()}, REQUIREMENT) is None) == (v == standard)


# Strings a lax parser might take for the valid one: whitespace around it, or a near-miss.
_AROUND = st.sampled_from(["\n", " ", "\t", "\r\n", "\x00", "\u00a0", "\u2028", "\ufeff"])
_JUNK = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8), st.lists(st.integers(), max_size=2))


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(PAYLOAD_FIELDS), data=st.data())
def test_a_malformed_field_is_refused_never_another_error(field, data):
    payload = signed(Account.from_key("0x" + "07" * 32), REQUIREMENT, nonce=b"\7" * 32)
    valid = payload[field]
    payload[field] = data.draw(
        st.one_of(
            _JUNK,
            st.tuples(_AROUND, st.booleans()).map(lambda a: valid + a[0] if a[1] else a[0] + valid),
            st.integers(min_value=0, max_value=len(valid) - 1).map(lambda n: valid[:n]),
        )
    )
    try:
        parsed = parse_evm_payload(payload)
    except DomainError as err:
        assert err.code == "INVALID_PAYLOAD" and err.extra["field"].endswith(field)
        return
    if replace(parsed, raw={}) == replace(parse_evm_payload({**payload, field: valid}), raw={}):
        return  # another spelling of the same value (an integer for a uint string)
    with pytest.raises(DomainError):  # a well-formed other value: the checks or the signature refuse it
        verify_evm_authorization(parsed, REQUIREMENT, NOW)


@pytest.mark.parametrize("field", PAYLOAD_FIELDS)
def test_a_trailing_newline_is_refused_not_a_crash_or_ignored(field):
    # Found by tests/test_fuzz_api.py: "$" matches before a final "\n", so "0x…\n" passed the address
    # pattern and then crashed the checksum (500), and "5000000\n" passed as a number.
    payload = signed(Account.from_key("0x" + "07" * 32), REQUIREMENT)
    payload[field] += "\n"
    with pytest.raises(DomainError) as raised:
        parse_evm_payload(payload)
    assert raised.value.code == "INVALID_PAYLOAD"


def test_a_v2_accepted_amount_with_a_trailing_newline_is_refused():
    accepted = {**REQUIREMENT, "amount": REQUIREMENT["maxAmountRequired"] + "\n"}
    del accepted["maxAmountRequired"]
    with pytest.raises(DomainError) as raised:
        check_accepted(accepted, REQUIREMENT)
    assert raised.value.code == "INVALID_PAYLOAD"
