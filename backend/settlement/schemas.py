"""Schemas of /pay and the Solana transaction, and the hand-written components of the OpenAPI document that describe
the x402 payment payloads (``x402_components``): marshmallow reads the body's outline, ``settlement.x402`` and the
rails its forms; the document says all of it (each form, each network's kind, the fields' patterns)."""

from __future__ import annotations

from typing import Any

from marshmallow import EXCLUDE, Schema, ValidationError, fields, validate, validates_schema

from backend.chains.addresses import EVM_ADDRESS_PATTERN, SOLANA_ADDRESS_PATTERN
from backend.chains.registry import DEFAULT_X402_V1_NAMES, ChainRegistry
from backend.rails.evm.terms import MAX_TIMESTAMP
from backend.rails.registry import rail_for, rail_of_kind
from backend.schemas import JSON_VALUE_REF, NO_NUL, StrictSchema, envelope, ref, text
from payintent.solana_tx import MAX_TRANSACTION_BYTES

# Decimal strings, the x402 form. (A JSON integer is read too, but JSON Schema cannot tell 5 from 5.0, which is not.)
UINT256 = {"type": "string", "pattern": "^[0-9]{1,77}$", "description": "An unsigned integer below 2**256, in decimal"}
UNIX_TIME = {
    "type": "string",
    "pattern": "^[0-9]{1,18}$",
    "description": f"Unix time in seconds, in decimal (at most {MAX_TIMESTAMP})",
}
_EVM_ADDRESS = {"type": "string", "pattern": EVM_ADDRESS_PATTERN}
_SIGNATURE = {"type": "string", "pattern": "^0x[0-9a-fA-F]{130}$", "description": "65 bytes, 0x-hex"}
_AUTHORIZATION = {
    "from": {**_EVM_ADDRESS, "description": "The payer"},
    "to": {**_EVM_ADDRESS, "description": "The requirement's payTo"},
    "value": UINT256,
    "validAfter": UNIX_TIME,
    "validBefore": UNIX_TIME,
    "nonce": {"type": "string", "pattern": "^0x[0-9a-fA-F]{64}$", "description": "32 random bytes, 0x-hex"},
}
_BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
_TRANSACTION_CHARS = (MAX_TRANSACTION_BYTES + 2) // 3 * 4
# Unknown fields are ignored wherever the x402 forms have them (x402 clients add their own): any JSON value.
_OPEN = {"propertyNames": {"pattern": NO_NUL}, "additionalProperties": JSON_VALUE_REF}
_OPEN_OBJECT = {"type": "object", **_OPEN}


def _payload_components() -> dict[str, dict[str, Any]]:
    nested_fields = [*_AUTHORIZATION, "transaction"]
    return {
        "X402EvmPayload": {
            "description": "The buyer's EIP-3009 TransferWithAuthorization: flat, or as the x402 libraries send it",
            "oneOf": [ref("X402EvmPayloadFlat"), ref("X402EvmPayloadNested")],
        },
        "X402EvmPayloadFlat": {
            "type": "object",
            "required": [*_AUTHORIZATION, "signature"],
            "properties": {**_AUTHORIZATION, "signature": _SIGNATURE},
            "not": {"required": ["authorization"]},
            **_OPEN,
        },
        "X402EvmPayloadNested": {
            "type": "object",
            "required": ["signature", "authorization"],
            "properties": {
                "signature": _SIGNATURE,
                "authorization": {"type": "object", "required": list(_AUTHORIZATION), "properties": _AUTHORIZATION}
                | _OPEN,
            },
            "description": "Not mixed with the flat form: no top-level " + ", ".join(nested_fields),
            "not": {"anyOf": [{"required": [name]} for name in nested_fields]},
            **_OPEN,
        },
        "X402SolanaPayload": {
            "type": "object",
            "required": ["transaction"],
            "properties": {
                "transaction": {
                    "type": "string",
                    "minLength": 4,
                    "maxLength": _TRANSACTION_CHARS,
                    "pattern": _BASE64,
                    "description": "The base64 version-0 transaction from /intents/{id}/solana-transaction, signed by "
                    "the buyer",
                }
            },
            "not": {"required": ["authorization"]},
            **_OPEN,
        },
    }


def x402_network_names(registry: ChainRegistry, kind: str) -> list[str]:
    """Every name a payment may give a configured network of this kind: its CAIP-2 id and its x402 v1 names."""
    names = {network.network for network in registry} | set(DEFAULT_X402_V1_NAMES.values())
    names |= {network.x402_v1_name for network in registry if network.x402_v1_name}
    found = []
    for name in sorted(names):
        network = registry.get(registry.resolve_network(name))
        if network is not None and network.kind == kind:
            found.append(name)
    return found


