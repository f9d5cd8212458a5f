"""What the keyed API (``settlement.views``) and the public checkout (``checkout.views``) share: a payment or a
Solana transaction request run with the current app's settings, chains and Redis."""

from __future__ import annotations

from typing import Any

from backend import appstate
from backend.errors import DomainError
from backend.intents.models import Refund
from backend.queueing import app_redis
from backend.settlement import solana
from backend.settlement.flow import submit_payment
from backend.settlement.refunds import submit_refund


def api_redis() -> Any:
    redis = app_redis()
    if redis is None:
        raise DomainError("SETTLEMENT_UNAVAILABLE", "Settlement is not configured on this server (REDIS_URL)")
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


def pay_refund(merchant_id: str, refund_id: str, signature: dict[str, Any]) -> tuple[Refund, bool]:
    """A parsed payment_signature of a refund through settlement (the keyed API and the dashboard share it)."""
    settings = appstate.settings()
    return submit_refund(
        merchant_id,
        refund_id,
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
