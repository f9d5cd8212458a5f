"""Dashboard sessions, CSRF tokens and the login throttle.

Sessions are Flask's signed cookie (SECRET_KEY), HttpOnly, SameSite=Lax, Secure whenever the
request arrived over HTTPS (behind a TLS-terminating proxy that needs ProxyFix so Flask sees
https). A session holds the merchant id, a random session id, when it was started and the CSRF
token; logging in starts a new one (the old contents, CSRF token included, are discarded), and
logging out remembers the session id as ended until the session could have expired anyway, so a
copied cookie stops working too. Sessions end 12 hours after log-in whatever the activity.

The login throttle counts in ``backend.ephemeral`` (Redis, shared by every API process). Every password
check counts first, whatever its outcome (``ratelimit.hit``, before any hash): ``DASHBOARD_LOGIN_ATTEMPTS_PER_MINUTE``
(default 30) per client address (log-ins and sign-ups; refused attempts too), ``ACCOUNT_MAX_ATTEMPTS`` (20) a
minute per account, and ``DEVICE_MAX_ATTEMPTS`` (10) per 15 minutes per device cookie and account; browsers
with the account's device cookie are counted apart, so others cannot use up the owner's. Then failures:

- per client address (an IPv4 address, an IPv6 /64: ``ratelimit.client_key``), over every email:
  ``DASHBOARD_LOGIN_FAILURES_PER_ADDRESS`` (default 10) in 15 minutes, so one address cannot spend the
  service-wide budget below alone;
- every email and address together: ``DASHBOARD_LOGIN_FAILURES_PER_MINUTE`` (default 60) failures a
  minute, then every other log-in waits for the next minute. A password spray (one common password
  tried once on each of many accounts, from many addresses) gets past none of the limits below; this
  one bounds it, at the price that a spray from many addresses can hold up new browsers' log-ins
  service-wide;
- per email and client address: 5 failures in 15 minutes lock that pair for the rest of the window;
- per email from every address: 10 failures in 15 minutes lock the email for the rest of the window,
  so an attacker with many addresses gets at most 10 guesses per 15 minutes at one account; and 30 in
  24 hours lock the account's password log-in (for browsers without its device cookie) for the rest of
  those 24 hours, so slow guessing that waits out each window stops at 30 a day, not 960.

Each attempt reserves its failure before the password is checked (an atomic increment; over the
limit it is refused and counts nowhere) and a success takes its reservation back, so simultaneous
guesses through any number of processes never get more password checks than the limits. The per-address
and service-wide limits come first, so a refused attempt creates no key for its email (made-up emails
cannot grow Redis), and a reservation taken back to 0 deletes its key.

All these failure limits can be tripped by others: the per-email and global ones by anyone, the per-address
ones by anyone behind the same address (an office NAT, a VPN exit). So a browser that has logged in to the
account before is exempt from them: a successful log-in leaves a signed device cookie (``payintent_device``,
90 days, naming up to 5 accounts by a keyed tag), and a browser holding it for this email is limited only by
its own counters: 5 failures and 10 attempts per 15 minutes for that account, and 10 failures per 15 minutes
for the account over all its device cookies together (stolen or freshly minted device cookies do not buy
unlimited guesses either; once spent, the browser is limited like any other). Its failures count against the
email and the address like any other, but not against the service-wide budget, which they never passed: else
a few accounts of an attacker's own, with cookies minted beforehand, would fill it from two addresses. An attack can
therefore lock the owner out only on a browser never used for this account, and only while it lasts plus 15
minutes (24 hours once the account has had 30 failures in a day). A success forgives no earlier failure (on
a shared address or a copied cookie they may be an attacker's): they expire with their window.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

from flask import Flask, Request, current_app, request, session
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface
from itsdangerous import BadSignature, URLSafeTimedSerializer
from werkzeug.wrappers import Response

from backend import appstate, clock, ratelimit
from backend.config import Settings
from backend.ephemeral import store

SESSION_MAX_AGE = timedelta(hours=12)
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"  # what the dashboard's scripts send the token in
LOGIN_MAX_FAILURES = 5  # per email and client address, and per device cookie
LOGIN_WINDOW_SECONDS = 15 * 60
ACCOUNT_MAX_FAILURES = 10  # per email from every address (browsers with its device cookie excepted)
ACCOUNT_WINDOW_SECONDS = 15 * 60
ACCOUNT_DAY_MAX_FAILURES = 30  # per email from every address over a day: the account's password log-in is locked
ACCOUNT_DAY_WINDOW_SECONDS = 24 * 3600
GLOBAL_WINDOW_SECONDS = 60  # DASHBOARD_LOGIN_FAILURES_PER_MINUTE counts over this window
ADDRESS_WINDOW_SECONDS = 15 * 60  # DASHBOARD_LOGIN_FAILURES_PER_ADDRESS counts over this window
ACCOUNT_MAX_ATTEMPTS = 20  # password checks per account per minute, successes included (per kind of browser)
DEVICE_MAX_ATTEMPTS = 10  # password checks per device cookie and account per 15 minutes, successes included
DEVICE_ACCOUNT_MAX_FAILURES = 10  # failures per account per 15 minutes over all its device cookies together
DEVICE_COOKIE = "payintent_device"
DEVICE_MAX_AGE = timedelta(days=90)
DEVICE_MAX_ACCOUNTS = 5  # accounts one browser's device cookie remembers (the most recent ones)
_DEVICE_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
_TAG = re.compile(r"[0-9a-f]{32}")

_MERCHANT = "merchant_id"
_SID = "sid"
_STARTED = "started_at"
_CSRF = "csrf"


class DashboardSessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions with the Secure flag set per request (https -> Secure)."""

    def get_cookie_secure(self, app: Flask) -> bool:
        return bool(request.is_secure) or super().get_cookie_secure(app)

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        # No session cookie (every API call): the empty session Flask would give, without first building the
        # cookie's signing serializer, which only reading a cookie needs.
        if app.secret_key and not request.cookies.get(self.get_cookie_name(app)):
            return self.session_class()
        return super().open_session(app, request)


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