def _accepted(kind: str, networks: list[str]) -> dict[str, Any]:
    address = rail_of_kind(kind).openapi_address
    return {
        "type": "object",
        "description": "The payment requirement the payload was signed for: scheme, network, amount, asset and payTo "
        "must be the intent's requirement's (amount = maxAmountRequired); other fields are ignored",
        "required": ["scheme", "network", "amount", "asset", "payTo"],
        "properties": {
            "scheme": {"type": "string", "enum": ["exact"]},
            "network": {"type": "string", "enum": networks},
            "amount": UINT256,
            "maxAmountRequired": {**UINT256, "description": "If sent, equal to amount"},
            "asset": address,
            "payTo": address,
            "maxTimeoutSeconds": {"type": "integer", "minimum": 0},
            "extra": _OPEN_OBJECT,
        },
        **_OPEN,
    }


def _payment(version: int, kind: str, networks: list[str]) -> dict[str, Any]:
    payload = ref(rail_of_kind(kind).payload_component)
    ignored = {"resource": JSON_VALUE_REF, "extensions": JSON_VALUE_REF}
    if version == 1:
        return {
            "type": "object",
            "required": ["x402Version", "scheme", "network", "payload"],
            "properties": {
                "x402Version": {"type": "integer", "enum": [1]},
                "scheme": {"type": "string", "enum": ["exact"]},
                "network": {"type": "string", "enum": networks, "description": "A CAIP-2 id or an x402 v1 name"},
                "payload": payload,
                "accepted": {**_OPEN_OBJECT, "description": "Ignored in x402Version 1"},
                **ignored,
            },
            **_OPEN,
        }
    return {
        "type": "object",
        "description": "x402Version 2: scheme and network come from accepted (a top-level scheme must be it)",
        "required": ["x402Version", "accepted", "payload"],
        "properties": {
            "x402Version": {"type": "integer", "enum": [2]},
            "accepted": _accepted(kind, networks),
            "payload": payload,
            "scheme": {"type": "string", "enum": ["exact"]},
            **ignored,
        },
        "not": {"required": ["network"]},
        **_OPEN,
    }


def x402_components(registry: ChainRegistry) -> dict[str, dict[str, Any]]:
    """The x402 payment payloads (``payment_signature``) as this server reads them, for its configured networks."""
    components = _payload_components()
    forms = []
    for kind in ("evm", "solana"):
        networks = x402_network_names(registry, kind)
        if not networks:
            continue
        for version in (1, 2):
            name = f"X402PaymentV{version}{kind.capitalize()}"
            components[name] = _payment(version, kind, networks)
            forms.append(ref(name))
    components["X402PaymentPayload"] = {
        "description": "An x402 PaymentPayload, as x402 clients send it: x402Version 1 (scheme and network at the top "
        "level) or 2 (the requirement in accepted); the payload's form is the network's kind's",
        "oneOf": forms,
    }
    caip2 = sorted(network.network for network in registry)
    solana = sorted(network.network for network in registry if rail_for(network).prepares_transaction)
    components["Network"] = {"type": "string", "enum": caip2, "description": "A configured network's CAIP-2 id"}
    components["SolanaNetwork"] = {"type": "string", "enum": solana, "description": "A Solana network's CAIP-2 id"}
    return components


class PaymentSignatureField(fields.Field[dict[str, Any]]):
    """``payment_signature``: read with PaymentSignatureSchema (its messages nested under the field, as a Nested
    field's), documented as the X402PaymentPayload component."""

    def __init__(self, **kwargs: Any) -> None:
        metadata = {"openapi": ref("X402PaymentPayload"), **kwargs.pop("metadata", {})}
        super().__init__(metadata=metadata, **kwargs)

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> dict[str, Any]:
        loaded: dict[str, Any] = PaymentSignatureSchema().load(value)
        return loaded


