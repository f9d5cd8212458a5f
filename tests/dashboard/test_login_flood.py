"""One address (or one merchant account) against the login throttle's own costs (review3, M1-M3), on real Redis.

- M1: a refused log-in used to leave three per-email keys (one for 24 hours) behind, so one address grew Redis
  without bound with made-up emails. Now the per-address and service-wide checks come before any per-email key
  is made, and a reservation taken back to 0 is deleted.
- M2: one address could spend the whole ``DASHBOARD_LOGIN_FAILURES_PER_MINUTE`` budget with made-up emails (12
  emails x 5 guesses) and hold up every new browser's log-in. Now ``DASHBOARD_LOGIN_FAILURES_PER_ADDRESS``
  failures per 15 minutes stop one address first.
- M3: successes and device-cookie log-ins were never throttled, so one account with its password kept the
  argon2 slots full. Now every password check counts: ``DASHBOARD_LOGIN_ATTEMPTS_PER_MINUTE`` per address, 20 a
  minute per account (per kind of browser), 10 per 15 minutes per device cookie.
- review4 F2: failures under a device cookie passed no per-address failure limit but counted into the service-wide
  budget, so a few accounts of the attacker's own with pre-minted cookies filled it from two addresses. Now they
  never count into it, and an account's device cookies share 10 failures per 15 minutes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis import Redis

from backend.extensions import db
from tests.conftest import create_merchant, make_settings, truncate_all
from tests.dashboard.helpers import PASSWORD, log_in, log_out, text, token

EMAIL = "shop@example.com"
PREFIX = "payintent:ephemeral:"
FAILURES_PER_ADDRESS = 10  # DASHBOARD_LOGIN_FAILURES_PER_ADDRESS's default
ATTEMPTS_PER_MINUTE = 30  # DASHBOARD_LOGIN_ATTEMPTS_PER_MINUTE's default
ACCOUNT_MAX_ATTEMPTS = 20  # security.ACCOUNT_MAX_ATTEMPTS: per account per minute, per kind of browser


def _at(address: str) -> dict[str, Any]:
    return {"environ_base": {"REMOTE_ADDR": address}}


@pytest.fixture
def redis(redis_url: str) -> Iterator[Redis]:
    connection = Redis.from_url(redis_url)
    yield connection
    connection.close()


def _app(db_url: str, chains: Any, redis_url: str, **overrides: Any) -> Any:
    from backend.app import create_app

    truncate_all(db_url)
    return create_app(make_settings(db_url, redis_url=redis_url, **overrides), chains=chains)


@pytest.fixture
def shared_app(db_url: str, chains: Any, redis_url: str) -> Iterator[Any]:
    """The app on real Redis with the default login limits, and ``shop@example.com``."""
    application = _app(db_url, chains, redis_url)
    with application.app_context():
        create_merchant(application, EMAIL)
        yield application
        db.session.remove()
        db.engine.dispose()


def _keys(redis: Redis, pattern: str = "*") -> list[bytes]:
    return list(redis.scan_iter(PREFIX + pattern, count=1000))


def _made_up_emails(app: Any, count: int, address: str) -> list[int]:
    """``count`` log-ins from one browser (one CSRF token for all), each with a fresh made-up email."""
    browser = app.test_client()
    csrf = token(browser)
    codes = []
    for _ in range(count):
        data = {"csrf_token": csrf, "email": f"{uuid.uuid4().hex}@example.com", "password": "x"}
        codes.append(browser.post("/dashboard/login", data=data, **_at(address)).status_code)
    return codes


# --- M1: Redis keys per refused attempt ----------------------------------------------------------


def test_refused_logins_with_made_up_emails_leave_no_per_email_keys(db_url, chains, redis_url, redis):
    """The review's proof with a spent global budget: every refused attempt left a day-long key."""
    app = _app(db_url, chains, redis_url, dashboard_login_failures_per_minute=1)
    with app.app_context():
        codes = _made_up_emails(app, 200, "198.51.100.20")
        db.session.remove()
        db.engine.dispose()
    assert codes[0] == 400 and set(codes[1:]) == {429}, codes
    day_keys = _keys(redis, "login-account-day-failures:*")
    assert len(day_keys) <= 1, len(day_keys)  # the one attempt that was checked
    assert len(_keys(redis)) <= 8, sorted(_keys(redis))  # a handful, however many attempts were refused


def test_one_address_makes_a_bounded_number_of_keys(shared_app, redis):
    """With the default budget: the per-address failure limit stops made-up emails before they make keys."""
    codes = _made_up_emails(shared_app, 100, "198.51.100.21")
    assert codes.count(400) == FAILURES_PER_ADDRESS, codes
    assert len(_keys(redis, "login-account-day-failures:*")) == FAILURES_PER_ADDRESS
    assert len(_keys(redis)) <= 4 * FAILURES_PER_ADDRESS + 4


def test_a_reservation_taken_back_leaves_no_key(shared_app, redis):
    """A success takes its failure reservations back; a counter back at 0 holds nothing and is deleted."""
    assert log_in(shared_app.test_client(), EMAIL, **_at("198.51.100.22")).status_code == 302
    failure_keys = [k for k in _keys(redis) if b"failures" in k]
    assert failure_keys == [], failure_keys


