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
            "EIP-3009 TransferWithAuthorization, values as decimal strings, nonce and signature 0x-hex"
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
