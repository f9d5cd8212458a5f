"""Dashboard sessions, CSRF tokens and the login throttle.

Sessions are Flask's signed cookie (SECRET_KEY), HttpOnly, SameSite=Lax, Secure whenever the
request arrived over HTTPS (behind a TLS-terminating proxy that needs ProxyFix so Flask sees
https). A session holds the merchant id, a random session id, when it was started and the CSRF
token; logging in starts a new one (the old contents, CSRF token included, are discarded), and
logging out remembers the session id as ended until the session could have expired anyway, so a
copied cookie stops working too. Sessions end 12 hours after log-in whatever the activity.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from urllib.parse import urlsplit

from flask import Flask, request, session
from flask.sessions import SecureCookieSessionInterface

from backend import clock
from backend.ephemeral import store

SESSION_MAX_AGE = timedelta(hours=12)
CSRF_FIELD = "csrf_token"
LOGIN_MAX_FAILURES = 5
LOGIN_WINDOW_SECONDS = 15 * 60

_MERCHANT = "merchant_id"
_SID = "sid"
_STARTED = "started_at"
_CSRF = "csrf"


class DashboardSessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions with the Secure flag set per request (https -> Secure)."""

    def get_cookie_secure(self, app: Flask) -> bool:
        return bool(request.is_secure) or super().get_cookie_secure(app)


# --- CSRF ----------------------------------------------------------------------------------------


def csrf_token() -> str:
    """This session's CSRF token (created on first use); every dashboard form carries it."""
    token = session.get(_CSRF)
    if not isinstance(token, str) or not token:
        token = session[_CSRF] = secrets.token_urlsafe(32)
    return token


def csrf_valid(submitted: str | None) -> bool:
    expected = session.get(_CSRF)
    if not isinstance(expected, str) or not expected or not submitted:
        return False
    return hmac.compare_digest(submitted.encode("utf-8"), expected.encode("utf-8"))


# --- sessions ------------------------------------------------------------------------------------


def _ended_key(sid: str) -> str:
    return f"ended-session:{sid}"


def start_session(merchant_id: str) -> None:
    """Log a merchant in: a fresh session (new id, new CSRF token) replaces whatever was there."""
    session.clear()
    session.permanent = True
    session[_MERCHANT] = merchant_id
    session[_SID] = secrets.token_urlsafe(24)
    session[_STARTED] = int(clock.now().timestamp())
    session[_CSRF] = secrets.token_urlsafe(32)


def end_session() -> None:
    """Log out: forget the session here and refuse its id from now on (until it would have expired)."""
    sid, started = session.get(_SID), session.get(_STARTED)
    if isinstance(sid, str) and isinstance(started, int):
        remaining = started + int(SESSION_MAX_AGE.total_seconds()) - int(clock.now().timestamp())
        if remaining > 0:
            store().set_flag(_ended_key(sid), remaining)
    session.clear()


def session_id() -> str | None:
    """The random id of this login session (None when not logged in)."""
    sid = session.get(_SID)
    return sid if isinstance(sid, str) and sid else None


def session_merchant_id() -> str | None:
    """The logged-in merchant's id, or None (no session, too old, or logged out)."""
    merchant_id, sid, started = session.get(_MERCHANT), session.get(_SID), session.get(_STARTED)
    if not (isinstance(merchant_id, str) and isinstance(sid, str) and isinstance(started, int)):
        return None
    age = clock.now().timestamp() - started
    if age > SESSION_MAX_AGE.total_seconds() or store().has_flag(_ended_key(sid)):
        session.clear()
        return None
    return merchant_id


def safe_next(target: str | None) -> str | None:
    """A post-login destination, only if it is a path inside the dashboard (no open redirect)."""
    if not target or len(target) > 2048 or "\\" in target or any(ord(c) < 0x20 for c in target):
        return None
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not (parts.path == "/dashboard" or parts.path.startswith("/dashboard/")):
        return None
    if any(segment in (".", "..") for segment in parts.path.split("/")):
        return None
    return target


# --- login throttle ------------------------------------------------------------------------------


def _login_key(email: str, ip: str) -> str:
    digest = hashlib.sha256(f"{email.strip().lower()}\n{ip}".encode()).hexdigest()
    return f"login-failures:{digest}"


def login_retry_after(email: str, ip: str) -> int | None:
    """Seconds until this email may try again from this address, or None when not throttled."""
    failures, ttl = store().count(_login_key(email, ip))
    return ttl if failures >= LOGIN_MAX_FAILURES else None


def record_login_failure(email: str, ip: str) -> None:
    store().incr(_login_key(email, ip), LOGIN_WINDOW_SECONDS)


def clear_login_failures(email: str, ip: str) -> None:
    store().delete(_login_key(email, ip))
