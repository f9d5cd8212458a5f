"""``POST /api/v1/x402/pay``: a thin view over backend.settlement.flow.submit_payment."""

from __future__ import annotations

from typing import Any

from flask.views import MethodView

from backend import appstate
from backend.errors import APIError
from backend.http import ApiBlueprint, ok
from backend.merchants.auth import api_key_required, current_merchant_id
from backend.queueing import app_redis
from backend.settlement import solana
from backend.settlement.flow import load_payable_intent, submit_payment
from backend.settlement.schemas import (
    PayEnvelope,
    PaySchema,
    SolanaTransactionEnvelope,
    SolanaTransactionRequestSchema,
)

blp = ApiBlueprint("payments", __name__, url_prefix="/api/v1/x402", description="Settle a signed authorization")


def api_redis() -> Any:
    redis = app_redis()
    if redis is None:
        raise APIError(503, "SETTLEMENT_UNAVAILABLE", "Settlement is not configured on this server (REDIS_URL)")
    return redis


def pay_intent(merchant_id: str | None, intent_id: str, signature: dict[str, Any]) -> dict[str, Any]:
    """A parsed payment_signature through settlement (the keyed /pay and the public checkout share it).

    Any form x402 clients send is accepted; ``settlement.x402`` reads it, inside the flow.
    """
    settings = appstate.settings()
    return submit_payment(
        merchant_id,
        intent_id,
        signature,
        appstate.chains(),
        api_redis(),
        wait_seconds=settings.pay_wait_seconds,
        queue_name=settings.relayer_queue,
        settings=settings,
    )


def solana_transaction(intent: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The unsigned Solana transaction for a parsed request (keyed and public endpoints share it)."""
    settings = appstate.settings()
    registry = appstate.chains()
    return solana.prepare_transaction(intent, registry, args["payer"], args.get("network"), settings)


@blp.route("/pay")
class Pay(MethodView):
    decorators = [api_key_required]

    @blp.arguments(PaySchema())
    @blp.alt_response(200, schema=PayEnvelope, success=True, description="Settled on chain")
    @blp.errors(400, 401, 402, 404, 409, 410, 415, 429, 503, 504)
    def post(self, args: dict[str, Any]) -> Any:
        """Settle a buyer's signed EIP-3009 authorization for an intent

        `payment_signature` is an x402 PaymentPayload as x402 clients send it: x402Version 1 with
        `scheme` and `network` (a CAIP-2 id or a v1 name such as `base-sepolia`), or x402Version 2
        with `accepted` (the requirement signed for: its scheme, network, amount, asset and payTo
        must be the intent's requirement's). The EVM payload may be flat or nested
        (`{signature, authorization}`); Solana's is `{transaction}`. See docs/x402.md.

        Errors: ALREADY_PAID (409), PAYMENT_IN_PROGRESS (409), INTENT_CANCELLED (409), INTENT_EXPIRED (410),
        NONCE_ALREADY_USED (409), REQUIREMENT_OUTDATED (409: the merchant replaced or removed the payout wallet
        the requirement's payTo names, or the network's USDC contract changed; ask for a new intent),
        UNSUPPORTED_NETWORK / UNSUPPORTED_SCHEME / UNSUPPORTED_X402_VERSION /
        INVALID_PAYLOAD / RECIPIENT_MISMATCH / AMOUNT_MISMATCH / ASSET_MISMATCH (v2 accepted.asset) /
        AUTHORIZATION_NOT_YET_VALID / AUTHORIZATION_EXPIRED / INVALID_SIGNATURE (400),
        PAYER_HAS_CODE (400: the paying address has contract code, a smart wallet or an EIP-7702
        delegation; only plain addresses are settled), PAYER_TOO_MANY_OPEN_PAYMENTS (429, with
        `Retry-After`: the paying address has MAX_OPEN_SETTLEMENTS_PER_PAYER payments settling),
        SETTLEMENT_FAILED (402, with `reason`), RELAY_BUDGET_EXHAUSTED (429, with `Retry-After`: the
        merchant's budget for network fees paid by the relay on this network has no room for this payment,
        counting what its payments still settling may cost; nothing was claimed or sent),
        TOO_MANY_OPEN_SETTLEMENTS (429, with `Retry-After`: the merchant has MAX_OPEN_SETTLEMENTS payments
        settling on this network), CHAIN_UNAVAILABLE (503),
        SETTLEMENT_PENDING (504: still settling; read the intent).
        Solana adds FEE_PAYER_MISMATCH / FEE_PAYER_MISUSED / DISALLOWED_INSTRUCTION / INVALID_TRANSACTION /
        ASSET_MISMATCH / COMPUTE_BUDGET_TOO_HIGH / BLOCKHASH_EXPIRED (400), PAYEE_ACCOUNT_MISSING (409:
        the merchant's USDC account is gone; fetch a new transaction, which opens it) and PAYEE_ACCOUNT_CLOSED
        (409: the merchant closed its USDC account after payments landed in it on this chain; no buyer pays to
        open it again, the merchant must).
        """
        return ok(pay_intent(current_merchant_id(), args["intent_id"], args["payment_signature"]))


@blp.route("/intents/<string:intent_id>/solana-transaction")
class SolanaTransaction(MethodView):
    decorators = [api_key_required]

    @blp.arguments(SolanaTransactionRequestSchema())
    @blp.alt_response(200, schema=SolanaTransactionEnvelope, success=True, description="The transaction to sign")
    @blp.errors(400, 401, 402, 404, 409, 410, 415, 429, 503)
    def post(self, args: dict[str, Any], intent_id: str) -> Any:
        """Build the Solana transaction a buyer signs to pay an intent

        A version-0 transaction: compute-budget limits, one TransferChecked of exactly the amount
        from the payer's USDC account to the merchant's, and a memo with the intent id. The relay
        is the fee payer and signs at /pay, after checking the transaction instruction by
        instruction. Sign it (signer 2) and send it as payment_signature.payload.transaction.

        If the merchant's USDC account does not exist yet, the transaction first opens it
        (Associated Token CreateIdempotent) with the payer paying its rent: `creates_payee_account`
        is true and `payer_pays_lamports` is the rent. A payer with less SOL than that gets
        PAYER_NEEDS_SOL (402). The relay never pays rent, and no buyer pays it for an account the
        merchant closed after payments landed in it on this chain: PAYEE_ACCOUNT_CLOSED (409). Also:
        SETTLEMENT_FAILED (402, the USDC balance is too low), RELAY_BUDGET_EXHAUSTED and
        TOO_MANY_OPEN_SETTLEMENTS (429, see /pay), CHAIN_UNAVAILABLE (503).
        """
        return ok(solana_transaction(load_payable_intent(current_merchant_id(), intent_id), args))
