"""HTTP views of the intents API: thin wrappers over backend.intents.services."""

from __future__ import annotations

from typing import Any

from flask import request
from flask.views import MethodView
from sqlalchemy.exc import IntegrityError
from werkzeug.routing import BaseConverter

from backend import appstate, clock
from backend.config import Settings
from backend.errors import not_found
from backend.extensions import db, release_autocommit_connection
from backend.http import ApiBlueprint, ok, raw_json_response
from backend.idempotency import services as idempotency
from backend.intents import export, refunds, services
from backend.intents.schemas import (
    CancelledEnvelope,
    CreateIntentSchema,
    ExportIntentsQuerySchema,
    IntentEnvelope,
    IntentPageEnvelope,
    ListIntentsQuerySchema,
)
from backend.jsonio import dumps
from backend.merchants.auth import api_key_reading, api_key_required, authenticated, current_merchant_id, read_with_key

blp = ApiBlueprint(
    "intents", __name__, url_prefix="/api/v1/x402/intents", description="Create, read, list and cancel intents"
)


class IntentIdConverter(BaseConverter):
    """An intent's id in a path: any segment (a malformed id is the intent's 404), but ``export.csv``, so that the
    export's path is never taken for an intent's (its OPTIONS answered an Allow with the item's DELETE, and a DELETE
    reached the cancel). Documented as the string converter was: OpenAPI matches a concrete path (the export's)
    before a templated one."""

    regex = r"(?!export\.csv\Z)[^/]+"  # registered as ``intent_id`` by the app factory


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


_CSV_DOC: dict[str, Any] = {
    "type": "string",
    "description": "CSV (RFC 4180, UTF-8, CRLF line ends): a header row, then one row per intent, newest first",
}
_CSV_EXAMPLE = (
    ",".join(export.HEADER) + "\r\n"
    "0b7c3f9e-5d2a-4e8b-9c1f-2a6d4e8b0c3f,paid,10.5,eip155:84532,0x5e1f…,0x1111…,2026-11-22T12:00:00.000Z,"
    '2026-11-22T12:01:30.000Z,2026-11-22T12:30:00.000Z,order-1001,Two mugs,,"{""customer"":""c_42""}",0\r\n'
)
_ATTACHMENT_HEADER = {
    "Content-Disposition": {
        "description": "The file name: intents-<UTC date>.csv",
        "schema": {"type": "string", "pattern": '^attachment; filename="intents-[0-9]{4}-[0-9]{2}-[0-9]{2}\\.csv"$'},
    }
}


@blp.route("/export.csv")
class IntentExport(MethodView):
    @api_key_required
    @blp.arguments(ExportIntentsQuerySchema(), location="query")
    @blp.alt_response(
        200, schema=_CSV_DOC, content_type=export.CSV, example=_CSV_EXAMPLE, headers=_ATTACHMENT_HEADER, success=True,
        description="The matching intents as a CSV file, streamed",
    )  # fmt: skip
    @blp.errors(400, 401)
    def get(self, args: dict[str, Any]) -> Any:
        """Export this merchant's intents as CSV

        The list's filters (status, order_id) and a creation-time range: created_from (inclusive) to created_to
        (exclusive), each an ISO 8601 date (its 00:00 UTC) or date-time; created_from after created_to is
        VALIDATION_ERROR (400). Columns: intent_id, status, amount_usdc (a decimal string), chain, tx_hash,
        buyer_address, created_at, paid_at, expires_at, order_id, description, payment_link_id, metadata (compact
        JSON), refunded_usdc (what its refunds paid back, a decimal string). A text cell that starts with = + - @, a
        tab or a carriage return gets a leading ' (a spreadsheet would read it as a formula).
        """
        now = clock.now()
        chunks = export.export_csv(current_merchant_id(), export.ExportFilters(**args), now)
        return export.download(chunks, now)


@blp.route("/<intent_id:intent_id>")
class IntentItem(MethodView):
    @blp.alt_response(200, schema=IntentEnvelope, success=True, description="The intent")
    @blp.errors(401, 404)
    def get(self, intent_id: str) -> Any:
        """Read an intent"""
        # The key and the intent in one statement (the hot read: no transaction, one round trip).
        intent = authenticated(lambda secret: services.key_and_intent(secret, intent_id))
        if intent is None:
            raise not_found("Intent")
        answer = services.intent_to_dict(intent, _settings().checkout_host)
        if intent["status"] == "paid":  # only a paid intent has refunds
            answer["refunds"] = [refunds.refund_to_dict(refund) for refund in refunds.refunds_of(intent["id"])]
        return ok(answer)

    @api_key_required
    @blp.alt_response(200, schema=CancelledEnvelope, success=True, description="The intent is cancelled")
    @blp.errors(401, 404)
    def delete(self, intent_id: str) -> Any:
        """Cancel a pending intent

        Paid, expired and already cancelled intents answer 404 (INTENT_NOT_CANCELLABLE).
        """
        cancelled_id = services.cancel_intent(current_merchant_id(), intent_id)
        return ok({"intent_id": cancelled_id, "status": "cancelled"})
