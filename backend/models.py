"""Imports every domain's models so ``db.metadata`` knows all tables (Alembic, tests)."""

from backend.dashboard.models import PendingReveal
from backend.events.models import Event
from backend.idempotency.models import IdempotencyRecord
from backend.intents.models import Intent
from backend.merchants.models import ApiKey, Merchant, Wallet
from backend.paymentlinks.models import PaymentLink
from backend.relaybudget.models import RelaySpend
from backend.settlement.models import PayeeAccount, Settlement
from backend.webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint

__all__ = [
    "ApiKey",
    "Event",
    "IdempotencyRecord",
    "Intent",
    "Merchant",
    "PayeeAccount",
    "PaymentLink",
    "PendingReveal",
    "RelaySpend",
    "Settlement",
    "Wallet",
    "WebhookAttempt",
    "WebhookDelivery",
    "WebhookEndpoint",
]
