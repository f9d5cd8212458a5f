from __future__ import annotations

from typing import Any

from backend.extensions import db
from backend.webhooks import services
from backend.webhooks.models import WebhookAttempt, WebhookDelivery

URL = "/api/v1/webhooks"
# Host names under this suffix never resolve while a test using the ``hung_dns`` fixture runs.
HUNG_SUFFIX = ".hang.test"


def register(client: Any, merchant: Any, url: str, events: list[str] | None = None) -> dict[str, Any]:
    response = client.post(URL, json={"url": url, "events": events or ["payment.completed"]}, headers=merchant.headers)
    assert response.status_code == 201, response.data
    return response.get_json()["data"]


def send_test(client: Any, merchant: Any, webhook_id: str, event: str = "payment.completed") -> dict[str, Any]:
    response = client.post(f"{URL}/test", json={"webhook_id": webhook_id, "event": event}, headers=merchant.headers)
    assert response.status_code == 202, response.data
    return response.get_json()["data"]


def deliver(deadline: float = 10.0) -> int:
    """What a worker does when woken: send everything due now."""
    return services.deliver_due(allow_private=True, deadline=deadline)


def delivery(delivery_id: str) -> WebhookDelivery:
    db.session.expire_all()
    row = db.session.get(WebhookDelivery, delivery_id)
    assert row is not None
    return row


def attempts(delivery_id: str) -> list[WebhookAttempt]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            db.select(WebhookAttempt).where(WebhookAttempt.delivery_id == delivery_id).order_by(WebhookAttempt.number)
        )
    )
