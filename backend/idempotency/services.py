"""Idempotency keys: a retry with the same key and body gets the first response back.

The record is written in the same transaction as the object it created, so a retry either
finds the committed response or creates the object itself; never both, never neither.
Keys are kept for 24 hours (as card APIs do), scoped to the merchant.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select

from backend import clock
from backend.errors import DomainError
from backend.extensions import db, rowcount
from backend.idempotency.models import IdempotencyRecord
from backend.jsonio import dumps

HEADER = "Idempotency-Key"
TTL = timedelta(hours=24)
MAX_KEY_LENGTH = 255


def validate_key(raw: str | None) -> str | None:
    if raw is None:
        return None
    key = raw.strip()
    if not key or len(key) > MAX_KEY_LENGTH or not key.isascii() or not key.isprintable():
        raise DomainError(
            "INVALID_IDEMPOTENCY_KEY",
            f"{HEADER} must be 1 to {MAX_KEY_LENGTH} printable ASCII characters",
        )
    return key


def fingerprint(endpoint: str, payload: Any) -> str:
    """A hash of the parsed request, so formatting differences do not matter."""
    canonical = dumps({"endpoint": endpoint, "payload": payload}, sort_keys=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def find_response(merchant_id: str, endpoint: str, key: str, request_hash: str) -> tuple[int, str] | None:
    """The stored (status, body) for this key, or ``None`` if the key is new (or has expired).

    Raises 422 ``IDEMPOTENCY_KEY_REUSED`` when the key was used for a different request.
    """
    record = db.session.scalar(
        select(IdempotencyRecord).where(IdempotencyRecord.merchant_id == merchant_id, IdempotencyRecord.key == key)
    )
    if record is None:
        return None
    if clock.now() - record.created_at >= TTL:
        db.session.delete(record)
        db.session.commit()
        return None
    if record.endpoint != endpoint or record.request_hash != request_hash:
        raise DomainError(
            "IDEMPOTENCY_KEY_REUSED",
            f"This {HEADER} was already used with a different request; use a new key for a new request",
        )
    return record.response_status, record.response_body


def remember_response(merchant_id: str, endpoint: str, key: str, request_hash: str, status: int, body: str) -> None:
    """Add the record to the current transaction (commit it with the created object)."""
    db.session.add(
        IdempotencyRecord(
            merchant_id=merchant_id,
            key=key,
            endpoint=endpoint,
            request_hash=request_hash,
            response_status=status,
            response_body=body,
            created_at=clock.now(),
        )
    )


def purge_expired() -> int:
    result = db.session.execute(delete(IdempotencyRecord).where(IdempotencyRecord.created_at < clock.now() - TTL))
    db.session.commit()
    return rowcount(result) or 0
