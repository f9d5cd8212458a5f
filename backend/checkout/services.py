"""What the checkout shows a buyer: one intent, without metadata, order details beyond the label, or keys."""

from __future__ import annotations

import logging
from typing import Any

from backend import appstate, clock
from backend.chains.addresses import AddressError
from backend.chains.registry import ChainRegistry
from backend.errors import ChainUnavailable, DomainError, echo
from backend.extensions import db
from backend.intents.models import Intent
from backend.intents.services import effective_status
from backend.merchants.models import Merchant
from backend.money import from_atomic
from backend.rails.registry import rail_for
from backend.ratelimit import client_key, enforce

log = logging.getLogger(__name__)

# Per client IP: reads are polled every few seconds by an open page; payments are rare.
READS_PER_MINUTE = 120
WRITES_PER_MINUTE = 20


def limit(kind: str) -> None:
    """429 RATE_LIMITED with Retry-After when this client exceeds the checkout's limits."""
    per_minute = READS_PER_MINUTE if kind == "read" else WRITES_PER_MINUTE
    enforce(f"checkout:{kind}:{client_key()}", per_minute)


def _registry() -> ChainRegistry:
    return appstate.chains()


def public_view(intent: Intent) -> dict[str, Any]:
    """The buyer's view of an intent, with what a wallet needs to reach each of its networks."""
    merchant = db.session.get(Merchant, intent.merchant_id)
    registry = _registry()
    requirements = intent.payment_requirements or []
    networks = [n.for_wallets() for n in (registry.get(r["network"]) for r in requirements) if n is not None]
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
        "networks": networks,
        "server_time": clock.isoformat(clock.now()),
    }


def buyer_balance(intent: Intent, network_id: str, address: str) -> dict[str, Any]:
    """The buyer's USDC balance on one of the intent's networks (atomic units, read from the chain)."""
    requirement = next((r for r in intent.payment_requirements or [] if r["network"] == network_id), None)
    network = _registry().get(network_id) if requirement else None
    if requirement is None or network is None:
        raise DomainError("UNSUPPORTED_NETWORK", f"This intent cannot be paid on {echo(network_id)}")
    rail = rail_for(network)
    try:
        address = rail.normalize_address(address)
    except AddressError as exc:
        raise DomainError("VALIDATION_ERROR", f"address: {exc}", fields={"address": [str(exc)]}) from None
    db.session.rollback()  # the intent is read: no database connection is held while the chain answers
    try:
        atomic = rail.token_balance(network, address)
    except DomainError:
        raise
    except Exception as exc:  # RPC down, timeouts, malformed answers (the text may hold the RPC URL)
        log.warning("balance read on %s failed (%s)", network.network, type(exc).__name__)
        raise ChainUnavailable(network.name) from None
    return {
        "network": network.network,
        "address": address,
        "balance_usdc": from_atomic(atomic),
        "balance_atomic": str(atomic),
        "required_atomic": requirement["maxAmountRequired"],
    }
