"""Request and response schemas of the intents API (responses are documented, built by services)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from marshmallow import ValidationError, fields, validate

from backend.intents.export import TIME_BOUND_PATTERN, parse_time_bound
from backend.intents.models import REFUND_ID_PATTERN, REFUND_STATUSES, STATUSES
from backend.schemas import FlatMetadata, HttpUrl, PageQuerySchema, StrictSchema, UsdcAmount, envelope, page_of, text


class CreateIntentSchema(StrictSchema):
    amount_usdc = UsdcAmount(
        required=True,
        metadata={
            "type": "number",
            "exclusiveMinimum": 0,
            "multipleOf": 0.000001,
            "maximum": 1000000,
            "description": "Amount in USDC: a JSON number > 0 with at most 6 decimals, at most MAX_AMOUNT_USDC "
            "(1000000 unless the operator set another; this document says the default)",
            "example": 10.5,
        },
    )
    redirect_url = HttpUrl(
        allow_none=True,
        metadata={"description": "Where hosted checkout sends the buyer after payment (needed for hosted checkout)"},
    )
    cancel_url = HttpUrl(allow_none=True, metadata={"description": "Where hosted checkout's cancel link goes"})
    description = fields.String(
        allow_none=True, validate=validate.Length(max=500), metadata=text(description="Label on the checkout page")
    )
    order_id = fields.String(
        allow_none=True, validate=validate.Length(min=1, max=128), metadata=text(description="Your order reference")
    )
    metadata = FlatMetadata(
        allow_none=True,
        metadata={
            "description": "Flat key-value pairs (at most 50 keys of up to 40 characters; string values up to "
            "500 characters; values may be strings, numbers, booleans or null)"
        },
    )


class ListIntentsQuerySchema(PageQuerySchema):
    status = fields.String(validate=validate.OneOf(STATUSES), metadata={"description": "Filter by status"})
    order_id = fields.String(validate=validate.Length(min=1, max=128), metadata=text(description="Filter by order"))


class TimeBound(fields.Field[datetime]):
    """An ISO 8601 date or date-time query parameter, read as a UTC datetime (``export.parse_time_bound``)."""

    def _deserialize(self, value: Any, attr: str | None, data: Any, **kwargs: Any) -> datetime:
        try:
            return parse_time_bound(value if isinstance(value, str) else "")
        except ValueError as exc:
            raise ValidationError(str(exc)) from None


def _time_bound_doc(description: str) -> dict[str, str]:
    return text(
        type="string",
        pattern=TIME_BOUND_PATTERN,
        description=f"{description}: an ISO 8601 date (2026-11-22 is its 00:00 UTC) or date-time "
        "(2026-11-22T12:00:00Z; seconds, up to 6 decimals and the offset optional, none meaning UTC)",
    )


class ExportIntentsQuerySchema(StrictSchema):
    """The list's filters (no paging: the export is every matching intent) and a creation-time range."""

    status = fields.String(validate=validate.OneOf(STATUSES), metadata={"description": "Filter by status"})
    order_id = fields.String(validate=validate.Length(min=1, max=128), metadata=text(description="Filter by order"))
    created_from = TimeBound(metadata=_time_bound_doc("Created at or after this time (inclusive)"))
    created_to = TimeBound(metadata=_time_bound_doc("Created before this time (exclusive; not before created_from)"))


class PaymentRequirementSchema(StrictSchema):
    scheme = fields.String(required=True, metadata={"enum": ["exact"]})
    network = fields.String(required=True, metadata={"description": "CAIP-2 network id, e.g. eip155:84532"})
    maxAmountRequired = fields.String(required=True, metadata={"description": "Atomic units (6 decimals)"})
    resource = fields.String(required=True)
    description = fields.String(required=True)
    mimeType = fields.String(required=True)
    payTo = fields.String(required=True, metadata={"description": "Merchant wallet to be paid"})
    maxTimeoutSeconds = fields.Integer(required=True)
    asset = fields.String(required=True, metadata={"description": "USDC contract (EVM) or mint (Solana)"})
    usdcDomainName = fields.String(metadata={"description": "EIP-712 domain name of the token (EVM only)"})
    extra = fields.Dict(
        required=True,
        metadata={"description": "EVM: {name, version} of the EIP-712 domain; Solana: {decimals, feePayer}"},
    )


