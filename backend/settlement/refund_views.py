"""The refunds API: create a refund of a paid intent, read and list refunds, and pay one with the merchant's signed
authorization. Thin views over ``intents.refunds`` (the records) and ``settlement.refunds`` (the payment)."""

from __future__ import annotations

from typing import Any

from flask.views import MethodView
from werkzeug.routing import BaseConverter

from backend import appstate
from backend.http import ApiBlueprint, ok
from backend.intents import refunds as records
from backend.intents.models import REFUND_ID_PATTERN
from backend.intents.schemas import CreateRefundSchema, ListRefundsQuerySchema, RefundEnvelope, RefundPageEnvelope
from backend.merchants.auth import api_key_required, current_merchant_id
from backend.settlement import refunds
from backend.settlement.api import pay_refund
from backend.settlement.schemas import RefundPaySchema, SolanaTransactionEnvelope


class RefundIdConverter(BaseConverter):
    """A refund's id in a path (registered as ``refund_id`` by the app factory, documented with its pattern)."""

    regex = REFUND_ID_PATTERN


blp = ApiBlueprint(
    "refunds", __name__, url_prefix="/api/v1", description="Refunds: the merchant's wallet pays a buyer back"
)


def _base_url() -> str:
    return appstate.settings().checkout_host


@blp.route("/x402/intents/<intent_id:intent_id>/refunds")
class IntentRefunds(MethodView):
    @api_key_required
    @blp.arguments(CreateRefundSchema())
    @blp.alt_response(201, schema=RefundEnvelope, success=True, description="The refund, to be signed")
    @blp.errors(400, 401, 404, 409, 415)
    def post(self, args: dict[str, Any], intent_id: str) -> Any:
        """Refund a paid intent

        Creates a refund of `amount_usdc` (default: all that is left to refund) in `requires_signature`, with one
        x402 `exact` requirement: the network the intent was paid on, `payTo` the buyer, `maxAmountRequired` the
        amount. The merchant's payout wallet the payment landed in (`pay_from`) signs it (EVM: an EIP-3009
        authorization; Solana: the transaction from POST /api/v1/refunds/{refund_id}/solana-transaction) and sends
        it to POST /api/v1/refunds/{refund_id}/pay. The service never holds the USDC.

        Errors: INTENT_NOT_REFUNDABLE (409: not paid), REFUND_EXCEEDS_PAYMENT (409: over what is left; the
        intent's refunds that succeeded, are sending, or failed but may still execute count).
        """
        refund = refunds.create_refund(
            current_merchant_id(), intent_id, args.get("amount_usdc"), args.get("reason"), _base_url()
        )
        return ok(records.refund_to_dict(refund), 201)

    @api_key_required
    @blp.alt_response(200, schema=RefundPageEnvelope, success=True, description="The intent's refunds")
    @blp.errors(401, 404)
    def get(self, intent_id: str) -> Any:
        """List an intent's refunds, newest first (at most 100; GET /api/v1/refunds?intent_id= pages)"""
        merchant_id = current_merchant_id()
        records.merchant_intent(merchant_id, intent_id)  # another merchant's intent is 404, not an empty list
        found, total = records.list_refunds(merchant_id, intent_id=intent_id, limit=100)
        return ok({"refunds": [records.refund_to_dict(r) for r in found], "total": total, "limit": 100, "offset": 0})


@blp.route("/refunds")
class RefundCollection(MethodView):
    @api_key_required
    @blp.arguments(ListRefundsQuerySchema(), location="query")
    @blp.alt_response(200, schema=RefundPageEnvelope, success=True, description="A page of refunds, newest first")
    @blp.errors(400, 401)
    def get(self, args: dict[str, Any]) -> Any:
        """List this merchant's refunds"""
        found, total = records.list_refunds(
            current_merchant_id(), intent_id=args.get("intent_id"), limit=args["limit"], offset=args["offset"]
        )
        page = {"refunds": [records.refund_to_dict(r) for r in found], "total": total}
        return ok({**page, "limit": args["limit"], "offset": args["offset"]})


@blp.route("/refunds/<refund_id:refund_id>")
class RefundItem(MethodView):
    @api_key_required
    @blp.alt_response(200, schema=RefundEnvelope, success=True, description="The refund")
    @blp.errors(401, 404)
    def get(self, refund_id: str) -> Any:
        """Read a refund"""
        return ok(records.refund_to_dict(records.get_refund(current_merchant_id(), refund_id)))


@blp.route("/refunds/<refund_id:refund_id>/pay")
class RefundPay(MethodView):
    @api_key_required
    @blp.arguments(RefundPaySchema())
    @blp.alt_response(200, schema=RefundEnvelope, success=True, description="Succeeded: executed on chain")
    @blp.alt_response(202, schema=RefundEnvelope, success=True, description="Sent, still settling (processing)")
    @blp.errors(400, 401, 402, 404, 409, 415, 429, 503)
    def post(self, args: dict[str, Any], refund_id: str) -> Any:
        """Pay a refund with the payout wallet's signed authorization

        `payment_signature` in any form /pay accepts, answering the refund's requirement: from `pay_from` (else
        REFUND_SIGNER_MISMATCH, 400), to the buyer, for exactly the amount. The relay submits it and the answer
        waits for the chain (PAY_WAIT_SECONDS): 200 with `tx_hash` once it executed (`refund.issued` is sent), 202
        while it is still settling (read the refund). A refund is paid once: REFUND_NOT_PAYABLE (409) after that,
        whatever is sent. Also /pay's errors (INVALID_SIGNATURE, AMOUNT_MISMATCH, NONCE_ALREADY_USED, ...),
        REFUND_EXCEEDS_PAYMENT (409: other refunds took what was left first) and SETTLEMENT_FAILED (402: it could
        not execute, nothing moved; create another refund).
        """
        refund, finished = pay_refund(current_merchant_id(), refund_id, args["payment_signature"])
        return ok(records.refund_to_dict(refund), 200 if finished else 202)


@blp.route("/refunds/<refund_id:refund_id>/solana-transaction")
class RefundSolanaTransaction(MethodView):
    @api_key_required
    @blp.alt_response(200, schema=SolanaTransactionEnvelope, success=True, description="The transaction to sign")
    @blp.errors(400, 401, 402, 404, 409, 429, 503)
    def post(self, refund_id: str) -> Any:
        """Build the Solana transaction the payout wallet signs to pay a refund

        As for a payment (POST /api/v1/x402/intents/{intent_id}/solana-transaction), with `pay_from` as the payer,
        the buyer as the recipient and the refund id as the memo. Sign it (signer 2) and send it to
        POST /api/v1/refunds/{refund_id}/pay as payment_signature.payload.transaction.
        """
        return ok(refunds.prepare_refund_transaction(current_merchant_id(), refund_id, appstate.settings()))
