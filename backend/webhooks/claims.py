"""Claiming due webhook deliveries: fair between merchants, leased so each attempt is sent once.

A delivery is due when it is ``pending``, its ``next_attempt_at`` has passed and no live lease holds
it. A claim leases one due delivery to the caller (a token and an expiry on the row); the attempt is
recorded only under that token (``services.record_attempt``), and a crashed worker's lease runs out.

Claims are fair between merchants: a merchant has at most WEBHOOK_MAX_IN_FLIGHT_PER_MERCHANT
attempts in flight (live leases) across all workers, an endpoint at most MAX_IN_FLIGHT_PER_ENDPOINT,
and a claim serves the merchant with the fewest in flight first, then its least busy endpoint, then
the oldest due delivery. So one merchant's slow, dead or unresolvable endpoints and their backlog
hold a few senders, never all of them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, bindparam, func, or_, select, update

from backend.events.models import Event
from backend.extensions import UTCDateTime, db
from backend.webhooks import models as wm
from backend.webhooks.models import WebhookDelivery, WebhookEndpoint

# Longer than any attempt can take (10 s deadline, DB writes); a crashed worker's delivery is due again after it.
LEASE_SECONDS = 60
# At most this many attempts of one merchant are in flight at once, across all workers (the default of
# WEBHOOK_MAX_IN_FLIGHT_PER_MERCHANT; keep it below the sender count), so a merchant whose endpoints are
# slow or dead, fed a backlog of test events, occupies a few senders and every other merchant is served.
DEFAULT_MAX_IN_FLIGHT_PER_MERCHANT = 2
# ... and to one endpoint (when the merchant's cap is higher than this).
MAX_IN_FLIGHT_PER_ENDPOINT = 4
# PostgreSQL advisory lock class (with hashtext(merchant_id)): one claim of a merchant's deliveries at a time.
_CLAIM_LOCK_CLASS = 0x5748
_CLAIM_TRIES = 8

_deliveries = WebhookDelivery.__table__
_endpoints = WebhookEndpoint.__table__
_events = Event.__table__


@dataclass(frozen=True)
class ClaimedDelivery:
    id: str
    lease_token: str
    attempt_count: int
    event_id: str
    url: str
    secret: str
    payload: str
    merchant_id: str | None = None


def due(now: Any) -> Any:
    """The conditions that make a delivery due at ``now``."""
    return (
        _deliveries.c.status == wm.PENDING,
        _deliveries.c.next_attempt_at <= now,
        or_(_deliveries.c.lease_expires_at.is_(None), _deliveries.c.lease_expires_at < now),
    )


# The delivery hot path: statements built once (bind parameters only); a claim runs two (three on PostgreSQL).
_NOW = bindparam("now", type_=UTCDateTime())
_MERCHANT_CAP = bindparam("merchant_cap", type_=Integer())
# Attempts in flight: live leases (a finished attempt clears its lease; a crashed worker's runs out).
_leased = _deliveries.alias("leased")
_LIVE = (_leased.c.lease_expires_at > _NOW, _leased.c.status == wm.PENDING)
_MERCHANT_LOAD = (
    select(_leased.c.merchant_id, func.count().label("n")).where(*_LIVE).group_by(_leased.c.merchant_id)
).subquery("merchant_load")
_ENDPOINT_LOAD = (
    select(_leased.c.endpoint_id, func.count().label("n")).where(*_LIVE).group_by(_leased.c.endpoint_id)
).subquery("endpoint_load")
_merchant_busy = func.coalesce(_MERCHANT_LOAD.c.n, 0)
_endpoint_busy = func.coalesce(_ENDPOINT_LOAD.c.n, 0)


def _fairest_due(*columns: Any) -> Any:
    """The due delivery to send next: of a live endpoint, its merchant and endpoint under their caps;
    the merchant with the fewest attempts in flight first, then its least busy endpoint, then the oldest."""
    return (
        select(*columns)
        .join(_endpoints, _endpoints.c.id == _deliveries.c.endpoint_id)
        .outerjoin(_MERCHANT_LOAD, _MERCHANT_LOAD.c.merchant_id == _deliveries.c.merchant_id)
        .outerjoin(_ENDPOINT_LOAD, _ENDPOINT_LOAD.c.endpoint_id == _deliveries.c.endpoint_id)
        .where(
            *due(_NOW),
            _endpoints.c.deleted_at.is_(None),
            _merchant_busy < _MERCHANT_CAP,
            _endpoint_busy < MAX_IN_FLIGHT_PER_ENDPOINT,
        )
        .order_by(_merchant_busy, _endpoint_busy, _deliveries.c.next_attempt_at, _deliveries.c.id)
        .limit(1)
        .with_for_update(of=_deliveries, skip_locked=True)
    )


_LEASE_VALUES = {"lease_token": bindparam("token"), "lease_expires_at": bindparam("lease_until", type_=UTCDateTime())}
_LEASED = (_deliveries.c.id, _deliveries.c.attempt_count, _deliveries.c.event_id, _deliveries.c.endpoint_id,
           _deliveries.c.merchant_id)  # fmt: skip
# SQLite: one statement picks and leases, under the database's write lock (claims run one at a time).
_CLAIM = (
    update(_deliveries)
    .where(_deliveries.c.id == _fairest_due(_deliveries.c.id).scalar_subquery(), *due(_NOW))
    .values(**_LEASE_VALUES)
    .returning(*_LEASED)
)
# PostgreSQL: claims run concurrently (READ COMMITTED, SKIP LOCKED), so counting leases in the claim's
# own snapshot could let two senders both take a merchant's last slot. The candidate is picked and
# row-locked first; then the merchant's advisory lock is taken (claims of one merchant queue there for
# a moment) and the lease is written only if a fresh count, which sees every earlier claim of that
# merchant as committed, still leaves room.
_CANDIDATE = _fairest_due(_deliveries.c.id, _deliveries.c.merchant_id)
_MERCHANT_LOCK = select(func.pg_advisory_xact_lock(_CLAIM_LOCK_CLASS, func.hashtext(bindparam("merchant_id"))))
_merchant_in_flight = (
    select(func.count()).select_from(_leased).where(_leased.c.merchant_id == _deliveries.c.merchant_id, *_LIVE)
).scalar_subquery()
_endpoint_in_flight = (
    select(func.count()).select_from(_leased).where(_leased.c.endpoint_id == _deliveries.c.endpoint_id, *_LIVE)
).scalar_subquery()
_LEASE = (
    update(_deliveries)
    .where(
        _deliveries.c.id == bindparam("candidate"),
        *due(_NOW),
        _merchant_in_flight < _MERCHANT_CAP,
        _endpoint_in_flight < MAX_IN_FLIGHT_PER_ENDPOINT,
    )
    .values(**_LEASE_VALUES)
    .returning(*_LEASED)
)
_SENDING = select(
    _endpoints.c.url,
    _endpoints.c.secret,
    select(_events.c.payload).where(_events.c.id == bindparam("event_id")).scalar_subquery().label("payload"),
).where(_endpoints.c.id == bindparam("endpoint_id"))


def claim_due(now: datetime, merchant_cap: int = DEFAULT_MAX_IN_FLIGHT_PER_MERCHANT) -> ClaimedDelivery | None:
    """Lease the fairest due delivery (see ``_fairest_due``) to this caller, or None when nothing is due.

    Deliveries of deleted endpoints are skipped, and so are merchants with ``merchant_cap`` live
    leases and endpoints with MAX_IN_FLIGHT_PER_ENDPOINT, counted across all workers.
    """
    token = uuid.uuid4().hex
    params = {"now": now, "token": token, "lease_until": now + timedelta(seconds=LEASE_SECONDS),
              "merchant_cap": max(1, merchant_cap)}  # fmt: skip
    if db.session.get_bind().dialect.name == "postgresql":
        leased = _lease_serialised_per_merchant(params)
    else:
        leased = db.session.execute(_CLAIM, params).first()
    if leased is None:
        db.session.rollback()
        return None
    row = db.session.execute(_SENDING, {"endpoint_id": leased.endpoint_id, "event_id": leased.event_id}).one()
    db.session.commit()
    return ClaimedDelivery(
        leased.id, token, leased.attempt_count, leased.event_id, row.url, row.secret, row.payload, leased.merchant_id
    )


def _lease_serialised_per_merchant(params: dict[str, Any]) -> Any:
    """PostgreSQL's claim (see ``_LEASE``); the leased row, or None when nothing can be claimed."""
    for _ in range(_CLAIM_TRIES):
        candidate = db.session.execute(_CANDIDATE, params).first()
        if candidate is None:
            return None
        db.session.execute(_MERCHANT_LOCK, {"merchant_id": candidate.merchant_id})
        leased = db.session.execute(_LEASE, {**params, "candidate": candidate.id}).first()
        if leased is not None:
            return leased
        db.session.rollback()  # another sender took the merchant's last slot meanwhile: pick again
    return None
