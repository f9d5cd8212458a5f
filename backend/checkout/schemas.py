"""Schemas of the public checkout API."""

from __future__ import annotations

from marshmallow import fields

from backend.intents.schemas import PaymentRequirementSchema
from backend.schemas import StrictSchema, envelope
from backend.settlement.schemas import PaymentSignatureSchema


class CheckoutIntentSchema(StrictSchema):
    intent_id = fields.UUID(required=True)
    status = fields.String(required=True, metadata={"enum": ["pending", "paid", "expired", "cancelled"]})
    merchant_name = fields.String(required=True, allow_none=True)
    description = fields.String(required=True, allow_none=True)
    amount_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    expires_at = fields.String(required=True, metadata={"format": "date-time"})
    redirect_url = fields.String(required=True, allow_none=True)
    cancel_url = fields.String(required=True, allow_none=True)
    payment_requirements = fields.List(fields.Nested(PaymentRequirementSchema), required=True)
    tx_hash = fields.String(required=True, allow_none=True)
    chain = fields.String(required=True, allow_none=True)
    paid_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})


class CheckoutPaySchema(StrictSchema):
    payment_signature = fields.Nested(PaymentSignatureSchema, required=True)


CheckoutIntentEnvelope = envelope(CheckoutIntentSchema, "CheckoutIntentResponse")
