"""HTTP views of the webhooks API: thin wrappers over backend.webhooks.services."""

from __future__ import annotations

from typing import Any

from flask.views import MethodView
from werkzeug.routing import BaseConverter

from backend import appstate
from backend.errors import validation_error
from backend.http import ApiBlueprint, ok
from backend.merchants.auth import api_key_required, current_merchant_id
from backend.schemas import PageQuerySchema
from backend.webhooks import services
from backend.webhooks.schemas import (
    CreateWebhookSchema,
    DeletedWebhookEnvelope,
    DeliveryEnvelope,
    DeliveryPageEnvelope,
    ListDeliveriesQuerySchema,
    QueuedDeliveryEnvelope,
    TestEventSchema,
    WebhookEnvelope,
    WebhookPageEnvelope,
    WebhookWithSecretEnvelope,
)
from backend.webhooks.transport import TargetRefused, check_url_literal

WEBHOOK_ID_PATTERN = "we_[0-9a-f]{32}"  # ids.prefixed_id("we")


class WebhookIdConverter(BaseConverter):
    """A webhook endpoint's id in a path: ``/webhooks/test`` and ``/webhooks/deliveries`` are never taken for one
    (their OPTIONS answered an Allow with the endpoint's GET and DELETE, which they do not have). Registered as
    ``webhook_id`` by the app factory, and documented with its pattern."""

    regex = WEBHOOK_ID_PATTERN


blp = ApiBlueprint(
    "webhooks",
    __name__,
    url_prefix="/api/v1/webhooks",
    description="Webhook endpoints, signed deliveries, delivery logs, replay and test events",
)


def _queued(delivery_id: str) -> Any:
    data = services.delivery_to_dict(services.get_delivery_row(current_merchant_id(), delivery_id)._mapping)
    keys = ("delivery_id", "webhook_id", "event_id", "event", "status")
    return ok({k: data[k] for k in keys}, 202)


@blp.route("")
class WebhookCollection(MethodView):
    decorators = [api_key_required]

    @blp.arguments(CreateWebhookSchema())
    @blp.alt_response(201, schema=WebhookWithSecretEnvelope, success=True, description="The new endpoint")
    @blp.errors(400, 401, 409, 415)
    def post(self, args: dict[str, Any]) -> Any:
        """Register a webhook endpoint

        The response is the only place the signing secret is shown. Loopback, private and
        link-local targets are refused unless the server sets WEBHOOK_ALLOW_PRIVATE_TARGETS.
        """
        allow_private = appstate.settings().webhook_allow_private_targets
        try:
            check_url_literal(args["url"], allow_private)
        except TargetRefused as exc:
            raise validation_error({"url": [str(exc)]}) from None
        endpoint, secret = services.create_endpoint(current_merchant_id(), args["url"], args["events"])
        return ok(services.endpoint_to_dict(endpoint, secret), 201)

    @blp.arguments(PageQuerySchema(), location="query")
    @blp.alt_response(200, schema=WebhookPageEnvelope, success=True, description="A page of endpoints, newest first")
    @blp.errors(400, 401)
    def get(self, args: dict[str, Any]) -> Any:
        """List webhook endpoints (without secrets)"""
        endpoints, total = services.list_endpoints(current_merchant_id(), limit=args["limit"], offset=args["offset"])
        return ok(
            {
                "webhooks": [services.endpoint_to_dict(e) for e in endpoints],
                "total": total,
                "limit": args["limit"],
                "offset": args["offset"],
            }
        )


@blp.route("/<webhook_id:webhook_id>")
class WebhookItem(MethodView):
    decorators = [api_key_required]

    @blp.alt_response(200, schema=WebhookEnvelope, success=True, description="The endpoint (without its secret)")
    @blp.errors(401, 404)
    def get(self, webhook_id: str) -> Any:
        """Read a webhook endpoint"""
        return ok(services.endpoint_to_dict(services.get_endpoint(current_merchant_id(), webhook_id)))

    @blp.alt_response(200, schema=DeletedWebhookEnvelope, success=True, description="The endpoint is deleted")
    @blp.errors(401, 404)
    def delete(self, webhook_id: str) -> Any:
        """Delete a webhook endpoint

        Its pending deliveries are cancelled; its delivery log stays readable.
        """
        services.delete_endpoint(current_merchant_id(), webhook_id)
        return ok({"webhook_id": webhook_id, "deleted": True})


