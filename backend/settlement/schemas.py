from __future__ import annotations

from typing import Any

from marshmallow import EXCLUDE, Schema, ValidationError, fields, validate, validates_schema

from backend.schemas import StrictSchema, envelope


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
    intent_id = fields.String(required=True, validate=validate.Length(max=64))
    payment_signature = fields.Nested(PaymentSignatureSchema, required=True)


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
            "pattern": "^[1-9A-HJ-NP-Za-km-z]{32,44}$",
        },
    )
    network = fields.String(
        validate=validate.Length(max=64),
        metadata={
            "description": "A solana:<genesis> network of the intent's requirements (default: its only Solana one)"
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