# --- M2: one address and the service-wide failure budget -----------------------------------------


def test_one_address_cannot_spend_the_service_wide_failure_budget(shared_app):
    """The review's proof: 12 made-up emails x 5 guesses from one address spent the budget of 60 a minute, and the
    owner, with the right password on a new browser, got 429 for the rest of the minute."""
    attacker = shared_app.test_client()
    codes = []
    for _ in range(12):
        email = f"nobody-{uuid.uuid4().hex[:8]}@example.com"
        codes += [log_in(attacker, email, "guess!!!", **_at("198.51.100.30")).status_code for _ in range(5)]
    assert codes.count(400) == FAILURES_PER_ADDRESS and codes.count(429) == 60 - FAILURES_PER_ADDRESS, codes
    refused = log_in(attacker, "someone@example.com", "guess!!!", **_at("198.51.100.30"))
    assert "from your network" in text(refused)  # says whose attempts they were
    assert 0 < int(refused.headers["Retry-After"]) <= 15 * 60
    assert log_in(shared_app.test_client(), EMAIL, **_at("203.0.113.30")).status_code == 302


def test_an_ipv6_client_is_one_address_for_the_failure_limit(shared_app):
    for n in range(FAILURES_PER_ADDRESS):
        address = f"2001:db8:5:6::{n + 1:x}"
        assert log_in(shared_app.test_client(), f"x{n}@example.com", "guess!!!", **_at(address)).status_code == 400
    assert log_in(shared_app.test_client(), EMAIL, **_at("2001:db8:5:6:ffff::1")).status_code == 429
    assert log_in(shared_app.test_client(), EMAIL, **_at("2001:db8:5:7::1")).status_code == 302


# --- M3: successes and device cookies ------------------------------------------------------------


@pytest.fixture
def hashes(monkeypatch: Any) -> list[str]:
    """Every argon2 verification a log-in runs (the real one runs too)."""
    from backend.merchants import services as merchants

    calls: list[str] = []
    real = merchants.verify_password

    def counted(password_hash: str, password: str) -> bool:
        calls.append(password)
        return real(password_hash, password)

    monkeypatch.setattr(merchants, "verify_password", counted)
    return calls


def test_successful_logins_from_one_address_are_limited(shared_app, hashes):
    """The review's flood: correct-password log-ins from one address, each from a fresh browser, all hashed."""
    codes = [log_in(shared_app.test_client(), EMAIL, **_at("198.51.100.40")).status_code for _ in range(25)]
    assert codes == [302] * ACCOUNT_MAX_ATTEMPTS + [429] * 5, codes
    assert len(hashes) == ACCOUNT_MAX_ATTEMPTS
    # A second account from the same address: the address's own limit (every attempt counts) stops it next.
    create_merchant(shared_app, "second@example.com")
    codes = [
        log_in(shared_app.test_client(), "second@example.com", **_at("198.51.100.40")).status_code for _ in range(10)
    ]
    assert codes == [302] * (ATTEMPTS_PER_MINUTE - 25) + [429] * 5, codes
    refused = log_in(shared_app.test_client(), "second@example.com", **_at("198.51.100.40"))
    assert refused.status_code == 429 and 0 < int(refused.headers["Retry-After"]) <= 60
    assert "Too many log-in attempts from your network" in text(refused)


def test_successful_logins_from_many_addresses_are_limited_per_account(shared_app, hashes):
    codes = [log_in(shared_app.test_client(), EMAIL, **_at(f"198.51.101.{n + 1}")).status_code for n in range(30)]
    assert codes.count(302) == ACCOUNT_MAX_ATTEMPTS, codes
    assert len(hashes) == ACCOUNT_MAX_ATTEMPTS


def test_device_cookies_do_not_buy_unthrottled_password_checks(shared_app, hashes):
    """The review's flood used 24 device cookies, each minted by a success: each was limited only by its failures."""
    browsers = []
    for n in range(10):
        browser = shared_app.test_client()
        assert log_in(browser, EMAIL, **_at(f"198.51.102.{n + 1}")).status_code == 302
        log_out(browser)
        browsers.append(browser)
    minted = len(hashes)
    codes = []
    for _ in range(6):
        for browser in browsers:
            codes.append(log_in(browser, EMAIL, **_at("198.51.100.50")).status_code)
            log_out(browser)
    # 20 a minute per account from browsers with a device cookie, then 429 (the browser is known: it is not
    # sent to the shared limits, where 10 of the account's 20 remain).
    assert len(hashes) - minted == ACCOUNT_MAX_ATTEMPTS, codes
    assert codes.count(429) == 60 - ACCOUNT_MAX_ATTEMPTS


