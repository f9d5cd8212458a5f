from __future__ import annotations

from typing import Any

from sqlalchemy import update

from backend import clock
from backend.extensions import db
from backend.intents.models import Intent

URL = "/api/v1/x402/intents"


def create(client: Any, merchant: Any, **body: Any) -> dict[str, Any]:
    body.setdefault("amount_usdc", 5)
    response = client.post(URL, json=body, headers=merchant.headers)
    assert response.status_code == 201, response.data
    return response.get_json()["data"]


def mark_paid(intent_id: str) -> None:
    """Stand-in for settlement (arrives in issue 2) to exercise the paid state."""
    now = clock.now()
    db.session.execute(
        update(Intent)
        .where(Intent.id == intent_id)
        .values(
            status="paid",
            tx_hash="0x" + "ab" * 32,
            buyer_address="0x" + "11" * 20,
            chain="eip155:84532",
            paid_at=now,
            updated_at=now,
        )
    )
    db.session.commit()
