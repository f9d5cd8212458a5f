"""Webhook endpoints, the delivery queue in the database, the retry schedule, replay and logs.

Delivery is at-least-once with the same event ``id`` on every attempt. A worker claims one due
delivery with a lease (a conditional UPDATE, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL), sends it,
and records the attempt only while its lease is still the one on the row, so two workers never
send or record the same attempt; a crashed worker's lease runs out and the delivery is due again.

Claims are fair between merchants (``backend.webhooks.claims``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, case, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from backend import clock
from backend.errors import DomainError, not_found
from backend.events.models import Event
from backend.events.services import record_event
from backend.extensions import UTCDateTime, db, rowcount
from backend.ids import prefixed_id
from backend.jsonio import strict_loads
from backend.webhooks import models as wm
from backend.webhooks import transport
from backend.webhooks.claims import (  # noqa: F401  (LEASE_SECONDS, MAX_IN_FLIGHT_PER_ENDPOINT: re-exported)
    DEFAULT_MAX_IN_FLIGHT_PER_MERCHANT,
    LEASE_SECONDS,
    MAX_IN_FLIGHT_PER_ENDPOINT,
    ClaimedDelivery,
    claim_due,
    due,
)
from backend.webhooks.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from backend.webhooks.samples import sample_data
from payintent.webhooks import new_secret, signature_headers

log = logging.getLogger(__name__)

# The spec's schedule: attempt 1 at once, then 1 min, 5 min, 30 min and 2 h after the previous one.
RETRY_DELAYS_SECONDS: tuple[int, ...] = (60, 300, 1800, 7200)
MAX_ATTEMPTS = len(RETRY_DELAYS_SECONDS) + 1
MAX_ENDPOINTS_PER_MERCHANT = 16
# Test events and replays cost the caller one request each: at most this many of them may wait to be
# delivered to one endpoint, which bounds the backlog a merchant can pile up for the senders to wade
# through (a soft bound: simultaneous requests may pass it by a few).
MAX_PENDING_ON_DEMAND_PER_ENDPOINT = 100
# Longer than a delivery stays pending while workers run (its five attempts span about 2.6 hours).
_ON_DEMAND_WINDOW = timedelta(hours=4)
_WAKE_FLAG = "payintent.webhooks.wake"

_deliveries = WebhookDelivery.__table__
_endpoints = WebhookEndpoint.__table__
_attempts = WebhookAttempt.__table__
_events = Event.__table__


def next_attempt_delay(attempt_number: int) -> int | None:
    """Seconds from failed attempt ``attempt_number`` (1-based) to the next one; None after the last."""
    if attempt_number >= MAX_ATTEMPTS:
        return None
    return RETRY_DELAYS_SECONDS[attempt_number - 1]


# --- endpoints -----------------------------------------------------------------------------------


def endpoint_to_dict(endpoint: WebhookEndpoint, secret: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "webhook_id": endpoint.id,
        "url": endpoint.url,
        "events": list(endpoint.events),
        "created_at": clock.isoformat(endpoint.created_at),
    }
    if secret is not None:
        data["secret"] = secret
    return data


def create_endpoint(merchant_id: str, url: str, events: Sequence[str]) -> tuple[WebhookEndpoint, str]:
    """Register an endpoint; returns it with its secret (the only time the secret is shown)."""
    count = db.session.scalar(
        select(func.count())
        .select_from(_endpoints)
        .where(_endpoints.c.merchant_id == merchant_id, _endpoints.c.deleted_at.is_(None))
    )
    if (count or 0) >= MAX_ENDPOINTS_PER_MERCHANT:
        raise DomainError(
            "WEBHOOK_LIMIT_REACHED", f"A merchant can have at most {MAX_ENDPOINTS_PER_MERCHANT} webhook endpoints"
        )
    now = clock.now()
    secret = new_secret()
    endpoint = WebhookEndpoint(
        id=prefixed_id("we"),
        merchant_id=merchant_id,
        url=url,
        events=list(dict.fromkeys(events)),
        secret=secret,
        created_at=now,
        updated_at=now,
    )
    db.session.add(endpoint)
    db.session.commit()
    return endpoint, secret


def get_endpoint(merchant_id: str, webhook_id: str) -> WebhookEndpoint:
    endpoint = db.session.get(WebhookEndpoint, webhook_id)
    if endpoint is None or endpoint.merchant_id != merchant_id or endpoint.deleted_at is not None:
        raise not_found("Webhook endpoint")
    return endpoint


def list_endpoints(merchant_id: str, *, limit: int, offset: int) -> tuple[list[WebhookEndpoint], int]:
    conditions = (WebhookEndpoint.merchant_id == merchant_id, WebhookEndpoint.deleted_at.is_(None))
    total = db.session.scalar(select(func.count()).select_from(WebhookEndpoint).where(*conditions)) or 0
    rows = db.session.scalars(
        select(WebhookEndpoint)
        .where(*conditions)
        .order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(rows), total


def delete_endpoint(merchant_id: str, webhook_id: str) -> None:
    """Stop sending to an endpoint: it disappears from the API and its pending deliveries are cancelled.

    The row and its delivery log are kept (soft delete) so past deliveries stay readable.
    """
    endpoint = get_endpoint(merchant_id, webhook_id)
    now = clock.now()
    endpoint.deleted_at = now
    endpoint.updated_at = now
    db.session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.endpoint_id == webhook_id, WebhookDelivery.status == wm.PENDING)
        .values(status=wm.CANCELLED, next_attempt_at=None, finished_at=now, updated_at=now)
    )
    db.session.commit()


def rotate_secret(merchant_id: str, webhook_id: str) -> tuple[WebhookEndpoint, str]:
    """Replace the secret at once; every attempt from now on (retries too) is signed with the new one."""
    endpoint = get_endpoint(merchant_id, webhook_id)
    secret = new_secret()
    endpoint.secret = secret
    endpoint.updated_at = clock.now()
    db.session.commit()
    return endpoint, secret


# --- scheduling ----------------------------------------------------------------------------------


# Event types an endpoint receives without naming them, because it subscribed to another: a merchant that
# handles payment.completed must hear of a buyer charged twice for one intent (docs/webhooks.md).
IMPLIED_BY: dict[str, str] = {"payment.duplicate": "payment.completed"}


def subscribed(events: Sequence[str] | None, event_type: str) -> bool:
    """Whether an endpoint subscribed to ``events`` receives ``event_type`` (named, or implied)."""
    events = events or ()
    return event_type in events or IMPLIED_BY.get(event_type, "") in events


def schedule_deliveries(event: Event, *, endpoint_id: str | None = None) -> int:
    """Add a pending delivery of ``event`` per subscribed live endpoint (or to ``endpoint_id`` only).

    Runs inside the transaction that writes the event, so the event and its deliveries commit
    together; workers are woken after that commit. ``IMPLIED_BY`` widens a subscription.
    """
    query = select(_endpoints.c.id, _endpoints.c.events).where(
        _endpoints.c.merchant_id == event.merchant_id, _endpoints.c.deleted_at.is_(None)
    )
    if endpoint_id is not None:
        query = query.where(_endpoints.c.id == endpoint_id)
    targets = [
        row.id for row in db.session.execute(query) if endpoint_id is not None or subscribed(row.events, event.type)
    ]
    if targets:
        db.session.flush()  # the event row first: deliveries reference it
    for target in targets:
        _add_delivery(target, event.merchant_id, event.id, event.type, event.created_at)
    return len(targets)


def _add_delivery(
    endpoint_id: str, merchant_id: str, event_id: str, event_type: str, now: datetime, replay_of: str | None = None
) -> str:
    delivery_id = prefixed_id("whd")
    db.session.execute(
        insert(_deliveries).values(
            id=delivery_id,
            endpoint_id=endpoint_id,
            merchant_id=merchant_id,
            event_id=event_id,
            event_type=event_type,
            status=wm.PENDING,
            attempt_count=0,
            next_attempt_at=now,
            replay_of=replay_of,
            created_at=now,
            updated_at=now,
        )
    )
    db.session.info[_WAKE_FLAG] = True
    return delivery_id


def _check_on_demand_backlog(endpoint_id: str, now: datetime) -> None:
    """409 TOO_MANY_PENDING_DELIVERIES when the endpoint's pending test and replayed deliveries reach the cap."""
    pending = db.session.scalar(
        select(func.count())
        .select_from(_deliveries)
        .where(
            _deliveries.c.endpoint_id == endpoint_id,
            _deliveries.c.created_at >= now - _ON_DEMAND_WINDOW,
            _deliveries.c.status == wm.PENDING,
            or_(_deliveries.c.event_id.startswith("evt_test_", autoescape=True), _deliveries.c.replay_of.is_not(None)),
        )
    )
    if (pending or 0) >= MAX_PENDING_ON_DEMAND_PER_ENDPOINT:
        raise DomainError(
            "TOO_MANY_PENDING_DELIVERIES",
            f"{MAX_PENDING_ON_DEMAND_PER_ENDPOINT} test or replayed deliveries to this endpoint are still pending; "
            "send more once they have been delivered or have failed",
        )