def test_one_device_cookie_is_limited_by_its_attempts(shared_app, hashes):
    """A device cookie exempts its browser from the others' failures for 10 attempts per 15 minutes (successes
    included); past them the browser is limited like any other, here by an account locked by guesses."""
    owner = shared_app.test_client()
    assert log_in(owner, EMAIL, **_at("198.51.103.1")).status_code == 302
    log_out(owner)
    for n in range(10):  # the attack locks the account for new browsers
        assert log_in(shared_app.test_client(), EMAIL, f"guess {n}!!", **_at(f"198.51.104.{n + 1}")).status_code == 400
    codes = []
    for n in range(12):
        codes.append(log_in(owner, EMAIL, **_at(f"198.51.103.{n + 2}")).status_code)
        log_out(owner)
    assert codes == [302] * 10 + [429] * 2, codes


def test_signup_posts_count_as_password_checks_of_the_address(db_url, chains, redis_url):
    app = _app(db_url, chains, redis_url, dashboard_signups_per_hour=0)
    with app.app_context():
        codes = []
        for n in range(ATTEMPTS_PER_MINUTE + 3):
            browser = app.test_client()
            data = {"csrf_token": token(browser, "/dashboard/signup"), "email": f"s{n}@example.com",
                    "password": PASSWORD, "name": "Shop"}  # fmt: skip
            codes.append(browser.post("/dashboard/signup", data=data, **_at("198.51.100.60")).status_code)
        assert codes == [302] * ATTEMPTS_PER_MINUTE + [429] * 3, codes
        refused = log_in(app.test_client(), "s0@example.com", **_at("198.51.100.60"))
        assert refused.status_code == 429
        db.session.remove()
        db.engine.dispose()


# --- review4 F2: device-cookie failures and the service-wide budget ------------------------------


def _minted(app: Any, email: str, count: int, subnet: str) -> list[Any]:
    """``count`` browsers holding ``email``'s device cookie, each minted by one successful log-in."""
    browsers = []
    for n in range(count):
        browser = app.test_client()
        assert log_in(browser, email, **_at(f"{subnet}.{n + 1}")).status_code == 302
        log_out(browser)
        browsers.append(browser)
    return browsers


def test_device_cookie_failures_do_not_fill_the_service_wide_budget(shared_app, redis):
    """The review's proof: 3 accounts of the attacker's own x 4 device cookies minted beforehand, then 30 + 30 wrong
    passwords from two addresses filled the budget of 60 a minute (the device path skipped the per-address failure
    limit but counted into the budget), and the owner on a new browser got 429 "on this service"."""
    attackers = [f"attacker{n}@example.com" for n in range(3)]
    cookies = {}
    for n, email in enumerate(attackers):
        create_merchant(shared_app, email)
        cookies[email] = _minted(shared_app, email, 4, f"198.51.110{n}")
    plan = {  # address -> (account, cookie) x 5 failures each: <= 30 per address, <= 20 per account
        "203.0.113.66": [(attackers[0], i) for i in range(4)] + [(attackers[1], i) for i in range(2)],
        "203.0.113.77": [(attackers[1], i) for i in range(2, 4)] + [(attackers[2], i) for i in range(4)],
    }
    codes: dict[str, list[int]] = {}
    for address, uses in plan.items():
        for email, i in uses:
            for _ in range(5):
                codes.setdefault(address, []).append(
                    log_in(cookies[email][i], email, "wrong password!!", **_at(address)).status_code
                )
    assert redis.get(PREFIX + "login-failures-everywhere") is None, codes  # nothing in the service-wide budget
    owner = log_in(shared_app.test_client(), EMAIL, **_at("192.0.2.10"))
    assert owner.status_code == 302, text(owner)


def test_device_cookies_of_one_account_share_a_failure_limit(shared_app, hashes):
    """Minting device cookies buys no guesses: 10 failures per 15 minutes per account over all its cookies, then
    its browsers are limited like any other (here by the account's failures, which the device ones count into)."""
    browsers = _minted(shared_app, EMAIL, 4, "198.51.111")
    codes = []
    for n, browser in enumerate(browsers):
        codes += [
            log_in(browser, EMAIL, "wrong password!!", **_at(f"203.0.113.{90 + n}")).status_code for _ in range(5)
        ]
    # A cookie's first failure is its own (the owner's usual browser is never refused by the shared cap).
    assert codes == [400] * 10 + [400] + [429] * 4 + [400] + [429] * 4, codes
    # Device failures count against the account like any other: 10 of them lock it for new browsers too.
    assert log_in(shared_app.test_client(), EMAIL, **_at("192.0.2.11")).status_code == 429


def test_foreign_device_cookies_cannot_lock_the_owners_usual_browser(shared_app):
    """Review 5 (N1): two device cookies of the account held by someone else (copied, or an ex-colleague's) spent
    the account's cap over all cookies with 10 wrong passwords, and the owner's usual browser then fell back to
    the account's limits, which those failures had filled: 429 on every browser. A cookie with no failures of
    its own is never refused by that cap."""
    owner = shared_app.test_client()
    assert log_in(owner, EMAIL, **_at("192.0.2.10")).status_code == 302
    log_out(owner)
    held = _minted(shared_app, EMAIL, 2, "198.51.112")
    codes = [log_in(b, EMAIL, "wrong password!!", **_at("203.0.113.66")).status_code for b in held for _ in range(5)]
    assert codes == [400] * 10, codes
    assert log_in(owner, EMAIL, **_at("192.0.2.10")).status_code == 302