class LoginThrottled(Exception):
    """Too many log-in attempts or failures (from this address, for this email, or everywhere): try again later."""

    def __init__(self, retry_after: int, message: str = "Too many failed attempts.") -> None:
        super().__init__(f"retry after {retry_after} s")
        self.retry_after = retry_after
        self.message = message


@dataclass(frozen=True)
class LoginAttempt:
    """An attempt the throttle let through: the counters it reserved (they hold its failure in advance)."""

    email: str
    ip: str
    reserved: tuple[str, ...]
    by_device: bool  # exempted by this browser's device cookie, which alone limits it


_FROM_ADDRESS = "Too many log-in attempts from your network."
_FAILED_FROM_ADDRESS = "Too many failed log-ins from your network."
_FAILED_EVERYWHERE = "Too many failed log-ins on this service right now."
_FAILED_FOR_EMAIL = "Too many failed attempts."
_FOR_ACCOUNT = "Too many log-ins to this account."


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _normal(email: str) -> str:
    return email.strip().lower()


def _login_key(email: str, ip: str) -> str:
    return f"login-failures:{_digest(_normal(email), ip)}"


def _account_key(email: str) -> str:
    return f"login-account-failures:{_digest(_normal(email))}"


def _account_day_key(email: str) -> str:
    return f"login-account-day-failures:{_digest(_normal(email))}"


def _address_key(ip: str) -> str:
    return f"login-address-failures:{_digest(ip)}"


_GLOBAL_KEY = "login-failures-everywhere"


def _settings() -> Settings:
    return appstate.settings()


def _shared_limits(email: str, ip: str) -> list[tuple[str, int, int, str]]:
    """(counter, limit, window, message) of every failure limit a browser without the account's device cookie is
    under, in the order they are reserved: the address's and the service's first, so an attempt refused there
    makes no key for its email (made-up emails cost nothing in Redis)."""
    limits = []
    per_address = _settings().dashboard_login_failures_per_address
    if per_address > 0:
        limits.append((_address_key(ip), per_address, ADDRESS_WINDOW_SECONDS, _FAILED_FROM_ADDRESS))
    per_minute = _settings().dashboard_login_failures_per_minute
    if per_minute > 0:
        limits.append((_GLOBAL_KEY, per_minute, GLOBAL_WINDOW_SECONDS, _FAILED_EVERYWHERE))
    limits += [
        (_login_key(email, ip), LOGIN_MAX_FAILURES, LOGIN_WINDOW_SECONDS, _FAILED_FOR_EMAIL),
        (_account_key(email), ACCOUNT_MAX_FAILURES, ACCOUNT_WINDOW_SECONDS, _FAILED_FOR_EMAIL),
        (_account_day_key(email), ACCOUNT_DAY_MAX_FAILURES, ACCOUNT_DAY_WINDOW_SECONDS, _FAILED_FOR_EMAIL),
    ]
    return limits


