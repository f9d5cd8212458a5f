"""Secrets the dashboard shows once (a new API key, a webhook signing secret), kept on the server.

The POST that makes a secret stores it here and puts only a random handle in the session; the next
page rendered by a GET takes it (the row is deleted) and shows it. The session is Flask's signed, not
encrypted, cookie: whatever it holds can be read from Set-Cookie headers in proxy logs, from the
browser's cookie store and from old copies of the cookie, so a secret must never travel in it.

- The table is shared by every API process (any worker may serve the page after the POST) and needs
  no Redis. Its id is a hash of the handle, and the secret is encrypted with a key derived from the
  handle, so the database alone (a backup, a replica) does not hold a usable key, and neither does
  the cookie alone; once shown, the row is gone and the handle is worthless.
- A secret belongs to the merchant and the login session that made it: presenting its handle in
  another session shows nothing (and uses it up), and logging out deletes the session's secrets.
- A secret not shown within ``REVEAL_TTL`` is never shown; expired rows are deleted by the next store.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import TypedDict

from sqlalchemy import delete

from backend import clock
from backend.dashboard.models import PendingReveal
from backend.extensions import db

REVEAL_TTL = timedelta(minutes=5)
_HANDLE_LENGTH = 43  # secrets.token_urlsafe(32)


class Reveal(TypedDict):
    kind: str
    secret: str
    subject: str


def _derive(label: bytes, handle: str, size: int) -> bytes:
    return hashlib.shake_256(b"payintent dashboard reveal\x00" + label + b"\x00" + handle.encode()).digest(size)


def _row_id(handle: str) -> str:
    return _derive(b"id", handle, 32).hex()


def _session_hash(session_id: str) -> str:
    return hashlib.sha256(f"payintent dashboard session\x00{session_id}".encode()).hexdigest()


def _crypt(handle: str, data: bytes) -> bytes:
    """XOR with a keystream derived from the handle: encrypts and decrypts (each handle protects one secret)."""
    stream = _derive(b"key", handle, len(data))
    return bytes(a ^ b for a, b in zip(data, stream, strict=True))


def store(merchant_id: str, session_id: str, kind: str, secret: str, subject: str) -> str:
    """Keep ``secret`` for one showing in this merchant's session; returns the handle for the session."""
    handle = secrets.token_urlsafe(32)
    now = clock.now()
    db.session.execute(delete(PendingReveal).where(PendingReveal.expires_at <= now))
    db.session.add(
        PendingReveal(
            id=_row_id(handle),
            merchant_id=merchant_id,
            session_hash=_session_hash(session_id),
            kind=kind,
            subject=subject,
            ciphertext=_crypt(handle, secret.encode()),
            expires_at=now + REVEAL_TTL,
        )
    )
    db.session.commit()
    return handle


def take(handle: object, merchant_id: str, session_id: str) -> Reveal | None:
    """The secret behind ``handle`` if it is this merchant's, from this session and not expired; then never again."""
    if not isinstance(handle, str) or len(handle) != _HANDLE_LENGTH:
        return None
    # DELETE ... RETURNING: of two requests presenting the handle at once, only one gets the row.
    row = db.session.execute(
        delete(PendingReveal)
        .where(PendingReveal.id == _row_id(handle))
        .returning(
            PendingReveal.merchant_id,
            PendingReveal.session_hash,
            PendingReveal.kind,
            PendingReveal.subject,
            PendingReveal.ciphertext,
            PendingReveal.expires_at,
        )
    ).first()
    db.session.commit()
    if row is None or row.merchant_id != merchant_id or row.session_hash != _session_hash(session_id):
        return None
    if row.expires_at <= clock.now():
        return None
    secret = _crypt(handle, row.ciphertext).decode("utf-8", "replace")
    return {"kind": row.kind, "secret": secret, "subject": row.subject}


def discard(handle: object) -> None:
    """Forget the secret behind ``handle`` unshown (another secret replaces it in the session)."""
    if isinstance(handle, str) and len(handle) == _HANDLE_LENGTH:
        db.session.execute(delete(PendingReveal).where(PendingReveal.id == _row_id(handle)))
        db.session.commit()


def forget_session(session_id: str) -> None:
    """Logging out: the session's secrets that were never shown are deleted."""
    db.session.execute(delete(PendingReveal).where(PendingReveal.session_hash == _session_hash(session_id)))
    db.session.commit()