def replay_delivery(merchant_id: str, delivery_id: str) -> str:
    """Send a delivery's event again to the same endpoint (same event id) as a new delivery."""
    original = get_delivery_row(merchant_id, delivery_id)
    endpoint = db.session.get(WebhookEndpoint, original.endpoint_id)
    if endpoint is None or endpoint.deleted_at is not None:
        raise DomainError("WEBHOOK_DELETED", "The delivery's webhook endpoint was deleted; nothing to replay to")
    _check_on_demand_backlog(original.endpoint_id, clock.now())
    new_id = _add_delivery(
        original.endpoint_id, merchant_id, original.event_id, original.event_type, clock.now(), replay_of=original.id
    )
    db.session.commit()
    return new_id


def send_test_event(merchant_id: str, webhook_id: str, event_type: str) -> tuple[str, str]:
    """Deliver a simulated event of ``event_type`` to one endpoint; returns (delivery_id, event_id)."""
    get_endpoint(merchant_id, webhook_id)
    _check_on_demand_backlog(webhook_id, clock.now())
    event = record_event(
        merchant_id, event_type, sample_data(event_type, clock.now()), simulated=True, endpoint_id=webhook_id
    )
    db.session.flush()
    delivery_id = db.session.scalar(select(_deliveries.c.id).where(_deliveries.c.event_id == event.id))
    if delivery_id is None:  # the endpoint was deleted meanwhile
        db.session.rollback()
        raise not_found("Webhook endpoint")
    db.session.commit()
    return delivery_id, event.id


