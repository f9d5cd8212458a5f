"""Guessing that no per-address or per-15-minutes limit sees: slow guessing at one account from a botnet that
waits out every window, and a password spray (one common password, once per account, from many addresses).

- 30 failures at one account in 24 hours lock its password log-in for the rest of the day, whatever the
  addresses (the 15-minute limits alone let 960 guesses a day through);
- ``DASHBOARD_LOGIN_FAILURES_PER_MINUTE`` failures from everywhere, for every email, hold up every other
  log-in for the rest of the minute;
- a browser that has logged in to the account before (its device cookie) is exempt from both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import create_merchant, make_settings, truncate_all
from tests.dashboard.helpers import PASSWORD, log_in, log_out

EMAIL = "shop@example.com"
WINDOW = 15 * 60
PER_WINDOW = 10  # security.ACCOUNT_MAX_FAILURES
PER_DAY = 30  # security.ACCOUNT_DAY_MAX_FAILURES
SPRAY_LIMIT = 20


def _from(n: int) -> dict[str, Any]:
    return {"environ_base": {"REMOTE_ADDR": f"198.51.{n // 250}.{n % 250 + 1}"}}


def _owner_browser(app: Any) -> Any:
    owner = app.test_client()
    assert log_in(owner, EMAIL, **_from(9000)).status_code == 302  # leaves the device cookie
    log_out(owner)
    return owner


def test_slow_guessing_from_many_addresses_locks_the_account_for_the_day(
    clock: Any, client: Any, merchant: Any
) -> None:
    app = client.application
    owner = _owner_browser(app)
    guesses = 0
    for window in range(PER_DAY // PER_WINDOW):  # the botnet waits out each 15-minute window
        for _ in range(PER_WINDOW):
            response = log_in(app.test_client(), EMAIL, f"guess {guesses}!!", **_from(guesses))
            assert response.status_code == 400, (window, guesses, response.status_code)
            guesses += 1
        clock.advance(seconds=WINDOW + 1)
    # A new window, a new address: the right password is still refused, and for hours, not minutes.
    refused = log_in(app.test_client(), EMAIL, PASSWORD, **_from(5000))
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) > 20 * 3600
    assert "hours" in refused.get_data(as_text=True)
    # The owner's browser keeps its exemption.
    assert log_in(owner, EMAIL, **_from(9001)).status_code == 302
    log_out(owner)
    # Other accounts are not affected, and the lock ends with the day.
    assert log_in(app.test_client(), "other@example.com", "wrong password!", **_from(5001)).status_code == 400
    clock.advance(hours=24)
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_from(5002)).status_code == 302


@pytest.fixture
def spray_app(db_url: str, chains: Any) -> Iterator[Any]:
    from backend.app import create_app
    from backend.extensions import db

    truncate_all(db_url)
    application = create_app(make_settings(db_url, dashboard_login_failures_per_minute=SPRAY_LIMIT), chains=chains)
    with application.app_context():
        create_merchant(application, EMAIL)
        yield application
        db.session.remove()
        db.engine.dispose()


def test_a_password_spray_over_many_accounts_is_bounded(clock: Any, spray_app: Any) -> None:
    app = spray_app
    owner = _owner_browser(app)
    for n in range(SPRAY_LIMIT):  # one common password, once per account, each from its own address
        response = log_in(app.test_client(), f"user{n}@example.com", "Summer2026!", **_from(n))
        assert response.status_code == 400, (n, response.status_code)
    # The spray goes on: refused before any password is checked, on every account, the real one too.
    for n in range(SPRAY_LIMIT, SPRAY_LIMIT + 5):
        response = log_in(app.test_client(), f"user{n}@example.com", "Summer2026!", **_from(n))
        assert response.status_code == 429
        assert 0 < int(response.headers["Retry-After"]) <= 60
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_from(100)).status_code == 429
    # A merchant on a browser it used before still logs in.
    assert log_in(owner, EMAIL, **_from(101)).status_code == 302
    log_out(owner)
    # A minute later, log-ins are open again.
    clock.advance(seconds=61)
    assert log_in(app.test_client(), EMAIL, PASSWORD, **_from(102)).status_code == 302
