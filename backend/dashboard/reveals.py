"""Secrets the dashboard shows once (a new API key, a webhook signing secret), kept on the server.

The POST that makes a secret stores it here and puts only a random handle in the session; the next
page rendered by a GET takes it (the row is deleted) and shows it. The session is Flask's signed, not
encrypted, cookie: whatever it holds can be read from Set-Cookie headers in proxy logs, from the
browser's cookie store and from old copies of the cookie, so a secret must never travel in it.

- The table is shared by every API process (any worker may serve the page after the POST) and needs
  no Redis. Its id is a hash of the handle, and the secret is encrypted with a key derived from the
  handle, so the database alone (a backup, a replica) does not hold a usable key, and neither does
  the cookie alone; once shown, the row is gone and the handle is worthless.
- The row carries an HMAC-SHA256 tag, keyed by another key derived from the handle, over its id,
  merchant, session, kind, subject and ciphertext, checked (in constant time) before anything is
  decrypted: someone who can write to the database but does not hold the handle cannot flip bits of
  the secret or relabel it (show an API key as "the signing secret of https://evil.example/"); a
  row that fails the check shows nothing.
- A secret belongs to the merchant and the login session that made it: presenting its handle in
  another session shows nothing (and uses it up), and logging out deletes the session's secrets.
- A secret not shown within ``REVEAL_TTL`` is never shown. Expired rows are deleted whenever a secret
  is stored or taken, at every logout, and by the worker's sweep (``purge_expired``), so one never
  shown does not wait for the next merchant's activity.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from datetime import timedelta
from typing import TypedDict

from sqlalchemy import delete

from backend import clock
from backend.dashboard.models import PendingReveal
from backend.extensions import db, rowcount

log = logging.getLogger(__name__)

REVEAL_TTL = timedelta(minutes=5)
_HANDLE_LENGTH = 43  # secrets.token_urlsafe(32)
_TAG_LENGTH = 32  # HMAC-SHA256, stored before the ciphertext in the same column


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


def _tag(handle: str, row_id: str, merchant_id: str, session_hash: str, kind: str, subject: str, ct: bytes) -> bytes:
    """HMAC-SHA256 over the row's fields, each length-prefixed (no two field lists give the same message)."""
    message = b"".join(
        len(part).to_bytes(8, "big") + part
        for part in (row_id.encode(), merchant_id.encode(), session_hash.encode(), kind.encode(), subject.encode(), ct)
    )
    return hmac.new(_derive(b"mac", handle, 32), message, hashlib.sha256).digest()


def _delete_expired() -> None:
    db.session.execute(delete(PendingReveal).where(PendingReveal.expires_at <= clock.now()))


def store(merchant_id: str, session_id: str, kind: str, secret: str, subject: str) -> str:
    """Keep ``secret`` for one showing in this merchant's session; returns the handle for the session."""
    handle = secrets.token_urlsafe(32)
    row_id, session_hash = _row_id(handle), _session_hash(session_id)
    ciphertext = _crypt(handle, secret.encode())
    _delete_expired()
    db.session.add(
        PendingReveal(
            id=row_id,
            merchant_id=merchant_id,
            session_hash=session_hash,
            kind=kind,
            subject=subject,
            ciphertext=_tag(handle, row_id, merchant_id, session_hash, kind, subject, ciphertext) + ciphertext,
            expires_at=clock.now() + REVEAL_TTL,
        )
    )
    db.session.commit()
    return handle


def take(handle: object, merchant_id: str, session_id: str) -> Reveal | None:
    """The secret behind ``handle`` if it is this merchant's, from this session and not expired; then never again."""
    if not isinstance(handle, str) or len(handle) != _HANDLE_LENGTH:
        return None
    row_id = _row_id(handle)
    # DELETE ... RETURNING: of two requests presenting the handle at once, only one gets the row.
    row = db.session.execute(
        delete(PendingReveal)
        .where(PendingReveal.id == row_id)
        .returning(
            PendingReveal.merchant_id,
            PendingReveal.session_hash,
            PendingReveal.kind,
            PendingReveal.subject,
            PendingReveal.ciphertext,
            PendingReveal.expires_at,
        )
    ).first()
    _delete_expired()
    db.session.commit()
    if row is None or row.merchant_id != merchant_id or row.session_hash != _session_hash(session_id):
        return None
    if row.expires_at <= clock.now():
        return None
    stored = bytes(row.ciphertext)
    tag, ciphertext = stored[:_TAG_LENGTH], stored[_TAG_LENGTH:]
    expected = _tag(handle, row_id, row.merchant_id, row.session_hash, row.kind, row.subject, ciphertext)
    if len(stored) <= _TAG_LENGTH or not hmac.compare_digest(tag, expected):
        log.warning("dashboard reveal %s failed its integrity check: not shown", row_id[:12])
        return None
    secret = _crypt(handle, ciphertext).decode("utf-8", "replace")
    return {"kind": row.kind, "secret": secret, "subject": row.subject}


def discard(handle: object) -> None:
    """Forget the secret behind ``handle`` unshown (another secret replaces it in the session)."""
    if isinstance(handle, str) and len(handle) == _HANDLE_LENGTH:
        db.session.execute(delete(PendingReveal).where(PendingReveal.id == _row_id(handle)))
        db.session.commit()


def forget_session(session_id: str) -> None:
    """Logging out: the session's secrets that were never shown are deleted (and anyone's expired ones)."""
    db.session.execute(delete(PendingReveal).where(PendingReveal.session_hash == _session_hash(session_id)))
    _delete_expired()
    db.session.commit()


def purge_expired() -> int:
    """The worker's sweep: delete every secret whose time to be shown has passed; returns how many."""
    deleted = rowcount(db.session.execute(delete(PendingReveal).where(PendingReveal.expires_at <= clock.now())))
    db.session.commit()
    return int(deleted or 0)