def wake_requested(session: Session) -> bool:
    """Whether the transaction ``session`` just ended scheduled deliveries (and forget it): the after-commit
    and after-rollback listeners that ``backend.webhooks.tasks.init_app`` registers on the app's session."""
    return bool(session.info.pop(_WAKE_FLAG, False))


# --- delivering ----------------------------------------------------------------------------------

# Claims: backend.webhooks.claims. Recording an attempt runs two statements, built once.
_CANCELLED = _deliveries.c.status == wm.CANCELLED
# Records an attempt if the lease is still ours. An endpoint deleted while the attempt was in flight
# leaves the delivery cancelled (the attempt is still logged).
_RECORD = (
    update(_deliveries)
    .where(_deliveries.c.id == bindparam("delivery_id"), _deliveries.c.lease_token == bindparam("token"))
    .values(
        attempt_count=bindparam("number"),
        lease_token=None,
        lease_expires_at=None,
        last_status_code=bindparam("code"),
        last_error=bindparam("error"),
        updated_at=bindparam("now", type_=UTCDateTime()),
        status=case((_CANCELLED, wm.CANCELLED), else_=bindparam("new_status")),
        # (a cancelled delivery's columns are kept: its next_attempt_at is already NULL)
        next_attempt_at=case(
            (_CANCELLED, _deliveries.c.next_attempt_at), else_=bindparam("next_at", type_=UTCDateTime())
        ),
        finished_at=case((_CANCELLED, _deliveries.c.finished_at), else_=bindparam("finished", type_=UTCDateTime())),
    )
)
_INSERT_ATTEMPT = insert(_attempts)


def _clean(text: str | None, limit: int) -> str | None:
    """Receiver-supplied text fit for any database column: no NUL, bounded length."""
    return None if text is None else text.replace("\x00", "\ufffd")[:limit]


