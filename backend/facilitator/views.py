"""``/api/v1/x402/facilitator``: ``GET /supported``, ``POST /verify``, ``POST /settle``, as the x402 facilitator
spec gives them, for the official middlewares (``HTTPFacilitatorClient`` with the merchant's API key as a header).
Thin: the rules are ``facilitator.services``'. A refusal is the spec's body (``isValid``/``success`` false, the
reason) with 200; a body that cannot be read, 400; our own trouble (a chain, the queue), its 5xx; a missing or
unknown key, our 401 envelope."""

from __future__ import annotations

from typing import Any

from flask import Response, request
from flask.views import MethodView

from backend import appstate, clock
from backend.errors import DomainError
from backend.extensions import release_autocommit_connection
from backend.facilitator import services
from backend.facilitator.schemas import SettleResponseSchema, SupportedSchema, VerifyResponseSchema
from backend.http import ApiBlueprint, json_response, parse_json_body
from backend.intents.services import key_and_wallets
from backend.merchants.auth import api_key_reading, current_merchant_id, read_with_key
from backend.schemas import ref
from backend.settlement.api import api_redis

blp = ApiBlueprint(
    "facilitator",
    __name__,
    url_prefix="/api/v1/x402/facilitator",
    description="The x402 facilitator API (supported, verify, settle) for the official x402 middlewares",
)


REQUEST_BODY = {"content": {"application/json": {"schema": ref("X402FacilitatorRequest")}}, "required": True}


def _body() -> Any:
    """The request's JSON (the service's rules); a body that cannot be read is the spec's 400."""
    try:
        return parse_json_body(request.get_data(cache=True))
    except DomainError as err:
        raise services.Refusal("invalid_payload", err.code, err.message, status=400) from None


def _checked(body: Any) -> services.Checked:
    # The key's check read the merchant's wallets on the request's autocommit connection: back to the pool now, so
    # that no connection is held across the chain's RPCs and the wait for the relayer (the session takes its own).
    wallets = read_with_key()
    release_autocommit_connection()
    settings = appstate.settings()
    return services.check(current_merchant_id(), wallets, body, appstate.chains(), settings, clock.now())


def _refused(refusal: services.Refusal, payer: str | None, **spec: Any) -> Response:
    """A refusal in the spec's shape (``spec``: its fields for verify or settle), our code and message in ``error``,
    the payer when known."""
    body: dict[str, Any] = {**spec, "error": {"code": refusal.code, "message": refusal.message}}
    if refusal.payer or payer:
        body["payer"] = refusal.payer or payer
    return json_response(body, refusal.status, refusal.headers)


def _network_sent(body: Any) -> str:
    """paymentRequirements.network as sent, for a refusal before it was read (the spec's field is required)."""
    requirements = body.get("paymentRequirements") if isinstance(body, dict) else None
    network = requirements.get("network") if isinstance(requirements, dict) else None
    return network[:64] if isinstance(network, str) else ""


@blp.route("/supported")
class Supported(MethodView):
    decorators = [api_key_reading(key_and_wallets)]

    @blp.alt_response(200, schema=SupportedSchema, description="What the calling merchant can be paid with")
    @blp.errors(401, 429)
    def get(self) -> Response:
        """The payment kinds this facilitator settles for you

        `exact` on each configured EVM network you have a wallet on, as x402 v2 (CAIP-2 network) and, where the
        network has an x402 v1 name, v1. Extensions: `payment-identifier`.
        """
        wallets = read_with_key()
        release_autocommit_connection()
        return json_response(services.supported(wallets, appstate.chains()))


@blp.route("/verify")
class Verify(MethodView):
    decorators = [api_key_reading(key_and_wallets)]

    @blp.doc(requestBody=REQUEST_BODY)
    @blp.alt_response(200, schema=VerifyResponseSchema, description="isValid, or the reason it is not")
    @blp.alt_response(400, schema=VerifyResponseSchema, description="The body cannot be read (invalid_payload)")
    @blp.errors(401, 429, 503)
    def post(self) -> Response:
        """Check a payment as /pay would, without moving money

        Every check /pay runs before its claim: the requirement (scheme, network, the network's USDC, a payTo that
        is your wallet, the amount), the payload's form, amount, recipient and validity window, the signature under
        the token's EIP-712 domain, then on chain the nonce unused, validAfter passed, a plain payer and its
        balance. A refusal is `isValid: false` with the spec's `invalidReason` (and our `error.code`).
        """
        payer: str | None = None
        try:
            checked = _checked(_body())
            payer = checked.payer
            return json_response(services.verify(checked))
        except services.Refusal as refusal:
            return _refused(refusal, payer, isValid=False, invalidReason=refusal.reason, invalidMessage=refusal.message)


@blp.route("/settle")
class Settle(MethodView):
    decorators = [api_key_reading(key_and_wallets)]

    @blp.doc(requestBody=REQUEST_BODY)
    @blp.alt_response(200, schema=SettleResponseSchema, description="Settled (the transaction), or why not")
    @blp.alt_response(400, schema=SettleResponseSchema, description="The body cannot be read (invalid_payload)")
    @blp.errors(401, 429, 503)
    def post(self) -> Response:
        """Settle a payment through the exactly-once engine, recorded as your paid intent

        The checks of /verify, then the claim and the relayer as for /pay. The payment is recorded as a paid intent
        of yours (amount, network, transaction, buyer; the resource's URL and description in its metadata): it
        shows in the API, the dashboard and the CSV export, and sends `payment.completed`. The same payment settled
        again answers the first result (the money moves once); with the x402 `payment-identifier` extension, the
        same id with another payment is refused. Still settling after PAY_WAIT_SECONDS: `success: false`,
        `errorReason: settlement_pending`, with the transaction; settle the same payment again for its result.
        """
        settings = appstate.settings()
        body: Any = None
        payer: str | None = None
        try:
            body = _body()
            checked = _checked(body)
            payer = checked.payer
            answer = services.settle(current_merchant_id(), checked, appstate.chains(), api_redis(), settings,
                                     wait_seconds=settings.pay_wait_seconds)  # fmt: skip
            return json_response(answer)
        except services.Refusal as refusal:
            return _refused(refusal, payer, success=False, errorReason=refusal.reason, errorMessage=refusal.message,
                            transaction=refusal.transaction, network=_network_sent(body))  # fmt: skip
