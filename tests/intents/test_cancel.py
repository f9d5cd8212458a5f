"""DELETE /api/v1/x402/intents/{id}: only pending intents can be cancelled."""

from __future__ import annotations

from sqlalchemy import func, select

from backend.events.models import Event
from backend.extensions import db
from backend.intents.services import expire_overdue
from tests.intents.helpers import URL, create, mark_paid


def test_cancel_pending_intent(client, merchant):
    intent = create(client, merchant)
    response = client.delete(f"{URL}/{intent['intent_id']}", headers=merchant.headers)
    assert response.status_code == 200
    assert response.get_json() == {"success": True, "data": {"intent_id": intent["intent_id"], "status": "cancelled"}}
    read = client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers).get_json()["data"]
    assert read["status"] == "cancelled"


def test_cancel_twice_is_404(client, merchant):
    intent = create(client, merchant)
    client.delete(f"{URL}/{intent['intent_id']}", headers=merchant.headers)
    response = client.delete(f"{URL}/{intent['intent_id']}", headers=merchant.headers)
    assert response.status_code == 404
    assert response.get_json()["error"]["code"] == "INTENT_NOT_CANCELLABLE"


def test_cancel_paid_intent_is_404_and_leaves_it_paid(client, merchant):
    intent = create(client, merchant)
    mark_paid(intent["intent_id"])
    assert client.delete(f"{URL}/{intent['intent_id']}", headers=merchant.headers).status_code == 404
    assert client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers).get_json()["data"]["status"] == "paid"


def test_cancel_overdue_intent_is_404_and_it_expires(client, merchant, clock):
    intent = create(client, merchant)
    clock.advance(minutes=30)
    response = client.delete(f"{URL}/{intent['intent_id']}", headers=merchant.headers)
    assert response.status_code == 404
    assert response.get_json()["error"]["status"] == "expired"
    assert expire_overdue() == 1  # the sweep, not the cancel, records the expiry
    assert db.session.scalar(select(func.count()).select_from(Event).where(Event.type == "payment.expired")) == 1


def test_cancel_unknown_is_404(client, merchant):
    response = client.delete(f"{URL}/00000000-0000-4000-8000-000000000000", headers=merchant.headers)
    assert response.status_code == 404