def record_attempt(claimed: ClaimedDelivery, attempted_at: datetime, result: transport.SendResult) -> bool:
    """Write the attempt and the delivery's next state; False if the lease was lost meanwhile."""
    number = claimed.attempt_count + 1
    now = clock.now()
    delay = next_attempt_delay(number)
    if result.succeeded or delay is None:
        status, next_at, finished = (wm.SUCCEEDED if result.succeeded else wm.FAILED), None, now
    else:
        status, next_at, finished = wm.PENDING, attempted_at + timedelta(seconds=delay), None
    error = _clean(result.error, 500)
    updated = db.session.execute(
        _RECORD,
        {"delivery_id": claimed.id, "token": claimed.lease_token, "number": number, "code": result.status_code,
         "error": error, "now": now, "new_status": status, "next_at": next_at, "finished": finished},
    )  # fmt: skip
    if rowcount(updated) != 1:
        db.session.rollback()
        log.warning("webhook delivery %s: lease lost before attempt %d was recorded", claimed.id, number)
        return False
    db.session.execute(
        _INSERT_ATTEMPT,
        {"delivery_id": claimed.id, "number": number, "attempted_at": attempted_at, "succeeded": result.succeeded,
         "status_code": result.status_code, "latency_ms": result.latency_ms, "error": error,
         "response_body": _clean(result.response_body, transport.RESPONSE_EXCERPT_BYTES)},
    )  # fmt: skip
    try:
        db.session.commit()
    except IntegrityError:
        db.session.rollback()
        log.warning("webhook delivery %s: attempt %d was already recorded", claimed.id, number)
        return False
    return True


def deliver_one(
    *,
    allow_private: bool,
    deadline: float = transport.DEADLINE_SECONDS,
    on_claim: Callable[[], None] | None = None,
    merchant_cap: int = DEFAULT_MAX_IN_FLIGHT_PER_MERCHANT,
    dns_timeout: float = transport.DNS_TIMEOUT_SECONDS,
) -> bool:
    """Claim, sign, send and record one due delivery; False when nothing could be claimed.

    ``on_claim`` runs right after a claim, before sending (the dispatcher wakes another sender there).
    """
    claimed = claim_due(clock.now(), merchant_cap)
    if claimed is None:
        return False
    if on_claim is not None:
        on_claim()
    attempted_at = clock.now()
    body = claimed.payload.encode("utf-8")
    headers = signature_headers(claimed.secret, claimed.event_id, body, int(attempted_at.timestamp()))
    try:
        result = transport.post(
            claimed.url,
            body,
            headers,
            allow_private=allow_private,
            deadline=deadline,
            dns_timeout=dns_timeout,
            owner=claimed.merchant_id,
        )
    except Exception as exc:  # a bug or an odd answer must cost one attempt, not loop forever
        log.exception("webhook delivery %s: sending failed unexpectedly", claimed.id)
        result = transport.SendResult(False, None, 0, f"internal error: {type(exc).__name__}", None)
    record_attempt(claimed, attempted_at, result)
    log.info(
        "webhook delivery %s attempt %d: %s (%d ms)",
        claimed.id,
        claimed.attempt_count + 1,
        "ok" if result.succeeded else (result.error or "failed"),
        result.latency_ms,
    )
    return True


def deliver_due(
    *,
    allow_private: bool,
    deadline: float = transport.DEADLINE_SECONDS,
    limit: int = 10_000,
    merchant_cap: int = DEFAULT_MAX_IN_FLIGHT_PER_MERCHANT,
    dns_timeout: float = transport.DNS_TIMEOUT_SECONDS,
) -> int:
    """Deliver due deliveries one after another until none is due; returns how many were attempted."""
    sent = 0
    while sent < limit and deliver_one(
        allow_private=allow_private, deadline=deadline, merchant_cap=merchant_cap, dns_timeout=dns_timeout
    ):
        sent += 1
    return sent


def delivery_counts() -> dict[str, int]:
    """Deliveries by status, all endpoints (for /metrics)."""
    rows = db.session.execute(select(_deliveries.c.status, func.count()).group_by(_deliveries.c.status))
    return {status: count for status, count in rows}