class RefundSchema(StrictSchema):
    refund_id = fields.String(required=True, metadata={"pattern": f"^{REFUND_ID_PATTERN}$"})
    intent_id = fields.UUID(required=True)
    amount_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    status = fields.String(
        required=True,
        metadata={
            "enum": list(REFUND_STATUSES),
            "description": "requires_signature (sign payment_requirements[0] with pay_from, then POST .../pay), "
            "processing (sent), succeeded (executed on chain: tx_hash), failed (nothing moved; create another)",
        },
    )
    network = fields.String(required=True, metadata={"description": "CAIP-2 id: the network the intent was paid on"})
    pay_from = fields.String(
        required=True, metadata={"description": "The merchant's wallet the payment landed in: the one that signs"}
    )
    pay_to = fields.String(required=True, metadata={"description": "The buyer's address (the intent's)"})
    reason = fields.String(required=True, allow_none=True)
    tx_hash = fields.String(required=True, allow_none=True, metadata={"description": "Set once succeeded"})
    created_at = fields.String(required=True, metadata={"format": "date-time"})
    succeeded_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})
    failure_code = fields.String(required=True, allow_none=True)
    failure_reason = fields.String(required=True, allow_none=True)
    payment_requirements = fields.List(
        fields.Nested(PaymentRequirementSchema),
        metadata={
            "description": "While requires_signature: the one x402 exact requirement pay_from signs (payTo the "
            "buyer, maxAmountRequired the refund's amount)"
        },
    )


class IntentSchema(StrictSchema):
    intent_id = fields.UUID(required=True)
    status = fields.String(required=True, metadata={"enum": list(STATUSES)})
    amount_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    order_id = fields.String(required=True, allow_none=True)
    description = fields.String(required=True, allow_none=True)
    metadata = fields.Dict(required=True)
    redirect_url = fields.String(required=True, allow_none=True)
    cancel_url = fields.String(required=True, allow_none=True)
    checkout_url = fields.String(required=True)
    created_at = fields.String(required=True, metadata={"format": "date-time"})
    expires_at = fields.String(required=True, metadata={"format": "date-time"})
    payment_requirements = fields.List(fields.Nested(PaymentRequirementSchema), required=True)
    tx_hash = fields.String(required=True, allow_none=True, metadata={"description": "Set once paid"})
    buyer_address = fields.String(required=True, allow_none=True, metadata={"description": "Set once paid"})
    chain = fields.String(required=True, allow_none=True, metadata={"description": "CAIP-2 id; set once paid"})
    paid_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})
    payment_link_id = fields.String(
        required=True, allow_none=True, metadata={"description": "The payment link whose visit created the intent"}
    )
    refunded_usdc = fields.Decimal(
        required=True, metadata={"type": "number", "description": "What the intent's refunds paid back (succeeded)"}
    )
    refunds = fields.List(
        fields.Nested(RefundSchema),
        metadata={"description": "The intent's refunds, oldest first (when one intent is read)"},
    )


class CreateRefundSchema(StrictSchema):
    amount_usdc = UsdcAmount(
        metadata={
            **CreateIntentSchema().fields["amount_usdc"].metadata,
            "description": "USDC to refund: a JSON number > 0 with at most 6 decimals, at most what is left to "
            "refund on the intent (default: all of it)",
        }
    )
    reason = fields.String(validate=validate.Length(max=500), allow_none=True, metadata=text())


class ListRefundsQuerySchema(PageQuerySchema):
    intent_id = fields.String(validate=validate.Length(max=64), metadata=text(description="Only this intent's refunds"))


class CancelledIntentSchema(StrictSchema):
    intent_id = fields.UUID(required=True)
    status = fields.String(required=True, metadata={"enum": ["cancelled"]})


IntentEnvelope = envelope(IntentSchema, "IntentResponse")
IntentPageEnvelope = envelope(page_of(IntentSchema, "intents", "IntentPage"), "IntentPageResponse")
CancelledEnvelope = envelope(CancelledIntentSchema, "CancelledIntentResponse")
RefundEnvelope = envelope(RefundSchema, "RefundResponse")
RefundPageEnvelope = envelope(page_of(RefundSchema, "refunds", "RefundPage"), "RefundPageResponse")
