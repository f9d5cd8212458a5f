"""``GET /api/v1/wallets``: the merchant's payout wallets, each with whether it proved it is the merchant's."""

from __future__ import annotations

from typing import Any

from flask.views import MethodView
from marshmallow import fields

from backend import clock
from backend.http import ApiBlueprint, ok
from backend.merchants import services
from backend.merchants.auth import api_key_required, current_merchant_id
from backend.schemas import StrictSchema, envelope

blp = ApiBlueprint("wallets", __name__, url_prefix="/api/v1/wallets", description="The merchant's payout wallets")


class WalletSchema(StrictSchema):
    network = fields.String(required=True, metadata={"description": "CAIP-2 id"})
    address = fields.String(required=True)
    verified = fields.Boolean(
        required=True,
        metadata={
            "description": "The wallet signed the service's message naming the merchant and the network (the "
            "dashboard's Connect); false: an address pasted (dashboard, CLI), unverified"
        },
    )
    verified_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})
    updated_at = fields.String(required=True, metadata={"format": "date-time"})


class WalletListSchema(StrictSchema):
    wallets = fields.List(fields.Nested(WalletSchema), required=True)


WalletListEnvelope = envelope(WalletListSchema, "WalletListResponse")


@blp.route("")
class Wallets(MethodView):
    @api_key_required
    @blp.alt_response(200, schema=WalletListEnvelope, success=True, description="One wallet per network, by network")
    @blp.errors(401)
    def get(self) -> Any:
        """List this merchant's payout wallets

        Registered in the dashboard (connected and proven, or pasted) or with `payintent wallet set`.
        """
        wallets = [
            {"network": w.network, "address": w.address, "verified": w.verified_at is not None,
             "verified_at": clock.isoformat(w.verified_at), "updated_at": clock.isoformat(w.updated_at)}
            for w in services.list_wallets(current_merchant_id())
        ]  # fmt: skip
        return ok({"wallets": wallets})
