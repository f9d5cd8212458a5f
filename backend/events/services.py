"""Writing events: the one place an event is created and its envelope serialised."""

from __future__ import annotations

from typing import Any

from backend import clock
from backend.events.models import Event
from backend.extensions import db
from backend.ids import prefixed_id
from backend.jsonio import dumps

# The ten event types of the spec, in its order.
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
)


def record_event(merchant_id: str, event_type: str, data: dict[str, Any], *, intent_id: str | None = None) -> Event:
    """Add an event to the current session; it commits (or not) with the caller's transaction.

    The envelope ``{id, event, created_at, data}`` is serialised here once; webhook deliveries
    send and sign these exact bytes.
    """
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}")
    created_at = clock.now()
    event_id = prefixed_id("evt")
    envelope = {"id": event_id, "event": event_type, "created_at": created_at, "data": data}
    event = Event(
        id=event_id,
        merchant_id=merchant_id,
        type=event_type,
        intent_id=intent_id,
        payload=dumps(envelope),
        created_at=created_at,
    )
    db.session.add(event)
    return event
