"""Request and response schemas of the webhooks API."""

from __future__ import annotations

from marshmallow import fields, validate

from backend.events.services import EVENT_TYPES
from backend.schemas import HttpUrl, PageQuerySchema, StrictSchema, envelope, http_url_pattern, page_of, text
from backend.webhooks.models import DELIVERY_STATUSES

_EVENT_TYPE = fields.String(
    validate=validate.OneOf(EVENT_TYPES, error="must be one of: {choices}"), metadata={"enum": list(EVENT_TYPES)}
)


class CreateWebhookSchema(StrictSchema):
    url = HttpUrl(
        required=True,
        metadata={
            "description": "Receiver address (http or https, no credentials; unless the server allows private "
            "targets, no loopback or private address)",
            "pattern": http_url_pattern(userinfo=False),
        },
    )
    events = fields.List(
        _EVENT_TYPE,
        required=True,
        validate=validate.Length(min=1, max=len(EVENT_TYPES)),
        metadata={
            "description": "Event types to receive (at least one). payment.completed also brings payment.duplicate "
            "(a buyer charged twice: refund needed)"
        },
    )


class TestEventSchema(StrictSchema):
    webhook_id = fields.String(required=True, validate=validate.Length(min=1, max=64), metadata=text())
    event = fields.String(
        required=True,
        validate=validate.OneOf(EVENT_TYPES, error="must be one of: {choices}"),
        metadata={"enum": list(EVENT_TYPES), "description": "Event type to simulate"},
    )


class ListDeliveriesQuerySchema(PageQuerySchema):
    webhook_id = fields.String(validate=validate.Length(min=1, max=64), metadata=text(description="One endpoint's"))
    event_id = fields.String(validate=validate.Length(min=1, max=64), metadata=text(description="One event's"))
    status = fields.String(validate=validate.OneOf(DELIVERY_STATUSES), metadata={"description": "Filter by status"})


class WebhookSchema(StrictSchema):
    webhook_id = fields.String(required=True)
    url = fields.String(required=True)
    events = fields.List(fields.String(metadata={"enum": list(EVENT_TYPES)}), required=True)
    created_at = fields.String(required=True, metadata={"format": "date-time"})


class WebhookWithSecretSchema(WebhookSchema):
    secret = fields.String(
        required=True, metadata={"description": "Signing secret (whsec_...); shown only in this response"}
    )


class DeletedWebhookSchema(StrictSchema):
    webhook_id = fields.String(required=True)
    deleted = fields.Boolean(required=True, metadata={"enum": [True]})


class DeliverySchema(StrictSchema):
    delivery_id = fields.String(required=True)
    webhook_id = fields.String(required=True)
    event_id = fields.String(required=True, metadata={"description": "The envelope id: the same on every attempt"})
    event = fields.String(required=True, metadata={"enum": list(EVENT_TYPES)})
    status = fields.String(required=True, metadata={"enum": list(DELIVERY_STATUSES)})
    attempt_count = fields.Integer(required=True)
    next_attempt_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})
    last_status_code = fields.Integer(required=True, allow_none=True)
    last_error = fields.String(required=True, allow_none=True)
    replay_of = fields.String(required=True, allow_none=True, metadata={"description": "Delivery this one replays"})
    created_at = fields.String(required=True, metadata={"format": "date-time"})
    finished_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})


class AttemptSchema(StrictSchema):
    number = fields.Integer(required=True, metadata={"description": "1 to 5"})
    attempted_at = fields.String(required=True, metadata={"format": "date-time"})
    succeeded = fields.Boolean(required=True)
    status_code = fields.Integer(required=True, allow_none=True)
    latency_ms = fields.Integer(required=True)
    error = fields.String(required=True, allow_none=True)
    response_body = fields.String(required=True, allow_none=True, metadata={"description": "First KB of the answer"})


class DeliveryDetailSchema(DeliverySchema):
    payload = fields.Dict(required=True, allow_none=True, metadata={"description": "The envelope sent (signed bytes)"})
    attempts = fields.List(fields.Nested(AttemptSchema), required=True)


class QueuedDeliverySchema(StrictSchema):
    delivery_id = fields.String(required=True)
    webhook_id = fields.String(required=True)
    event_id = fields.String(required=True)
    event = fields.String(required=True, metadata={"enum": list(EVENT_TYPES)})
    status = fields.String(required=True, metadata={"enum": ["pending"]})


WebhookEnvelope = envelope(WebhookSchema, "WebhookResponse")
WebhookWithSecretEnvelope = envelope(WebhookWithSecretSchema, "WebhookWithSecretResponse")
WebhookPageEnvelope = envelope(page_of(WebhookSchema, "webhooks", "WebhookPage"), "WebhookPageResponse")
DeletedWebhookEnvelope = envelope(DeletedWebhookSchema, "DeletedWebhookResponse")
DeliveryEnvelope = envelope(DeliveryDetailSchema, "WebhookDeliveryResponse")
DeliveryPageEnvelope = envelope(
    page_of(DeliverySchema, "deliveries", "WebhookDeliveryPage"), "WebhookDeliveryPageResponse"
)
QueuedDeliveryEnvelope = envelope(QueuedDeliverySchema, "QueuedWebhookDeliveryResponse")
