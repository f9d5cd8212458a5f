"""backend.settlement.x402 on its own (no chain, no database): every accepted form, every refusal."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.chains.registry import ChainRegistry
from backend.errors import DomainError
from backend.settlement.x402 import X402Payment, check_accepted, flatten_payload, normalize_payment_signature

AUTH = {
    "from": "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266",
    "to": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    "value": "1000000",
    "validAfter": "0",
    "validBefore": "1795343505",
    "nonce": "0x" + "ab" * 32,
}
SIGNATURE = "0x" + "11" * 65
FLAT = {**AUTH, "signature": SIGNATURE}
NESTED = {"signature": SIGNATURE, "authorization": AUTH}
REQUIREMENT = {
    "scheme": "exact",
    "network": "eip155:84532",
    "maxAmountRequired": "1000000",
    "resource": "http://127.0.0.1:8000/pay/pi_1",
    "description": "Payment",
    "mimeType": "application/json",
    "payTo": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    "maxTimeoutSeconds": 120,
    "asset": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
    "usdcDomainName": "USDC",
    "extra": {"name": "USDC", "version": "2"},
}
ACCEPTED = {
    "scheme": "exact",
    "network": "eip155:84532",
    "amount": "1000000",
    "asset": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
    "payTo": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    "maxTimeoutSeconds": 120,
    "extra": {"name": "USDC", "version": "2"},
}
SOLANA = "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"


def refused(signature: Any, registry: ChainRegistry | None = None) -> DomainError:
    with pytest.raises(DomainError) as info:
        normalize_payment_signature(signature, registry)
    assert info.value.http_status == 400
    return info.value


@pytest.mark.parametrize(
    ("signature", "network_as_sent"),
    [
        ({"x402Version": 1, "scheme": "exact", "network": "eip155:84532", "payload": FLAT}, "eip155:84532"),
        ({"x402Version": 1, "scheme": "exact", "network": "eip155:84532", "payload": NESTED}, "eip155:84532"),
        ({"x402Version": 1, "scheme": "exact", "network": "base-sepolia", "payload": NESTED}, "base-sepolia"),
        ({"x402Version": 1, "scheme": "exact", "network": "base-sepolia", "payload": FLAT}, "base-sepolia"),
    ],
    ids=["v1-flat", "v1-nested", "v1-nested-v1-name", "v1-flat-v1-name"],
)
def test_v1_forms_become_the_flat_payload_on_the_caip2_network(signature, network_as_sent):
    payment = normalize_payment_signature(signature)
    assert payment == X402Payment(1, "exact", "eip155:84532", FLAT, None, network_as_sent)


def test_v2_takes_scheme_and_network_from_accepted_and_ignores_the_rest():
    signature = {
        "x402Version": 2,
        "payload": NESTED,
        "accepted": {**ACCEPTED, "network": "base-sepolia", "unknown": 1},
        "resource": {"url": "http://x"},
        "extensions": {"bazaar": {}},
        "anythingElse": [1, 2],
    }
    payment = normalize_payment_signature(json.loads(json.dumps(signature)))
    assert (payment.x402_version, payment.scheme, payment.network) == (2, "exact", "eip155:84532")
    assert payment.payload == FLAT and payment.accepted["unknown"] == 1
    # A top-level scheme/network that agrees with accepted (in either form) is fine.
    agreeing = {**signature, "scheme": "exact", "network": "eip155:84532"}
    assert normalize_payment_signature(agreeing).network == "eip155:84532"


def test_solana_transaction_in_v1_and_v2():
    payload = {"transaction": "AQID"}
    v1 = normalize_payment_signature({"x402Version": 1, "scheme": "exact", "network": "solana-devnet",
                                      "payload": payload})  # fmt: skip
    assert v1.network == SOLANA and v1.payload == payload
    v2 = normalize_payment_signature(
        {"x402Version": 2, "payload": payload, "accepted": {**ACCEPTED, "network": SOLANA}}
    )
    assert v2.network == SOLANA and v2.payload == payload and v2.accepted["network"] == SOLANA


def test_unknown_v1_names_and_caip2_ids_pass_through_for_the_flow_to_refuse():
    payment = normalize_payment_signature({"x402Version": 1, "scheme": "exact", "network": "arc", "payload": FLAT})
    assert payment.network == "arc"
    payment = normalize_payment_signature({"x402Version": 1, "scheme": "exact", "network": "eip155:1", "payload": FLAT})
    assert payment.network == "eip155:1"


def test_the_registry_resolves_the_names_its_chains_file_gives(tmp_path):
    path = tmp_path / "chains.json"
    path.write_text(json.dumps({"networks": [{"network": "eip155:5042002", "x402_v1_name": "arc-testnet",
                                              "usdc_address": ACCEPTED["asset"]}]}))  # fmt: skip
    registry = ChainRegistry.load(path)
    signature = {"x402Version": 1, "scheme": "exact", "network": "arc-testnet", "payload": FLAT}
    assert normalize_payment_signature(signature, registry).network == "eip155:5042002"
    assert normalize_payment_signature(signature).network == "arc-testnet"  # not a library name
    v2 = {"x402Version": 2, "payload": NESTED, "accepted": {**ACCEPTED, "network": "arc-testnet"}}
    check_accepted(v2["accepted"], {**REQUIREMENT, "network": "eip155:5042002"}, registry)


@pytest.mark.parametrize(
    ("signature", "code", "field"),
    [
        ("x", "INVALID_PAYLOAD", "payment_signature"),
        ([], "INVALID_PAYLOAD", "payment_signature"),
        ({"payload": FLAT}, "UNSUPPORTED_X402_VERSION", None),
        ({"x402Version": 3, "payload": FLAT}, "UNSUPPORTED_X402_VERSION", None),
        ({"x402Version": "1", "scheme": "exact", "network": "eip155:84532", "payload": FLAT},
         "UNSUPPORTED_X402_VERSION", None),
        ({"x402Version": True, "scheme": "exact", "network": "eip155:84532", "payload": FLAT},
         "UNSUPPORTED_X402_VERSION", None),
        ({"x402Version": 1.0, "scheme": "exact", "network": "eip155:84532", "payload": FLAT},
         "UNSUPPORTED_X402_VERSION", None),
        ({"x402Version": 1, "network": "eip155:84532", "payload": FLAT}, "INVALID_PAYLOAD", "payment_signature.scheme"),
        ({"x402Version": 1, "scheme": "exact", "payload": FLAT}, "INVALID_PAYLOAD", "payment_signature.network"),
        ({"x402Version": 1, "scheme": "exact", "network": "x" * 65, "payload": FLAT}, "INVALID_PAYLOAD",
         "payment_signature.network"),
        ({"x402Version": 1, "scheme": "exact", "network": "eip155:84532"}, "INVALID_PAYLOAD",
         "payment_signature.payload"),
        ({"x402Version": 1, "scheme": "exact", "network": "eip155:84532", "payload": [FLAT]}, "INVALID_PAYLOAD",
         "payment_signature.payload"),
        ({"x402Version": 2, "payload": NESTED}, "INVALID_PAYLOAD", "payment_signature.accepted"),
        ({"x402Version": 2, "payload": NESTED, "accepted": [ACCEPTED]}, "INVALID_PAYLOAD",
         "payment_signature.accepted"),
        ({"x402Version": 2, "payload": NESTED, "accepted": {**ACCEPTED, "scheme": None}}, "INVALID_PAYLOAD",
         "payment_signature.accepted.scheme"),
        ({"x402Version": 2, "payload": NESTED, "accepted": {**ACCEPTED, "network": {}}}, "INVALID_PAYLOAD",
         "payment_signature.accepted.network"),
        ({"x402Version": 2, "payload": NESTED, "accepted": ACCEPTED, "network": "sepolia"}, "INVALID_PAYLOAD",
         "payment_signature.network"),
        ({"x402Version": 2, "payload": NESTED, "accepted": ACCEPTED, "network": 84532}, "INVALID_PAYLOAD",
         "payment_signature.network"),
        ({"x402Version": 2, "payload": NESTED, "accepted": ACCEPTED, "scheme": "upto"}, "INVALID_PAYLOAD",
         "payment_signature.scheme"),
    ],
)  # fmt: skip
def test_unreadable_signatures_are_400s_naming_the_field(signature, code, field):
    error = refused(signature)
    assert error.code == code and error.message
    assert error.extra.get("field") == field


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"signature": SIGNATURE, "authorization": "x"}, "payment_signature.payload.authorization"),
        ({"signature": SIGNATURE, "authorization": None}, "payment_signature.payload.authorization"),
        ({"authorization": AUTH}, "payment_signature.payload.signature"),
        ({**NESTED, "from": AUTH["from"]}, "payment_signature.payload.from"),
        ({**NESTED, "transaction": "AQID"}, "payment_signature.payload.transaction"),
    ],
)
def test_malformed_nested_payloads(payload, field):
    error = refused({"x402Version": 1, "scheme": "exact", "network": "eip155:84532", "payload": payload})
    assert error.code == "INVALID_PAYLOAD" and error.extra["field"] == field


def test_flatten_leaves_field_checks_to_the_verifier():
    # A nested authorization missing a field flattens without it; parse_evm_payload names it.
    from backend.rails.evm.terms import parse_evm_payload

    partial = {"signature": SIGNATURE, "authorization": {k: v for k, v in AUTH.items() if k != "nonce"}}
    with pytest.raises(DomainError) as info:
        parse_evm_payload(flatten_payload(partial))
    assert info.value.code == "INVALID_PAYLOAD" and info.value.extra["field"] == "payment_signature.payload.nonce"
    assert parse_evm_payload(flatten_payload(NESTED)).raw == FLAT


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"scheme": "upto"}, "UNSUPPORTED_SCHEME"),
        ({"network": "eip155:11155111"}, "UNSUPPORTED_NETWORK"),
        ({"network": "sepolia"}, "UNSUPPORTED_NETWORK"),
        ({"network": None}, "UNSUPPORTED_NETWORK"),
        ({"amount": "999999"}, "AMOUNT_MISMATCH"),
        ({"amount": 999999}, "AMOUNT_MISMATCH"),
        ({"maxAmountRequired": "2"}, "AMOUNT_MISMATCH"),
        ({"amount": "-1"}, "INVALID_PAYLOAD"),
        ({"amount": True}, "INVALID_PAYLOAD"),
        ({"amount": None}, "INVALID_PAYLOAD"),
        ({"asset": "0x1c7D4B196Cb0C7B01d743Fbc6116a902379C7238"}, "ASSET_MISMATCH"),
        ({"asset": None}, "ASSET_MISMATCH"),
        ({"payTo": "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"}, "RECIPIENT_MISMATCH"),
        ({"payTo": 1}, "RECIPIENT_MISMATCH"),
    ],
)
def test_check_accepted_compares_field_by_field(change, code):
    with pytest.raises(DomainError) as info:
        check_accepted({**ACCEPTED, **change}, REQUIREMENT)
    assert info.value.http_status == 400 and info.value.code == code


def test_check_accepted_ignores_other_fields_and_address_case():
    check_accepted(
        {**ACCEPTED, "network": "base-sepolia", "payTo": ACCEPTED["payTo"].lower(), "asset": ACCEPTED["asset"].upper()
         .replace("0X", "0x"), "amount": 1000000, "maxTimeoutSeconds": 1, "extra": None, "new": {}},
        REQUIREMENT,
    )  # fmt: skip
    check_accepted(
        {**{k: v for k, v in ACCEPTED.items() if k != "amount"}, "maxAmountRequired": "1000000"}, REQUIREMENT
    )
    solana = {**REQUIREMENT, "network": SOLANA, "payTo": "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM",
              "asset": "4zMMC9srt5Ri5X14GAgXhaHii3GnPAEERYPJgZJDncDU"}  # fmt: skip
    accepted = {**ACCEPTED, "network": "solana-devnet", "payTo": solana["payTo"], "asset": solana["asset"]}
    check_accepted(accepted, solana)
    with pytest.raises(DomainError) as info:  # base58 is case-sensitive
        check_accepted({**accepted, "payTo": solana["payTo"].lower()}, solana)
    assert info.value.code == "RECIPIENT_MISMATCH"
