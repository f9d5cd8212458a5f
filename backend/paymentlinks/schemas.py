"""Request and response schemas of the payment links API."""

from __future__ import annotations

from marshmallow import fields, validate

from backend.intents.schemas import CreateIntentSchema
from backend.schemas import HttpUrl, PageQuerySchema, StrictSchema, envelope, page_of, text

# At least one character that is not a space, and no NUL (as every request string).
NOT_BLANK = "^[^\\x00]*[^\\x00\\s][^\\x00]*$"


class CreateLinkSchema(StrictSchema):
    # The same amount rules as an intent's (each visit makes one for this amount).
    amount_usdc = CreateIntentSchema().fields["amount_usdc"]
    description = fields.String(
        required=True,
        validate=[validate.Length(min=1, max=500), validate.Regexp(NOT_BLANK, error="must not be blank")],
        metadata=text(
            pattern=NOT_BLANK, description="What the buyer pays for: the label of each intent the link makes"
        ),
    )
    redirect_url = HttpUrl(
        allow_none=True, metadata={"description": "Where the checkout sends the buyer after paying (optional)"}
    )


class ListLinksQuerySchema(PageQuerySchema):
    active = fields.String(
        validate=validate.OneOf(["true", "false"]),
        metadata={"description": "Only active (true) or deactivated (false) links", "enum": ["true", "false"]},
    )


class LinkSchema(StrictSchema):
    link_id = fields.String(required=True, metadata={"pattern": "^pl_[0-9a-f]{32}$"})
    url = fields.String(required=True, metadata={"description": "Share this: each visit makes an intent"})
    amount_usdc = fields.Decimal(required=True, metadata={"type": "number"})
    description = fields.String(required=True)
    redirect_url = fields.String(required=True, allow_none=True)
    active = fields.Boolean(required=True)
    created_at = fields.String(required=True, metadata={"format": "date-time"})
    deactivated_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})


LinkEnvelope = envelope(LinkSchema, "PaymentLinkResponse")
LinkPageEnvelope = envelope(page_of(LinkSchema, "payment_links", "PaymentLinkPage"), "PaymentLinkPageResponse")
