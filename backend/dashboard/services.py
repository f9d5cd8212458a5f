"""What the dashboard pages need, composed from the domain services (which own every rule)."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import quote

from sqlalchemy import select

from backend import clock
from backend.chains.registry import ChainRegistry, Network
from backend.dashboard.chart import Chart, volume_chart
from backend.dashboard.forms import Form, sentence
from backend.errors import not_found
from backend.extensions import db
from backend.intents import refunds as intent_refund_records
from backend.intents import services as intents
from backend.intents.models import STATUSES
from backend.intents.volume import daily_volume
from backend.merchants import services as merchants
from backend.merchants.models import ApiKey, Merchant, Wallet
from backend.money import from_atomic
from backend.rails.base import Rail
from backend.rails.registry import rail_for
from backend.settlement import refunds as settlement_refunds
from backend.settlement import services as settlement
from backend.webhooks import services as webhooks

# Which form field a merchant-service error belongs to.
VOLUME_DAYS = 30  # the overview's chart

_SIGNUP_FIELDS = {
    "INVALID_EMAIL": "email",
    "EMAIL_TAKEN": "email",
    "WEAK_PASSWORD": "password",
    "INVALID_PASSWORD": "password",
    "INVALID_NAME": "name",
}
_SIGNUP_MESSAGES = {
    "INVALID_EMAIL": "Enter a valid email address, like shop@example.com.",
    "EMAIL_TAKEN": "An account with this email already exists. Log in instead.",
}


@functools.cache
def _dummy_hash() -> str:
    return merchants.hash_password(secrets.token_urlsafe(16))


def authenticate_merchant(email: str, password: str) -> Merchant | None:
    """The merchant whose email and password these are, or None.

    An unknown email costs one argon2 verification too, so timing does not tell which emails exist.
    """
    found = db.session.scalar(select(Merchant).where(Merchant.email == email.strip().lower()))
    if found is None:
        merchants.verify_password(_dummy_hash(), password)
        return None
    return found if merchants.verify_password(found.password_hash, password) else None


def sign_up(form: Form) -> merchants.IssuedKey | None:
    """Create the merchant (and its first key) from a checked sign-up form; None with form errors set."""
    try:
        _, issued = merchants.create_merchant(form.values["email"], form.values["password"], form.values["name"])
    except merchants.MerchantError as exc:
        form.error(_SIGNUP_FIELDS.get(exc.code, "email"), _SIGNUP_MESSAGES.get(exc.code, sentence(exc.message)))
        return None
    return issued


# --- overview ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Overview:
    active_keys: int
    wallets: int
    networks: int
    webhooks: int
    intent_counts: dict[str, int]
    recent_intents: list[dict[str, Any]]
    volume: Chart  # settled volume per day and chain, the last VOLUME_DAYS days


def overview(merchant_id: str, registry: ChainRegistry, checkout_host: str) -> Overview:
    keys = merchants.list_api_keys(merchant_id)
    wallets = [w for w in merchants.list_wallets(merchant_id) if w.network in registry]
    _, endpoint_total = webhooks.list_endpoints(merchant_id, limit=1, offset=0)
    counts = {
        status: intents.list_intents(merchant_id, status=status, order_id=None, limit=1, offset=0)[1]
        for status in STATUSES
    }
    recent, _ = intents.list_intents(merchant_id, status=None, order_id=None, limit=5, offset=0)
    now = clock.now()
    return Overview(
        active_keys=sum(1 for k in keys if k.revoked_at is None),
        wallets=len(wallets),
        networks=len(registry.ids()),
        webhooks=endpoint_total,
        intent_counts=counts,
        recent_intents=[intents.intent_to_dict(row, checkout_host, now) for row in recent],
        volume=volume_chart(
            daily_volume(merchant_id, now, VOLUME_DAYS, order=registry.ids()), {n.network: n.name for n in registry}
        ),
    )


# --- keys and wallets ----------------------------------------------------------------------------


def api_keys(merchant_id: str) -> list[ApiKey]:
    return merchants.list_api_keys(merchant_id)


@dataclass(frozen=True)
class WalletRow:
    network: Network
    wallet: Wallet | None

    @property
    def rail(self) -> Rail:
        """The network's rail: its label and what an address looks like, for the form."""
        return rail_for(self.network)


