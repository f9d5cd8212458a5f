"""The public checkout API (no merchant key): read one intent, get the Solana transaction, pay.

The intent id (a random UUID4) is the capability; every route is rate-limited per client IP and
shows only what a buyer needs. Payments go through the same settlement code as /api/v1/x402/pay.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from flask.views import MethodView

from backend.checkout import services
from backend.checkout.schemas import BalanceEnvelope, BalanceQuerySchema, CheckoutIntentEnvelope, CheckoutPaySchema
from backend.http import ApiBlueprint, ok
from backend.settlement.api import pay_intent, solana_transaction
from backend.settlement.flow import load_payable_intent
from backend.settlement.schemas import PayEnvelope, SolanaTransactionEnvelope, SolanaTransactionRequestSchema

blp = ApiBlueprint(
    "checkout", __name__, url_prefix="/api/v1/checkout", description="Public checkout API for one intent (no key)"
)


def writes(view: Callable[..., Any]) -> Callable[..., Any]:
    """Counted against the client's write limit before the body is read: a bad body is a request too."""

    @wraps(view)
    def limited(*args: Any, **kwargs: Any) -> Any:
        services.limit("write")
        return view(*args, **kwargs)

    return limited


@blp.route("/intents/<string:intent_id>")
class CheckoutIntent(MethodView):
    @blp.alt_response(200, schema=CheckoutIntentEnvelope, success=True, description="The buyer's view of the intent")
    @blp.errors(404, 429)
    @blp.doc(security=[])
    def get(self, intent_id: str) -> Any:
        """Read an intent as its buyer sees it (no metadata, no keys)"""
        services.limit("read")
        return ok(services.public_view(load_payable_intent(None, intent_id)))


@blp.route("/intents/<string:intent_id>/balance")
class CheckoutBalance(MethodView):
    @blp.arguments(BalanceQuerySchema(), location="query")
    @blp.alt_response(200, schema=BalanceEnvelope, success=True, description="The buyer's USDC balance")
    @blp.errors(400, 404, 429, 503)
    @blp.doc(security=[])
    def get(self, args: dict[str, Any], intent_id: str) -> Any:
        """The buyer's USDC balance on one of the intent's networks, read from the chain"""
        services.limit("read")
        intent = load_payable_intent(None, intent_id)
        return ok(services.buyer_balance(intent, args["network"], args["address"]))


@blp.route("/intents/<string:intent_id>/solana-transaction")
class CheckoutSolanaTransaction(MethodView):
    decorators = [writes]

    @blp.arguments(SolanaTransactionRequestSchema())
    @blp.alt_response(200, schema=SolanaTransactionEnvelope, success=True, description="The transaction to sign")
    @blp.errors(400, 402, 404, 409, 410, 415, 429, 503)
    @blp.doc(security=[])
    def post(self, args: dict[str, Any], intent_id: str) -> Any:
        """Build the Solana transaction the buyer signs (as /api/v1/x402/intents/{id}/solana-transaction)"""
        return ok(solana_transaction(load_payable_intent(None, intent_id), args))


@blp.route("/intents/<string:intent_id>/pay")
class CheckoutPay(MethodView):
    decorators = [writes]

    @blp.arguments(CheckoutPaySchema())
    @blp.alt_response(200, schema=PayEnvelope, success=True, description="Settled on chain")
    @blp.errors(400, 402, 404, 409, 410, 415, 429, 503, 504)
    @blp.doc(security=[])
    def post(self, args: dict[str, Any], intent_id: str) -> Any:
        """Pay the intent with the buyer's signed payload (same rules and errors as /api/v1/x402/pay)"""
        load_payable_intent(None, intent_id)
        return ok(pay_intent(None, intent_id, args["payment_signature"]))
