from __future__ import annotations

from marshmallow import EXCLUDE, Schema, fields, validate

from backend.schemas import StrictSchema, envelope


class PaymentSignatureSchema(Schema):
    class Meta:
        unknown = EXCLUDE  # x402 clients may add fields of their own

    scheme = fields.String(required=True, metadata={"enum": ["exact"]})
    network = fields.String(required=True, validate=validate.Length(max=64), metadata={"example": "eip155:84532"})
    x402Version = fields.Integer(required=True, strict=True, metadata={"enum": [1]})
    payload = fields.Dict(
        required=True,
        metadata={
            "description": "EVM: {from, to, value, validAfter, validBefore, nonce, signature}: the buyer's "
            "EIP-3009 TransferWithAuthorization, values as decimal strings, nonce and signature 0x-hex. "
            "Solana: {transaction}: the base64 transaction from /intents/{id}/solana-transaction, signed by the buyer"
        },
    )


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
        metadata={"description": "The buyer's Solana address (base58): owner of the USDC account paying"},
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


SolanaTransactionEnvelope = envelope(SolanaTransactionSchema, "SolanaTransactionResponse")
