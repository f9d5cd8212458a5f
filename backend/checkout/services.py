"""What the checkout shows a buyer: one intent, without metadata, order details beyond the label, or keys."""

from __future__ import annotations

from typing import Any

from flask import request

from backend import clock
from backend.errors import APIError
from backend.extensions import db
from backend.intents.models import Intent
from backend.intents.services import effective_status
from backend.merchants.models import Merchant
from backend.money import from_atomic
from backend.ratelimit import hit

# Per client IP: reads are polled every few seconds by an open page; payments are rare.
READS_PER_MINUTE = 120
WRITES_PER_MINUTE = 20


def limit(kind: str) -> None:
    """429 RATE_LIMITED with Retry-After when this client exceeds the checkout's limits."""
    per_minute = READS_PER_MINUTE if kind == "read" else WRITES_PER_MINUTE
    retry_after = hit(f"checkout:{kind}:{request.remote_addr or 'unknown'}", per_minute, 60)
    if retry_after is not None:
        raise APIError(
            429, "RATE_LIMITED", "Too many requests; try again shortly", headers={"Retry-After": str(retry_after)}
        )


def public_view(intent: Intent) -> dict[str, Any]:
    """The buyer's view of an intent."""
    merchant = db.session.get(Merchant, intent.merchant_id)
    status = effective_status(intent.status, intent.expires_at, clock.now(), intent.settlement_id)
    paid = status == "paid"
    return {
        "intent_id": intent.id,
        "status": status,
        "merchant_name": merchant.name if merchant else None,
        "description": intent.description,
        "amount_usdc": from_atomic(intent.amount_atomic),
        "expires_at": clock.isoformat(intent.expires_at),
        "redirect_url": intent.redirect_url,
        "cancel_url": intent.cancel_url,
        "payment_requirements": intent.payment_requirements or [],
        "tx_hash": intent.tx_hash if paid else None,
        "chain": intent.chain if paid else None,
        "paid_at": clock.isoformat(intent.paid_at) if paid else None,
    }
