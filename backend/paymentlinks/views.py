"""HTTP views of the payment links API (``/api/v1/payment_links``): thin wrappers over the services."""

from __future__ import annotations

from typing import Any

from flask.views import MethodView
from werkzeug.routing import BaseConverter

from backend import appstate
from backend.http import ApiBlueprint, ok
from backend.merchants.auth import api_key_required, current_merchant_id
from backend.paymentlinks import services
from backend.paymentlinks.schemas import CreateLinkSchema, LinkEnvelope, LinkPageEnvelope, ListLinksQuerySchema


class LinkIdConverter(BaseConverter):
    """A payment link's id in a path (registered as ``link_id`` by the app factory, documented with its pattern):
    anything else is no route at all."""

    regex = services.LINK_ID_PATTERN


blp = ApiBlueprint(
    "payment_links",
    __name__,
    url_prefix="/api/v1/payment_links",
    description="Payment links: a price at a shareable URL; each visit makes an intent",
)


def _host() -> str:
    return appstate.settings().checkout_host


@blp.route("")
class LinkCollection(MethodView):
    @api_key_required
    @blp.arguments(CreateLinkSchema())
    @blp.alt_response(201, schema=LinkEnvelope, success=True, description="The new, active link")
    @blp.errors(400, 401, 415)
    def post(self, args: dict[str, Any]) -> Any:
        """Create a payment link

        Each visit of its `url` creates a fresh pending intent for `amount_usdc` (with `payment_link_id` set) and
        redirects (303) to that intent's checkout.
        """
        link = services.create_link(current_merchant_id(), services.NewLink(**args))
        return ok(services.link_to_dict(link, _host()), 201)

    @api_key_required
    @blp.arguments(ListLinksQuerySchema(), location="query")
    @blp.alt_response(200, schema=LinkPageEnvelope, success=True, description="A page of links, newest first")
    @blp.errors(400, 401)
    def get(self, args: dict[str, Any]) -> Any:
        """List this merchant's payment links"""
        active = None if "active" not in args else args["active"] == "true"
        links, total = services.list_links(
            current_merchant_id(), active=active, limit=args["limit"], offset=args["offset"]
        )
        host = _host()
        return ok(
            {
                "payment_links": [services.link_to_dict(link, host) for link in links],
                "total": total,
                "limit": args["limit"],
                "offset": args["offset"],
            }
        )


@blp.route("/<link_id:link_id>")
class LinkItem(MethodView):
    @api_key_required
    @blp.alt_response(200, schema=LinkEnvelope, success=True, description="The link")
    @blp.errors(401, 404)
    def get(self, link_id: str) -> Any:
        """Read a payment link"""
        return ok(services.link_to_dict(services.get_link(current_merchant_id(), link_id), _host()))


@blp.route("/<link_id:link_id>/deactivate")
class LinkDeactivation(MethodView):
    @api_key_required
    @blp.alt_response(200, schema=LinkEnvelope, success=True, description="The link, now inactive")
    @blp.errors(401, 404)
    def post(self, link_id: str) -> Any:
        """Deactivate a payment link

        Its URL then answers 410 with a page saying so and makes no intent; intents it made stay payable until they
        expire. Deactivating an inactive link answers the same.
        """
        return ok(services.link_to_dict(services.deactivate_link(current_merchant_id(), link_id), _host()))