@blp.route("/<webhook_id:webhook_id>/rotate-secret")
class WebhookSecret(MethodView):
    decorators = [api_key_required]

    @blp.alt_response(200, schema=WebhookWithSecretEnvelope, success=True, description="The endpoint's new secret")
    @blp.errors(401, 404)
    def post(self, webhook_id: str) -> Any:
        """Rotate a webhook endpoint's signing secret

        The old secret stops at once: every attempt from now on, retries included, is signed with
        the new one, which this response shows once.
        """
        endpoint, secret = services.rotate_secret(current_merchant_id(), webhook_id)
        return ok(services.endpoint_to_dict(endpoint, secret))


@blp.route("/test")
class WebhookTest(MethodView):
    decorators = [api_key_required]

    @blp.arguments(TestEventSchema())
    @blp.alt_response(202, schema=QueuedDeliveryEnvelope, success=True, description="The test delivery is queued")
    @blp.errors(400, 401, 404, 409, 415)
    def post(self, args: dict[str, Any]) -> Any:
        """Send a simulated event to an endpoint

        Any of the event types, with realistic data and no on-chain transaction, signed and
        retried like a real event. Simulated event ids start with evt_test_. Read the delivery to
        see its attempts. 409 TOO_MANY_PENDING_DELIVERIES while 100 test or replayed deliveries
        to the endpoint are still pending.
        """
        delivery_id, _ = services.send_test_event(current_merchant_id(), args["webhook_id"], args["event"])
        return _queued(delivery_id)


@blp.route("/deliveries")
class DeliveryCollection(MethodView):
    decorators = [api_key_required]

    @blp.arguments(ListDeliveriesQuerySchema(), location="query")
    @blp.alt_response(200, schema=DeliveryPageEnvelope, success=True, description="A page of deliveries, newest first")
    @blp.errors(400, 401)
    def get(self, args: dict[str, Any]) -> Any:
        """List webhook deliveries (filter by endpoint, event or status)"""
        deliveries, total = services.list_deliveries(
            current_merchant_id(),
            webhook_id=args.get("webhook_id"),
            event_id=args.get("event_id"),
            status=args.get("status"),
            limit=args["limit"],
            offset=args["offset"],
        )
        return ok({"deliveries": deliveries, "total": total, "limit": args["limit"], "offset": args["offset"]})


@blp.route("/deliveries/<string:delivery_id>")
class DeliveryItem(MethodView):
    decorators = [api_key_required]

    @blp.alt_response(200, schema=DeliveryEnvelope, success=True, description="The delivery and its attempts")
    @blp.errors(401, 404)
    def get(self, delivery_id: str) -> Any:
        """Read a webhook delivery with its attempts"""
        return ok(services.get_delivery(current_merchant_id(), delivery_id))


@blp.route("/deliveries/<string:delivery_id>/replay")
class DeliveryReplay(MethodView):
    decorators = [api_key_required]

    @blp.alt_response(202, schema=QueuedDeliveryEnvelope, success=True, description="The replay is queued")
    @blp.errors(401, 404, 409)
    def post(self, delivery_id: str) -> Any:
        """Replay a delivery

        Sends the same event (same id, same bytes) to the same endpoint again, as a new delivery
        with its own five attempts. Any delivery can be replayed while its endpoint exists
        (409 WEBHOOK_DELETED otherwise), and while fewer than 100 test or replayed deliveries to
        it are pending (409 TOO_MANY_PENDING_DELIVERIES otherwise).
        """
        new_id = services.replay_delivery(current_merchant_id(), delivery_id)
        return _queued(new_id)
