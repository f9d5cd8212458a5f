"""Expiry: 30 minutes after creation a pending intent is expired, with one payment.expired event."""

from __future__ import annotations

import json

from sqlalchemy import select

from backend.events.models import Event
from backend.extensions import db
from backend.intents import services
from backend.intents.tasks import expire_intents
from backend.queueing import set_job_app
from tests.intents.helpers import URL, create, mark_paid


def expired_events() -> list[dict]:
    rows = db.session.scalars(select(Event).where(Event.type == "payment.expired").order_by(Event.created_at))
    return [json.loads(r.payload) for r in rows]


def test_intent_stays_pending_until_its_expiry_time(client, merchant, clock):
    intent = create(client, merchant)
    clock.advance(minutes=29, seconds=59)
    assert services.expire_overdue() == 0
    assert (
        client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers).get_json()["data"]["status"] == "pending"
    )


def test_read_of_an_overdue_intent_never_shows_pending(client, merchant, clock):
    intent = create(client, merchant, order_id="ord-9")
    clock.advance(minutes=30)
    data = client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers).get_json()["data"]
    assert data["status"] == "expired"  # before the sweep has run: reads never write
    assert expired_events() == []
    clock.advance(seconds=5)
    assert services.expire_overdue() == 1
    events = expired_events()
    assert len(events) == 1
    event = events[0]
    assert event["event"] == "payment.expired"
    assert event["id"].startswith("evt_")
    assert event["data"]["intent_id"] == intent["intent_id"]
    assert event["data"]["order_id"] == "ord-9"
    assert event["data"]["expired_at"] == data["expires_at"]
    assert client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers).get_json()["data"] == data
    # Reading again writes no second event.
    client.get(f"{URL}/{intent['intent_id']}", headers=merchant.headers)
    assert len(expired_events()) == 1


def test_list_never_shows_overdue_intents_as_pending(client, merchant, clock):
    create(client, merchant)
    clock.advance(minutes=31)
    assert client.get(f"{URL}?status=pending", headers=merchant.headers).get_json()["data"]["total"] == 0
    page = client.get(f"{URL}?status=expired", headers=merchant.headers).get_json()["data"]
    assert page["total"] == 1


def test_sweep_job_expires_only_overdue_pending_intents(app, client, merchant, other_merchant, clock):
    old = [create(client, merchant)["intent_id"] for _ in range(3)]
    paid = create(client, merchant)["intent_id"]
    mark_paid(paid)
    theirs = create(client, other_merchant)["intent_id"]
    clock.advance(minutes=20)
    fresh = create(client, merchant)["intent_id"]
    clock.advance(minutes=10)
    set_job_app(app)
    try:
        assert expire_intents() == 4  # the three old ones and the other merchant's
        assert expire_intents() == 0
    finally:
        set_job_app(None)
    db.session.expire_all()
    status = lambda i: client.get(f"{URL}/{i}", headers=merchant.headers).get_json()["data"]["status"]  # noqa: E731
    assert [status(i) for i in old] == ["expired"] * 3
    assert status(paid) == "paid"
    assert status(fresh) == "pending"
    assert client.get(f"{URL}/{theirs}", headers=other_merchant.headers).get_json()["data"]["status"] == "expired"
    assert sorted(e["data"]["intent_id"] for e in expired_events()) == sorted([*old, theirs])


def test_expiry_and_cancel_cannot_both_win(client, merchant, clock):
    intent = create(client, merchant)
    clock.advance(minutes=30)
    now = clock.current
    row = (intent["intent_id"], merchant.id, None, now)
    assert services.expire_intents([row], now) == 1
    assert services.expire_intents([row], now) == 0  # a second sweep finds nothing to do
    assert client.delete(f"{URL}/{intent['intent_id']}", headers=merchant.headers).status_code == 404
    assert len(expired_events()) == 1