def wallet_rows(merchant_id: str, registry: ChainRegistry) -> list[WalletRow]:
    """One row per configured network, with the merchant's wallet there if any."""
    wallets = {w.network: w for w in merchants.list_wallets(merchant_id)}
    return [WalletRow(network, wallets.get(network.network)) for network in registry]


def save_wallet(merchant_id: str, form: Form, registry: ChainRegistry) -> Wallet | None:
    """Register or replace the wallet (validated by the merchant service); None with form errors set."""
    try:
        return merchants.set_wallet(merchant_id, form.values["network"], form.values["address"], registry)
    except merchants.MerchantError as exc:
        field = "network" if exc.code == "UNKNOWN_NETWORK" else "address"
        message = "Choose one of the configured networks." if field == "network" else sentence(exc.message)
        form.error(field, message)
        return None


# --- webhooks ------------------------------------------------------------------------------------


def delivery_page(merchant_id: str, webhook_id: str, *, page: int, page_size: int) -> tuple[list[dict[str, Any]], int]:
    """A page of one endpoint's deliveries, newest first, each with its attempts (oldest first)."""
    rows, total = webhooks.list_deliveries(
        merchant_id, webhook_id=webhook_id, limit=page_size, offset=(page - 1) * page_size
    )
    return [webhooks.get_delivery(merchant_id, row["delivery_id"]) for row in rows], total


def endpoint_delivery(merchant_id: str, webhook_id: str, delivery_id: str) -> dict[str, Any]:
    """One delivery of this endpoint; another endpoint's (or merchant's) delivery is 404."""
    delivery = webhooks.get_delivery(merchant_id, delivery_id)
    if delivery["webhook_id"] != webhook_id:
        raise not_found("Webhook delivery")
    return delivery


# --- intents -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequirementView:
    network: str
    network_name: str
    pay_to: str
    amount_usdc: Decimal
    asset: str
    raw: Mapping[str, Any]


def intent_page(merchant_id: str, form: Form, checkout_host: str) -> tuple[list[dict[str, Any]], int]:
    rows, total = intents.list_intents(
        merchant_id,
        status=form.values["status"] or None,
        order_id=form.values["order_id"] or None,
        limit=form.values["limit"],
        offset=form.values["offset"],
    )
    now = clock.now()
    return [intents.intent_to_dict(row, checkout_host, now) for row in rows], total


def intent_refunds(intent_id: str) -> list[dict[str, Any]]:
    """The refunds of an (already scoped) intent, oldest first, as the API shows them."""
    return [intent_refund_records.refund_to_dict(refund) for refund in intent_refund_records.refunds_of(intent_id)]


def refundable_usdc(merchant_id: str, intent_id: str) -> Decimal:
    """What is left to refund on the merchant's paid intent (its refunds that moved money or still may, deducted)."""
    intent = intent_refund_records.merchant_intent(merchant_id, intent_id)
    return from_atomic(settlement_refunds.refundable_atomic(intent))


def duplicate_payments(intent_id: str) -> list[dict[str, Any]]:
    """Second charges of an (already scoped) intent: authorizations that executed after it was paid."""
    return [
        {"detected_at": s.finished_at, "chain": s.network, "buyer_address": s.payer,
         "amount_usdc": from_atomic(s.amount_atomic), "tx_hash": s.tx_hash}
        for s in settlement.duplicate_payments(intent_id)
    ]  # fmt: skip


def intent_detail(
    merchant_id: str, intent_id: str, registry: ChainRegistry, checkout_host: str
) -> tuple[dict[str, Any], list[RequirementView], str | None]:
    """The intent as the API shows it, its requirements made readable, and a block-explorer link."""
    intent = intents.intent_to_dict(intents.get_intent(merchant_id, intent_id), checkout_host)
    requirements = []
    for requirement in intent["payment_requirements"] or []:
        network = registry.get(requirement.get("network", ""))
        requirements.append(
            RequirementView(
                network=requirement.get("network", ""),
                network_name=network.name if network else requirement.get("network", ""),
                pay_to=requirement.get("payTo", ""),
                amount_usdc=from_atomic(int(requirement.get("maxAmountRequired", "0"))),
                asset=requirement.get("asset", ""),
                raw=requirement,
            )
        )
    explorer = None
    paid_on = registry.get(intent["chain"]) if intent["chain"] else None
    if paid_on is not None and paid_on.explorer_tx_url and intent["tx_hash"]:
        explorer = paid_on.explorer_tx_url.replace("{tx}", quote(intent["tx_hash"], safe=""))
    return intent, requirements, explorer