def _device_key(device_id: str, email: str) -> str:
    return f"login-device-failures:{_digest(device_id, _normal(email))}"


def _device_account_key(email: str) -> str:
    return f"login-device-account-failures:{_digest(_normal(email))}"


def _count_attempt(key: str, limit: int, window: int, message: str) -> None:
    """Count one password check against ``key`` (whatever its outcome; never taken back); raise past ``limit``."""
    if limit <= 0:
        return
    retry_after = ratelimit.hit(key, limit, window)
    if retry_after is not None:
        raise LoginThrottled(retry_after, message)


def count_password_check(ip: str) -> None:
    """Count one password check from this client address (a log-in or a sign-up form that would reach argon2);
    :class:`LoginThrottled` past ``DASHBOARD_LOGIN_ATTEMPTS_PER_MINUTE``. Refused attempts count too: this one
    per-address key is all a flood from one address makes in Redis."""
    per_minute = _settings().dashboard_login_attempts_per_minute
    _count_attempt(f"dashboard:login:{ip}", per_minute, 60, _FROM_ADDRESS)


def _device_serializer() -> URLSafeTimedSerializer:
    secret_key = current_app.secret_key
    if secret_key is None:  # create_app always sets it (SECRET_KEY)
        raise RuntimeError("the app has no SECRET_KEY")
    return URLSafeTimedSerializer(secret_key, salt="payintent.dashboard.login-device")


def _email_tag(email: str) -> str:
    """The email as the device cookie names it: keyed, so the cookie does not tell whose account it is."""
    key = str(current_app.secret_key).encode()
    return hmac.new(key, f"login-device\n{_normal(email)}".encode(), hashlib.sha256).hexdigest()[:32]


def _device_cookie() -> tuple[str, list[str]] | None:
    """(device id, account tags) of this browser's device cookie if it is valid (signed by us, not too old)."""
    value = request.cookies.get(DEVICE_COOKIE)
    if not value or len(value) > 1024:
        return None
    try:
        payload = _device_serializer().loads(value, max_age=int(DEVICE_MAX_AGE.total_seconds()))
    except BadSignature:  # also a cookie older than DEVICE_MAX_AGE
        return None
    if not isinstance(payload, dict):
        return None
    device_id, tags = payload.get("d"), payload.get("e")
    if isinstance(tags, str):  # a cookie from before the list: one account
        tags = [tags]
    if not (isinstance(device_id, str) and _DEVICE_ID.fullmatch(device_id) and isinstance(tags, list)):
        return None
    # Only tags of our own shape (ASCII hex), so nothing odd ever reaches the comparison below.
    return device_id, [tag for tag in tags[:DEVICE_MAX_ACCOUNTS] if isinstance(tag, str) and _TAG.fullmatch(tag)]


def _device(email: str) -> str | None:
    """The id of this browser's device cookie if it is valid and names ``email`` among its accounts."""
    cookie = _device_cookie()
    if cookie is None:
        return None
    device_id, tags = cookie
    expected = _email_tag(email).encode()
    known = False
    for tag in tags:  # compare bytes: compare_digest refuses str that is not ASCII
        known |= hmac.compare_digest(tag.encode(), expected)
    return device_id if known else None


