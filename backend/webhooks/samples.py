"""Realistic ``data`` for simulated events (POST /api/v1/webhooks/test), one builder per event type.

Each carries at least the key fields of the spec's event table, shaped like the real ones
(``payment.*`` match what settlement and expiry write). Nothing here touches a chain.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from backend.ids import prefixed_id

TEST_CHAIN = "eip155:84532"


def _tx_hash() -> str:
    return "0x" + secrets.token_hex(32)


def _address() -> str:
    return "0x" + secrets.token_hex(20)


def _payment_completed(now: datetime) -> dict[str, Any]:
    return {
        "intent_id": str(uuid.uuid4()),
        "status": "paid",
        "amount_usdc": Decimal("25.00"),
        "order_id": "order_test_1001",
        "tx_hash": _tx_hash(),
        "buyer_address": _address(),
        "chain": TEST_CHAIN,
        "paid_at": now,
    }


def _payment_failed(now: datetime) -> dict[str, Any]:
    return {
        "intent_id": str(uuid.uuid4()),
        "order_id": "order_test_1002",
        "reason": "insufficient balance: 3.5 USDC available, 25 USDC required",
        "code": "SETTLEMENT_FAILED",
        "amount_usdc": Decimal("25.00"),
    }


def _payment_duplicate(now: datetime) -> dict[str, Any]:
    return {
        "intent_id": str(uuid.uuid4()),
        "order_id": "order_test_1004",
        "amount_usdc": Decimal("25.00"),
        "tx_hash": _tx_hash(),
        "buyer_address": _address(),
        "chain": TEST_CHAIN,
        "settlement_id": prefixed_id("stl"),
        "paid_tx_hash": _tx_hash(),
        "detected_at": now,
    }


def _payment_expired(now: datetime) -> dict[str, Any]:
    return {"intent_id": str(uuid.uuid4()), "status": "expired", "order_id": "order_test_1003", "expired_at": now}


def _invoice_paid(now: datetime) -> dict[str, Any]:
    return {"invoice_id": prefixed_id("inv"), "amount_usdc": Decimal("120.00"), "paid_at": now, "chain": TEST_CHAIN}


def _invoice_overdue(now: datetime) -> dict[str, Any]:
    due = (now - timedelta(days=3)).date().isoformat()
    return {"invoice_id": prefixed_id("inv"), "amount_usdc": Decimal("120.00"), "due_date": due}


def _refund_issued(now: datetime) -> dict[str, Any]:
    return {
        "refund_id": prefixed_id("re"),
        "intent_id": str(uuid.uuid4()),
        "amount_usdc": Decimal("10.00"),
        "tx_hash": _tx_hash(),
        "chain": TEST_CHAIN,
    }


def _bridge_completed(now: datetime) -> dict[str, Any]:
    return {
        "bridge_id": prefixed_id("br"),
        "from_chain": "eip155:11155111",
        "to_chain": TEST_CHAIN,
        "amount_usdc": Decimal("500.00"),
        "tx_hash": _tx_hash(),
    }


def _transfer_completed(now: datetime) -> dict[str, Any]:
    return {
        "transfer_id": prefixed_id("tr"),
        "to_address": _address(),
        "amount_usdc": Decimal("75.25"),
        "tx_hash": _tx_hash(),
        "chain": TEST_CHAIN,
    }


def _payroll_batch_completed(now: datetime) -> dict[str, Any]:
    return {"batch_id": prefixed_id("pb"), "total_usdc": Decimal("18250.00"), "recipient_count": 12}


def _fraud_flagged(now: datetime) -> dict[str, Any]:
    return {
        "transaction_id": _tx_hash(),
        "risk_score": Decimal("0.87"),
        "reason": "buyer address linked to 14 failed authorizations in the last hour",
    }


SAMPLES: dict[str, Callable[[datetime], dict[str, Any]]] = {
    "payment.completed": _payment_completed,
    "payment.failed": _payment_failed,
    "payment.expired": _payment_expired,
    "invoice.paid": _invoice_paid,
    "invoice.overdue": _invoice_overdue,
    "refund.issued": _refund_issued,
    "bridge.completed": _bridge_completed,
    "transfer.completed": _transfer_completed,
    "payroll.batch_completed": _payroll_batch_completed,
    "fraud.flagged": _fraud_flagged,
    "payment.duplicate": _payment_duplicate,
}


def sample_data(event_type: str, now: datetime) -> dict[str, Any]:
    return SAMPLES[event_type](now)
