"""Dashboard sessions, CSRF tokens and the login throttle.

Sessions are Flask's signed cookie (SECRET_KEY), HttpOnly, SameSite=Lax, Secure whenever the
request arrived over HTTPS (behind a TLS-terminating proxy that needs ProxyFix so Flask sees
https). A session holds the merchant id, a random session id, when it was started and the CSRF
token; logging in starts a new one (the old contents, CSRF token included, are discarded), and
logging out remembers the session id as ended until the session could have expired anyway, so a
copied cookie stops working too. Sessions end 12 hours after log-in whatever the activity.

The login throttle counts failures in ``backend.ephemeral`` (Redis, shared by every API process):

- per email and client address: 5 failures in 15 minutes lock that pair for the rest of the window;
- per email from every address: 10 failures in 15 minutes lock the email for the rest of the window,
  so an attacker with many addresses gets at most 10 guesses per 15 minutes at one account. That
  limit is one anyone can trip for any email, so it does not apply to a browser that has logged in
  to that account before: a successful log-in leaves a signed device cookie (``payintent_device``,
  90 days, bound to the email), which exempts that browser from the per-email limit until 5 failures
  are made with it (a stolen device cookie does not buy unlimited guesses either). An attack can
  therefore lock the owner out only on a browser never used for this account, and only while it
  lasts plus 15 minutes. A successful log-in does not reset the per-email count (it would forgive an
  attacker's guesses whenever the owner logs in).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from urllib.parse import urlsplit

from flask import Flask, current_app, request, session
from flask.sessions import SecureCookieSessionInterface
from itsdangerous import BadSignature, URLSafeTimedSerializer
from werkzeug.wrappers import Response

from backend import clock
from backend.ephemeral import store

SESSION_MAX_AGE = timedelta(hours=12)
CSRF_FIELD = "csrf_token"
LOGIN_MAX_FAILURES = 5  # per email and client address, and per device cookie
LOGIN_WINDOW_SECONDS = 15 * 60
ACCOUNT_MAX_FAILURES = 10  # per email from every address (browsers with its device cookie excepted)
ACCOUNT_WINDOW_SECONDS = 15 * 60
DEVICE_COOKIE = "payintent_device"
DEVICE_MAX_AGE = timedelta(days=90)

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


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _normal(email: str) -> str:
    return email.strip().lower()


def _login_key(email: str, ip: str) -> str:
    return f"login-failures:{_digest(_normal(email), ip)}"


def _account_key(email: str) -> str:
    return f"login-account-failures:{_digest(_normal(email))}"


def _device_key(device_id: str) -> str:
    return f"login-device-failures:{_digest(device_id)}"


def _device_serializer() -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(current_app.secret_key, salt="payintent.dashboard.login-device")  # type: ignore[arg-type]


def _email_tag(email: str) -> str:
    """The email as the device cookie names it: keyed, so the cookie does not tell whose account it is."""
    key = str(current_app.secret_key).encode()
    return hmac.new(key, f"login-device\n{_normal(email)}".encode(), hashlib.sha256).hexdigest()[:32]


def _device(email: str) -> str | None:
    """The id of this browser's device cookie if it is valid and was issued for ``email``."""
    value = request.cookies.get(DEVICE_COOKIE)
    if not value or len(value) > 512:
        return None
    try:
        payload = _device_serializer().loads(value, max_age=int(DEVICE_MAX_AGE.total_seconds()))
    except BadSignature:  # also a cookie older than DEVICE_MAX_AGE
        return None
    if not isinstance(payload, dict):
        return None
    device_id, tag = payload.get("d"), payload.get("e")
    if not (isinstance(device_id, str) and isinstance(tag, str)):
        return None
    return device_id if hmac.compare_digest(tag, _email_tag(email)) else None


def login_retry_after(email: str, ip: str) -> int | None:
    """Seconds until this email may try again from this address (and browser), or None when not throttled."""
    counters = store()
    failures, ttl = counters.count(_login_key(email, ip))
    if failures >= LOGIN_MAX_FAILURES:
        return ttl
    account_failures, account_ttl = counters.count(_account_key(email))
    if account_failures < ACCOUNT_MAX_FAILURES:
        return None
    device = _device(email)
    if device is not None and counters.count(_device_key(device))[0] < LOGIN_MAX_FAILURES:
        return None  # a browser this account logged in from before is not locked out by others' failures
    return account_ttl


def record_login_failure(email: str, ip: str) -> None:
    counters = store()
    counters.incr(_login_key(email, ip), LOGIN_WINDOW_SECONDS)
    counters.incr(_account_key(email), ACCOUNT_WINDOW_SECONDS)
    device = _device(email)
    if device is not None:
        counters.incr(_device_key(device), LOGIN_WINDOW_SECONDS)


def clear_login_failures(email: str, ip: str) -> None:
    """A successful log-in: this address's and this browser's failures are forgiven (not the per-email count)."""
    counters = store()
    counters.delete(_login_key(email, ip))
    device = _device(email)
    if device is not None:
        counters.delete(_device_key(device))


def remember_device(response: Response, email: str) -> None:
    """After a successful log-in: mark this browser as one the account uses (exempt from the per-email limit)."""
    device = _device(email) or secrets.token_urlsafe(16)
    response.set_cookie(
        DEVICE_COOKIE,
        _device_serializer().dumps({"d": device, "e": _email_tag(email)}),
        max_age=int(DEVICE_MAX_AGE.total_seconds()),
        path="/dashboard",
        secure=bool(request.is_secure),
        httponly=True,
        samesite="Lax",
    )