def oldest_due_at(now: datetime) -> datetime | None:
    """When the longest-waiting due delivery (pending, due, not leased) fell due; None if none waits."""
    return db.session.execute(select(func.min(_deliveries.c.next_attempt_at)).where(*due(now))).scalar()


# --- logs ----------------------------------------------------------------------------------------


def get_delivery_row(merchant_id: str, delivery_id: str) -> Any:
    row = db.session.execute(
        select(_deliveries).where(_deliveries.c.id == delivery_id, _deliveries.c.merchant_id == merchant_id)
    ).first()
    if row is None:
        raise not_found("Webhook delivery")
    return row


def delivery_to_dict(row: Mapping[Any, Any]) -> dict[str, Any]:
    iso = clock.isoformat
    return {
        "delivery_id": row["id"],
        "webhook_id": row["endpoint_id"],
        "event_id": row["event_id"],
        "event": row["event_type"],
        "status": row["status"],
        "attempt_count": row["attempt_count"],
        "next_attempt_at": iso(row["next_attempt_at"]),
        "last_status_code": row["last_status_code"],
        "last_error": row["last_error"],
        "replay_of": row["replay_of"],
        "created_at": iso(row["created_at"]),
        "finished_at": iso(row["finished_at"]),
    }


def list_deliveries(
    merchant_id: str,
    *,
    webhook_id: str | None = None,
    event_id: str | None = None,
    status: str | None = None,
    limit: int = 20,
    offset: int = 0,
) -> tuple[list[dict[str, Any]], int]:
    """A page of the merchant's deliveries, newest first, with the total matching the filters."""
    conditions = [_deliveries.c.merchant_id == merchant_id]
    if webhook_id is not None:
        conditions.append(_deliveries.c.endpoint_id == webhook_id)
    if event_id is not None:
        conditions.append(_deliveries.c.event_id == event_id)
    if status is not None:
        conditions.append(_deliveries.c.status == status)
    total = db.session.scalar(select(func.count()).select_from(_deliveries).where(*conditions)) or 0
    rows = db.session.execute(
        select(_deliveries)
        .where(*conditions)
        .order_by(_deliveries.c.created_at.desc(), _deliveries.c.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return [delivery_to_dict(r._mapping) for r in rows], total


# A delivery with its event's payload and its attempts (a row each, oldest first; one row of NULLs if none yet).
_ATTEMPT_COLUMNS = ("number", "attempted_at", "succeeded", "status_code", "latency_ms", "error", "response_body")
_DELIVERY_WITH_ATTEMPTS = (
    select(
        _deliveries,
        _events.c.payload.label("event_payload"),
        *(_attempts.c[name].label(f"attempt_{name}") for name in _ATTEMPT_COLUMNS),
    )
    .select_from(
        _deliveries.outerjoin(_events, _events.c.id == _deliveries.c.event_id).outerjoin(
            _attempts, _attempts.c.delivery_id == _deliveries.c.id
        )
    )
    .order_by(_attempts.c.number)
)


def get_delivery(merchant_id: str, delivery_id: str) -> dict[str, Any]:
    """One delivery with its attempts (oldest first) and the envelope it sends. One statement, so one snapshot
    on either engine: the delivery's status and attempt count always agree with the attempts listed (a worker
    records an attempt and the delivery's next state in one commit)."""
    rows = db.session.execute(
        _DELIVERY_WITH_ATTEMPTS.where(_deliveries.c.id == delivery_id, _deliveries.c.merchant_id == merchant_id)
    ).all()
    if not rows:
        raise not_found("Webhook delivery")
    first = rows[0]._mapping
    data = delivery_to_dict(first)
    data["payload"] = strict_loads(first["event_payload"]) if first["event_payload"] else None
    data["attempts"] = [
        {
            "number": a.attempt_number,
            "attempted_at": clock.isoformat(a.attempt_attempted_at),
            "succeeded": a.attempt_succeeded,
            "status_code": a.attempt_status_code,
            "latency_ms": a.attempt_latency_ms,
            "error": a.attempt_error,
            "response_body": a.attempt_response_body,
        }
        for a in rows
        if a.attempt_number is not None
    ]
    return data