def reserve_login_attempt(email: str, ip: str) -> LoginAttempt:
    """Count this attempt, and reserve its failure before the password is checked, or raise :class:`LoginThrottled`.

    Every password check counts, successes included: per client address (``DASHBOARD_LOGIN_ATTEMPTS_PER_MINUTE``)
    and per account (``ACCOUNT_MAX_ATTEMPTS`` a minute), for browsers with the account's device cookie and for the
    others separately, so nobody without that cookie can use up the owner's. A device cookie is also limited to
    ``DEVICE_MAX_ATTEMPTS`` per 15 minutes; past them its browser is limited like any other.

    The failure reservation is atomic (an increment that answers the new count), so simultaneous attempts
    through any number of API processes never get more password checks than the limits allow. The
    caller reports the outcome: :func:`login_failed` keeps the reservation, :func:`login_succeeded`
    takes it back. A browser with this account's device cookie is limited by its own counters only
    (not by others' failures on the email or on its address).
    """
    counters = store()
    device = _device(email)
    if device is not None:
        account, per_minute = _digest(_normal(email)), _settings().dashboard_login_attempts_per_minute
        _count_attempt(f"dashboard:login-known:{ip}", per_minute, 60, _FROM_ADDRESS)
        _count_attempt(f"dashboard:login-known-account:{account}", ACCOUNT_MAX_ATTEMPTS, 60, _FOR_ACCOUNT)
        device_attempts = f"dashboard:login-device:{_digest(device, _normal(email))}"
        if ratelimit.hit(device_attempts, DEVICE_MAX_ATTEMPTS, LOGIN_WINDOW_SECONDS) is None:
            key, every_device = _device_key(device, email), _device_account_key(email)
            own = counters.incr(key, LOGIN_WINDOW_SECONDS)
            if own <= LOGIN_MAX_FAILURES:
                # A cookie with no failures of its own (the owner's usual browser) is never refused by the
                # account's cap over all cookies: others' cookies (copied, or an ex-colleague's) cannot spend
                # it for the owner (review 5, N1). Each fresh cookie costs a successful log-in.
                if counters.incr(every_device, LOGIN_WINDOW_SECONDS) <= DEVICE_ACCOUNT_MAX_FAILURES or own == 1:
                    return LoginAttempt(email, ip, (key, every_device), by_device=True)
                counters.release(every_device)
            counters.release(key)
        # this cookie is spent for the window: limited like any other browser
    count_password_check(ip)
    reserved: list[str] = []
    try:
        for key, limit, window, message in _shared_limits(email, ip):
            if counters.incr(key, window) > limit:
                reserved.append(key)
                raise LoginThrottled(max(1, counters.count(key)[1]), message)
            reserved.append(key)
        _count_attempt(f"dashboard:login-account:{_digest(_normal(email))}", ACCOUNT_MAX_ATTEMPTS, 60, _FOR_ACCOUNT)
    except LoginThrottled:
        for taken in reserved:  # a refused attempt counts as no failure (a counter back at 0 is deleted)
            counters.release(taken)
        raise
    return LoginAttempt(email, ip, tuple(reserved), by_device=False)


def login_failed(attempt: LoginAttempt) -> None:
    """A wrong password: the reservation stays as the failure. One made under a device cookie's exemption
    counts against the email and the address too, but never against the service-wide budget: it passed none
    of the checks that bound what one address adds to it (review4 F2: two addresses and a few accounts of the
    attacker's own, with device cookies minted beforehand, kept the budget full). It is bounded instead per
    cookie, per account over all its cookies, and per address (attempts)."""
    if attempt.by_device:
        counters = store()
        for key, _, window, _ in _shared_limits(attempt.email, attempt.ip):
            if key != _GLOBAL_KEY:
                counters.incr(key, window)


def login_succeeded(attempt: LoginAttempt) -> None:
    """The right password: this attempt's reservation is taken back. Earlier failures are not forgiven (on a
    shared address or a copied device cookie they may be an attacker's); they expire with their window."""
    _release(attempt)


def login_abandoned(attempt: LoginAttempt) -> None:
    """The password could not be checked (the database failed): no failure to count."""
    _release(attempt)


def _release(attempt: LoginAttempt) -> None:
    counters = store()
    for key in attempt.reserved:
        counters.release(key)


def remember_device(response: Response, email: str) -> None:
    """After a successful log-in: mark this browser as one the account uses (exempt from the others' failures).

    One cookie per browser names up to ``DEVICE_MAX_ACCOUNTS`` accounts (the most recent ones), so a browser
    used for several merchants stays known to each of them.
    """
    cookie = _device_cookie()
    device_id, tags = cookie if cookie is not None else (secrets.token_urlsafe(16), [])
    tag = _email_tag(email)
    tags = [*(t for t in tags if t != tag), tag][-DEVICE_MAX_ACCOUNTS:]
    response.set_cookie(
        DEVICE_COOKIE,
        _device_serializer().dumps({"d": device_id, "e": tags}),
        max_age=int(DEVICE_MAX_AGE.total_seconds()),
        path="/dashboard",
        secure=bool(request.is_secure),
        httponly=True,
        samesite="Lax",
    )
