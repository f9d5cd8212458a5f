"""HTTP views of the intents API: thin wrappers over backend.intents.services."""

from __future__ import annotations

from typing import Any

from flask import request
from flask.views import MethodView
from sqlalchemy.exc import IntegrityError

from backend import appstate, clock
from backend.config import Settings
from backend.errors import not_found
from backend.extensions import db, release_autocommit_connection
from backend.http import ApiBlueprint, ok, raw_json_response
from backend.idempotency import services as idempotency
from backend.intents import services
from backend.intents.schemas import (
    CancelledEnvelope,
    CreateIntentSchema,
    IntentEnvelope,
    IntentPageEnvelope,
    ListIntentsQuerySchema,
)
from backend.jsonio import dumps
from backend.merchants.auth import api_key_reading, api_key_required, authenticated, current_merchant_id, read_with_key

blp = ApiBlueprint(
    "intents", __name__, url_prefix="/api/v1/x402/intents", description="Create, read, list and cancel intents"
)
_IDEMPOTENCY_HEADER = {
    "Idempotency-Key": {
        "description": "Optional. A retry with the same key and body returns the first response "
        "(with header Idempotent-Replayed: true); the same key with another body is 422. Kept 24 hours.",
        # Printable ASCII, no space at either end (one sent is dropped, as HTTP does).
        "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~](?:[ -~]*[!-~])?$"},
    }
}


def _settings() -> Settings:
    return appstate.settings()


def _replay(stored: tuple[int, str]) -> Any:
    status, body = stored
    return raw_json_response(body, status, {"Idempotent-Replayed": "true"})


@blp.route("")
class IntentCollection(MethodView):
    # Authentication comes first (a request without a valid key is 401 whatever its body): the outermost decorator.
    @api_key_reading(services.key_and_wallets)
    @blp.arguments(CreateIntentSchema())
    @blp.alt_response(201, schema=IntentEnvelope, success=True, description="The new pending intent")
    @blp.errors(400, 401, 409, 415, 422)
    @blp.doc(parameters=[{"in": "header", "name": k, **v} for k, v in _IDEMPOTENCY_HEADER.items()])
    def post(self, args: dict[str, Any]) -> Any:
        """Create a payment intent

        Returns one payment requirement per network on which the merchant has a wallet.
        """
        merchant_id = current_merchant_id()
        key = idempotency.validate_key(request.headers.get(idempotency.HEADER))
        request_hash = ""
        if key is not None:
            release_autocommit_connection()  # the session's transaction takes one: one connection at a time
            request_hash = idempotency.fingerprint("intents.create", args)
            stored = idempotency.find_response(merchant_id, "intents.create", key, request_hash)
            if stored is not None:
                return _replay(stored)
        params = services.NewIntent(**{k: v for k, v in args.items() if v is not None})
        host = _settings().checkout_host
        row = services.new_intent(merchant_id, params, appstate.chains(), host, wallets=read_with_key())
        body = dumps({"success": True, "data": services.intent_to_dict(row, host, row["created_at"])})
        if key is None:
            # The intent is the only row written: an INSERT that commits by itself, once the answer is built (a
            # failure after it would answer 500 for an intent that exists, and a retry would make a second one).
            services.insert_intent(row, commit=None)
            return raw_json_response(body, 201)
        services.insert_intent(row, commit=False)
        idempotency.remember_response(merchant_id, "intents.create", key, request_hash, 201, body)
        try:
            db.session.commit()
        except IntegrityError:
            # A concurrent request with the same key committed first: answer with its response.
            db.session.rollback()
            stored = idempotency.find_response(merchant_id, "intents.create", key, request_hash)
            if stored is None:
                raise
            return _replay(stored)
        return raw_json_response(body, 201)

    @api_key_required
    @blp.arguments(ListIntentsQuerySchema(), location="query")
    @blp.alt_response(200, schema=IntentPageEnvelope, success=True, description="A page of intents, newest first")
    @blp.errors(400, 401)
    def get(self, args: dict[str, Any]) -> Any:
        """List this merchant's intents"""
        intents, total = services.list_intents(
            current_merchant_id(),
            status=args.get("status"),
            order_id=args.get("order_id"),
            limit=args["limit"],
            offset=args["offset"],
        )
        host = _settings().checkout_host
        now = clock.now()
        return ok(
            {
                "intents": [services.intent_to_dict(i, host, now) for i in intents],
                "total": total,
                "limit": args["limit"],
                "offset": args["offset"],
            }
        )


@blp.route("/<string:intent_id>")
class IntentItem(MethodView):
    @blp.alt_response(200, schema=IntentEnvelope, success=True, description="The intent")
    @blp.errors(401, 404)
    def get(self, intent_id: str) -> Any:
        """Read an intent"""
        # The key and the intent in one statement (the hot read: no transaction, one round trip).
        intent = authenticated(lambda secret: services.key_and_intent(secret, intent_id))
        if intent is None:
            raise not_found("Intent")
        return ok(services.intent_to_dict(intent, _settings().checkout_host))

    @api_key_required
    @blp.alt_response(200, schema=CancelledEnvelope, success=True, description="The intent is cancelled")
    @blp.errors(401, 404)
    def delete(self, intent_id: str) -> Any:
        """Cancel a pending intent

        Paid, expired and already cancelled intents answer 404 (INTENT_NOT_CANCELLABLE).
        """
        cancelled_id = services.cancel_intent(current_merchant_id(), intent_id)
        return ok({"intent_id": cancelled_id, "status": "cancelled"})
