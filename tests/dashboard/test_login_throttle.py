"""The login throttle across client addresses: an attacker with many IPs guesses one account's password.

Per (email, address) the limit is 5 failures in 15 minutes (tests/dashboard/test_auth.py); per email
from every address it is 10, except for a browser that has logged in to the account before (its
device cookie, which names up to 5 accounts), so that the attack cannot lock the owner out; that
browser is exempt from the per-(email, address) limit too, which anyone behind the owner's address
(a NAT, a VPN exit) can trip.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.dashboard.helpers import PASSWORD, log_in, log_out, text

EMAIL = "shop@example.com"
ACCOUNT_MAX_FAILURES = 10  # security.ACCOUNT_MAX_FAILURES (a literal: this module also runs on 0729c92)
WINDOW_SECONDS = 15 * 60
DEVICE_COOKIE = "payintent_device"
DEVICE_MAX_ACCOUNTS = 5  # security.DEVICE_MAX_ACCOUNTS


def _from(n: int) -> dict[str, Any]:
    """A request from the n-th address of a botnet."""
    return {"environ_base": {"REMOTE_ADDR": f"198.51.{n // 250}.{n % 250 + 1}"}}


def _guess_from_many_addresses(app: Any, count: int, email: str = EMAIL, start: int = 0) -> None:
    for n in range(start, start + count):
        attacker = app.test_client()  # a fresh browser each time, and a fresh address
        response = log_in(attacker, email, f"guess number {n}!", **_from(n))
        assert response.status_code == 400, (n, response.status_code)


def test_many_addresses_cannot_guess_one_account_without_limit(clock, client, merchant):
    app = client.application
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES)
    # The next guess from yet another address is refused before the password is even checked: the right one too.
    response = log_in(app.test_client(), EMAIL, PASSWORD, **_from(1000))
    assert response.status_code == 429
    assert "Too many failed attempts" in text(response)
    assert 0 < int(response.headers["Retry-After"]) <= WINDOW_SECONDS
    assert log_in(app.test_client(), EMAIL.upper(), "one more guess!!", **_from(1001)).status_code == 429
    # Other accounts are not affected.
    assert log_in(app.test_client(), "other@example.com", "wrong password!", **_from(1002)).status_code == 400
    # The lock ends with the window: the limit slows guessing, it does not lock the account for good.
    clock.advance(seconds=WINDOW_SECONDS + 1)
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_from(1003)).status_code == 302


def test_the_owner_is_not_locked_out_on_a_browser_used_before(client, merchant):
    app = client.application
    owner = app.test_client()
    response = log_in(owner, EMAIL, **_from(500))
    assert response.status_code == 302
    device = owner.get_cookie(DEVICE_COOKIE, path="/dashboard")
    assert device is not None and device.http_only and EMAIL not in device.value
    log_out(owner)

    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES)
    for n in range(5):  # the attack goes on
        assert log_in(app.test_client(), EMAIL, f"more guesses {n}!", **_from(100 + n)).status_code == 429
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_from(1000)).status_code == 429  # a new browser waits
    # The owner's browser logs in, from its usual address or a new one (a phone on another network).
    assert log_in(owner, EMAIL, **_from(500)).status_code == 302
    log_out(owner)
    assert log_in(owner, EMAIL, **_from(501)).status_code == 302


def test_a_device_cookie_helps_only_its_own_account_and_cannot_be_forged(client, merchant, other_merchant):
    app = client.application
    other = app.test_client()
    assert log_in(other, "other@example.com", **_from(600)).status_code == 302  # a device cookie for other@
    log_out(other)
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES)
    assert log_in(other, EMAIL, PASSWORD, **_from(601)).status_code == 429

    forged = app.test_client()
    valid = other.get_cookie(DEVICE_COOKIE, path="/dashboard")
    assert valid is not None
    for value in ("anything", valid.value[:-2] + "xx", valid.value.replace(".", "!", 1)):
        forged.set_cookie(DEVICE_COOKIE, value, path="/dashboard")
        assert log_in(forged, EMAIL, PASSWORD, **_from(602)).status_code == 429, value


def test_a_stolen_device_cookie_does_not_buy_unlimited_guesses(client, merchant):
    app = client.application
    owner = app.test_client()
    assert log_in(owner, EMAIL, **_from(700)).status_code == 302
    log_out(owner)
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES)
    stolen = owner.get_cookie(DEVICE_COOKIE, path="/dashboard")
    assert stolen is not None
    thief = app.test_client()
    thief.set_cookie(DEVICE_COOKIE, stolen.value, path="/dashboard")
    for n in range(5):  # from five addresses: the per-address limit never trips
        assert log_in(thief, EMAIL, f"thief guess {n}!!", **_from(800 + n)).status_code == 400
    assert log_in(thief, EMAIL, PASSWORD, **_from(900)).status_code == 429
    assert log_in(owner, EMAIL, PASSWORD, **_from(700)).status_code == 429  # that cookie is spent for the window


def test_failures_below_the_limit_and_a_success_leave_the_owner_free(client, merchant):
    app = client.application
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES - 1)
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_from(1000)).status_code == 302


def test_the_per_email_limit_is_shared_through_redis(db_url, chains, redis_url):
    """Two apps stand for two API processes: failures at either count against the one email."""
    from backend.app import create_app
    from backend.extensions import db
    from tests.conftest import create_merchant, make_settings, truncate_all

    truncate_all(db_url)
    settings = make_settings(db_url, redis_url=redis_url)
    apps = [create_app(settings, chains=chains), create_app(settings, chains=chains)]
    with apps[0].app_context():
        create_merchant(apps[0], EMAIL)
        db.session.remove()
    for n in range(ACCOUNT_MAX_FAILURES):
        app = apps[n % 2]
        with app.app_context():
            assert log_in(app.test_client(), EMAIL, f"guess number {n}!", **_from(n)).status_code == 400
            db.session.remove()
    for app in apps:
        with app.app_context():
            assert log_in(app.test_client(), EMAIL, PASSWORD, **_from(1000)).status_code == 429
            db.session.remove()
            db.engine.dispose()


# --- the device cookie against attackers who share the owner's address or browser -----------------


def _at(address: str) -> dict[str, Any]:
    return {"environ_base": {"REMOTE_ADDR": address}}


def test_an_attacker_behind_the_owners_address_does_not_lock_out_the_owners_browser(client, merchant):
    """An office NAT, a carrier-grade NAT, a VPN exit: the attacker's five failures lock the (email, address)
    pair, but not the browser the owner used before (its device cookie exempts it from that limit too)."""
    app = client.application
    owner = app.test_client()
    assert log_in(owner, EMAIL, **_at("203.0.113.7")).status_code == 302
    log_out(owner)
    for n in range(5):
        assert log_in(app.test_client(), EMAIL, f"wrong guess {n}!", **_at("203.0.113.7")).status_code == 400
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_at("203.0.113.7")).status_code == 429  # a new browser waits
    assert log_in(owner, EMAIL, **_at("203.0.113.7")).status_code == 302


def test_a_browser_used_for_several_accounts_stays_known_to_each(client, merchant, other_merchant):
    app = client.application
    browser = app.test_client()
    for email in (EMAIL, "other@example.com"):  # one person, two shops, one browser
        assert log_in(browser, email, **_from(500)).status_code == 302
        log_out(browser)
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES)
    assert log_in(browser, EMAIL, **_from(500)).status_code == 302
    log_out(browser)
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES, email="other@example.com", start=100)
    assert log_in(browser, "other@example.com", **_from(500)).status_code == 302


def test_a_device_cookie_remembers_a_bounded_number_of_accounts(client):
    from tests.conftest import create_merchant

    app = client.application
    emails = [f"shop{n}@example.com" for n in range(DEVICE_MAX_ACCOUNTS + 1)]
    for email in emails:
        create_merchant(app, email)
    browser = app.test_client()
    for email in emails:
        assert log_in(browser, email, **_from(500)).status_code == 302
        log_out(browser)
    cookie = browser.get_cookie(DEVICE_COOKIE, path="/dashboard")
    assert cookie is not None and len(cookie.value) < 1024
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES, email=emails[0])
    _guess_from_many_addresses(app, ACCOUNT_MAX_FAILURES, email=emails[1], start=100)
    assert log_in(browser, emails[0], **_from(500)).status_code == 429  # the oldest account was dropped
    assert log_in(browser, emails[1], **_from(500)).status_code == 302


@pytest.mark.parametrize("tag", ["\u00e9" * 32, ["\u00e9" * 32], "a" * 31 + "\u00e9", 5, None])
def test_an_odd_but_validly_signed_device_cookie_is_ignored_not_a_500(client, merchant, tag):
    """compare_digest raises TypeError on a str that is not ASCII: such a tag (signed with our key, say by an
    older release or a bug) made every log-in on that browser a 500."""
    from itsdangerous import URLSafeTimedSerializer

    app = client.application
    signed = URLSafeTimedSerializer(app.secret_key, salt="payintent.dashboard.login-device")
    browser = app.test_client()
    browser.set_cookie(DEVICE_COOKIE, signed.dumps({"d": "AbCdEfGhIjKlMnOpQrStUv", "e": tag}), path="/dashboard")
    assert log_in(browser, EMAIL, "wrong password!", **_from(500)).status_code == 400
    assert log_in(browser, EMAIL, **_from(500)).status_code == 302
    replaced = browser.get_cookie(DEVICE_COOKIE, path="/dashboard")
    assert replaced is not None
    assert all(len(t) == 32 and t.isascii() for t in signed.loads(replaced.value)["e"])  # only our own tag now


def test_an_ipv6_client_is_one_address_for_the_throttle_whatever_address_of_its_64_it_takes(client, merchant):
    app = client.application
    for n in range(5):
        assert (
            log_in(app.test_client(), EMAIL, f"wrong guess {n}!", **_at(f"2001:db8:1:2::{n + 1:x}")).status_code == 400
        )
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_at("2001:db8:1:2:ffff::9")).status_code == 429
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_at("2001:db8:1:3::1")).status_code == 302