class PaymentSignatureSchema(Schema):
    """An x402 PaymentPayload, v1 or v2 (``backend.settlement.x402`` reads every form)."""

    class Meta:
        unknown = EXCLUDE  # x402 clients may add fields of their own

    x402Version = fields.Integer(
        required=True,
        strict=True,
        metadata={
            "enum": [1, 2],
            "description": "1: scheme and network at the top level. 2: they come from `accepted` "
            "(another version: 400 UNSUPPORTED_X402_VERSION)",
        },
    )
    scheme = fields.String(
        validate=validate.Length(max=64),
        metadata={"enum": ["exact"], "description": "Required with x402Version 1; v2 takes accepted.scheme"},
    )
    network = fields.String(
        validate=validate.Length(max=64),
        metadata={
            "example": "eip155:84532",
            "description": "Required with x402Version 1; v2 takes accepted.network. A CAIP-2 id or an x402 v1 "
            "name (base-sepolia, sepolia, solana-devnet...; see docs/x402.md)",
        },
    )
    payload = fields.Dict(
        required=True,
        metadata={
            "description": "EVM: the buyer's EIP-3009 TransferWithAuthorization, values as decimal strings, nonce and "
            "signature 0x-hex, either flat {from, to, value, validAfter, validBefore, nonce, signature} or as the x402 "
            "libraries send it, {signature, authorization: {from, to, value, validAfter, validBefore, nonce}}. "
            "Solana: {transaction}: the base64 transaction from /intents/{id}/solana-transaction, signed by the buyer"
        },
    )
    accepted = fields.Dict(
        metadata={
            "description": "x402Version 2 (required there): the payment requirement the client signed for, "
            "{scheme, network, amount, asset, payTo, maxTimeoutSeconds, extra}. scheme, network, amount, asset "
            "and payTo must be the intent's requirement's (amount = maxAmountRequired); other fields are ignored"
        }
    )
    resource = fields.Raw(allow_none=True, metadata={"description": "x402Version 2: the resource paid for (ignored)"})
    extensions = fields.Raw(allow_none=True, metadata={"description": "x402Version 2: protocol extensions (ignored)"})

    @validates_schema
    def _fields_of_the_version(self, data: dict[str, Any], **_: Any) -> None:
        missing = "Missing data for required field."
        if data.get("x402Version") == 1:
            errors = {name: [missing] for name in ("scheme", "network") if name not in data}
            if errors:
                raise ValidationError(errors)
        elif data.get("x402Version") == 2 and "accepted" not in data:
            raise ValidationError({"accepted": [f"{missing} (x402Version 2 names its requirement in accepted)"]})


class PaySchema(StrictSchema):
    intent_id = fields.String(required=True, validate=validate.Length(max=64), metadata=text())
    payment_signature = PaymentSignatureField(required=True)


class RefundPaySchema(StrictSchema):
    payment_signature = PaymentSignatureField(required=True)


class PaymentResultSchema(StrictSchema):
    tx_hash = fields.String(required=True)
    settled_at = fields.String(required=True, metadata={"format": "date-time"})
    amount_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    network = fields.String(required=True)
    intent_id = fields.String(required=True)
    buyer_address = fields.String(required=True)


PayEnvelope = envelope(PaymentResultSchema, "PaymentResponse")


class SolanaTransactionRequestSchema(StrictSchema):
    payer = fields.String(
        required=True,
        validate=validate.Length(min=32, max=44),
        metadata={
            "description": "The buyer's Solana address (base58 of a 32-byte key): owner of the USDC account paying",
            "pattern": SOLANA_ADDRESS_PATTERN,
        },
    )
    network = fields.String(
        validate=validate.Length(max=64),
        metadata={
            "description": "A solana:<genesis> network of the intent's requirements (default: its only Solana one)",
            "openapi": ref("SolanaNetwork"),
        },
    )


class SolanaTransactionSchema(StrictSchema):
    transaction = fields.String(
        required=True,
        metadata={"description": "Base64 version-0 transaction for the buyer to sign (the relay signs at /pay)"},
    )
    network = fields.String(required=True)
    payer = fields.String(required=True)
    fee_payer = fields.String(required=True, metadata={"description": "The relay: pays the fee, nothing else"})
    recent_blockhash = fields.String(required=True)
    last_valid_block_height = fields.Integer(
        required=True, metadata={"description": "Sign and submit before the chain passes this height (about a minute)"}
    )
    creates_payee_account = fields.Boolean(
        required=True,
        metadata={
            "description": "The merchant's USDC account does not exist yet: this transaction opens it first, "
            "the payer paying its rent (the relay pays fees only)"
        },
    )
    payer_pays_lamports = fields.Integer(
        required=True,
        metadata={"description": "SOL (lamports) the payer pays besides the USDC: the rent when opening the account"},
    )


SolanaTransactionEnvelope = envelope(SolanaTransactionSchema, "SolanaTransactionResponse")
