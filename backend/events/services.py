"""Writing events: the one place an event is created and its envelope serialised.

Events are written by the domains and read by webhooks, never the other way: this package imports no
webhook code. Webhooks subscribe (:func:`subscribe`, from ``backend.webhooks.tasks.init_app``, which the
app factory calls) and are handed each event inside the transaction that writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend import clock
from backend.events.models import Event
from backend.extensions import db
from backend.ids import prefixed_id
from backend.jsonio import dumps

# The ten event types of the spec, in its order, and payment.duplicate (ours: a second charge to refund).
EVENT_TYPES: tuple[str, ...] = (
    "payment.completed",
    "payment.failed",
    "payment.expired",
    "invoice.paid",
    "invoice.overdue",
    "refund.issued",
    "bridge.completed",
    "transfer.completed",
    "payroll.batch_completed",
    "fraud.flagged",
    "payment.duplicate",
)

# Called with (event, endpoint_id) for every event recorded, in the writer's transaction.
EventSubscriber = Callable[[Event, str | None], object]
_subscribers: list[EventSubscriber] = []


def subscribe(subscriber: EventSubscriber) -> None:
    """Hand every event recorded from now on to ``subscriber`` (once, however often it is subscribed)."""
    if subscriber not in _subscribers:
        _subscribers.append(subscriber)


def record_event(
    merchant_id: str,
    event_type: str,
    data: dict[str, Any],
    *,
    intent_id: str | None = None,
    simulated: bool = False,
    endpoint_id: str | None = None,
) -> Event:
    """Add an event and its webhook deliveries to the session; they commit (or not) with the caller.

    The envelope ``{id, event, created_at, data}`` is serialised here once; webhook deliveries
    send and sign these exact bytes. Deliveries go to every live endpoint of the merchant that
    subscribed to ``event_type``, or only to ``endpoint_id`` (simulated test events).
    """
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}")
    created_at = clock.now()
    event_id = prefixed_id("evt")
    if simulated:  # recognisable at a glance, still 40 characters
        event_id = "evt_test_" + event_id[4:35]
    envelope = {"id": event_id, "event": event_type, "created_at": created_at, "data": data}
    event = Event(
        id=event_id,
        merchant_id=merchant_id,
        type=event_type,
        intent_id=intent_id,
        payload=dumps(envelope),
        created_at=created_at,
        simulated=simulated,
    )
    if not _subscribers:  # an event nobody delivers would be lost silently
        raise RuntimeError("no event subscriber: the app factory subscribes webhooks (backend.webhooks.tasks)")
    db.session.add(event)
    for subscriber in _subscribers:
        subscriber(event, endpoint_id)
    return event
