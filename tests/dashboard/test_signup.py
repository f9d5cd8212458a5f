"""Sign-up: limited per client, and closed altogether where merchants are created by the operator.

``POST /dashboard/signup`` needs no account and was not limited: it answers "An account with this
email already exists", so anyone could test any number of emails for accounts, and it creates free
merchant accounts without bound, each with its own per-merchant budgets (relay spending, webhook
senders). Now sign-ups are counted per client address (an IPv6 client by its /64), and
``DASHBOARD_SIGNUP=closed`` turns the page off.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from sqlalchemy import func, select

from backend.config import Settings
from backend.extensions import db
from backend.merchants.models import Merchant
from tests.conftest import make_settings
from tests.dashboard.helpers import PASSWORD, log_in, text, token

SIGNUPS_PER_HOUR = 10  # the default of DASHBOARD_SIGNUPS_PER_HOUR (a literal: this module also runs on the base commit)


def _merchants() -> int:
    return db.session.scalar(select(func.count()).select_from(Merchant)) or 0


def _at(address: str) -> dict[str, Any]:
    return {"REMOTE_ADDR": address}


def _sign_up_from(app: Any, email: str, address: str, password: str = PASSWORD) -> Any:
    """A fresh browser at ``address`` submits the sign-up form."""
    browser = app.test_client()
    csrf = token(browser, "/dashboard/signup")
    data = {"csrf_token": csrf, "email": email, "password": password, "name": "Shop"}
    return browser.post("/dashboard/signup", data=data, environ_base=_at(address))


def _settings(app: Any, **values: Any) -> None:
    app.config["PAYINTENT_SETTINGS"] = dataclasses.replace(app.config["PAYINTENT_SETTINGS"], **values)


def test_testing_emails_for_accounts_is_limited_per_client(clock, client, merchant):
    app = client.application
    codes = [_sign_up_from(app, "shop@example.com", "198.51.100.7").status_code for _ in range(30)]
    assert codes == [400] * SIGNUPS_PER_HOUR + [429] * (30 - SIGNUPS_PER_HOUR), codes
    refused = _sign_up_from(app, "fresh@example.com", "198.51.100.7")
    assert refused.status_code == 429 and 0 < int(refused.headers["Retry-After"]) <= 3600
    page = text(refused)
    assert "Too many sign-ups" in page and "already exists" not in page
    assert _merchants() == 1
    # Another client is not affected, and the limit lifts with its window.
    assert _sign_up_from(app, "fresh@example.com", "203.0.113.9").status_code == 302
    clock.advance(seconds=3601)
    assert _sign_up_from(app, "shop@example.com", "198.51.100.7").status_code == 400


def test_accounts_opened_from_one_client_are_limited(client):
    app = client.application
    codes = [_sign_up_from(app, f"shop{n}@example.com", "198.51.100.8").status_code for n in range(12)]
    assert codes == [302] * SIGNUPS_PER_HOUR + [429] * (12 - SIGNUPS_PER_HOUR), codes
    assert _merchants() == SIGNUPS_PER_HOUR


def test_an_ipv6_client_is_one_client_whatever_address_of_its_64_it_takes(client):
    app = client.application
    _settings(app, dashboard_signups_per_hour=2)
    codes = [_sign_up_from(app, f"v6-{n}@example.com", f"2001:db8:7:7::{n + 1:x}").status_code for n in range(3)]
    assert codes == [302, 302, 429]
    assert _sign_up_from(app, "v6-other@example.com", "2001:db8:7:8::1").status_code == 302


def test_a_form_with_errors_is_not_counted(client):
    """Only a form that reaches the accounts counts: typos do not lock a real person out."""
    app = client.application
    _settings(app, dashboard_signups_per_hour=1)
    for _ in range(5):
        assert _sign_up_from(app, "a@example.com", "198.51.100.9", password="short").status_code == 400
    assert _sign_up_from(app, "a@example.com", "198.51.100.9").status_code == 302
    assert _sign_up_from(app, "b@example.com", "198.51.100.9").status_code == 429


def test_zero_turns_the_limit_off(client):
    app = client.application
    _settings(app, dashboard_signups_per_hour=0)
    codes = [_sign_up_from(app, "nobody@example.com", "198.51.100.10", password="short").status_code]
    codes += [_sign_up_from(app, f"z{n}@example.com", "198.51.100.10").status_code for n in range(3)]
    assert codes == [400, 302, 302, 302]


def test_the_limit_is_shared_through_redis(db_url, chains, redis_url):
    """Two apps stand for two API processes."""
    from backend.app import create_app
    from tests.conftest import truncate_all

    truncate_all(db_url)
    settings = make_settings(db_url, redis_url=redis_url, dashboard_signups_per_hour=3)
    apps = [create_app(settings, chains=chains), create_app(settings, chains=chains)]
    codes = []
    for n in range(5):
        app = apps[n % 2]
        with app.app_context():
            codes.append(_sign_up_from(app, f"r{n}@example.com", "198.51.100.11").status_code)
            db.session.remove()
    assert codes == [302, 302, 302, 429, 429]
    for app in apps:
        with app.app_context():
            db.engine.dispose()


@pytest.fixture
def closed(db_url: str, chains: Any, app: Any) -> Any:
    """The app of a deployment that set DASHBOARD_SIGNUP=closed (same database as ``app``)."""
    from backend.app import create_app

    closed_app = create_app(make_settings(db_url, dashboard_signup="closed"), chains=chains)
    with closed_app.app_context():
        yield closed_app
        db.session.remove()
        db.engine.dispose()


def test_closed_sign_up_is_a_clear_page_and_creates_nothing(closed, merchant):
    browser = closed.test_client()
    page = browser.get("/dashboard/signup")
    assert page.status_code == 403
    body = text(page)
    assert "Sign-ups are closed" in body and "payintent merchant create" in body
    assert 'name="password"' not in body  # no form to fill in
    csrf = token(browser)  # a valid form token, from the log-in page
    data = {"csrf_token": csrf, "email": "new@example.com", "password": PASSWORD, "name": "Shop"}
    posted = browser.post("/dashboard/signup", data=data)
    assert posted.status_code == 403 and "Sign-ups are closed" in text(posted)
    assert _sign_up_probe_does_not_tell(browser)
    assert _merchants() == 1
    login_page = text(browser.get("/dashboard/login"))
    assert "Create an account" not in login_page  # no link to a closed page
    assert log_in(browser, "shop@example.com").status_code == 302  # existing merchants log in as before


def _sign_up_probe_does_not_tell(browser: Any) -> bool:
    """A taken and a free email get the same answer."""
    csrf = token(browser)
    answers = set()
    for email in ("shop@example.com", "free@example.com"):
        data = {"csrf_token": csrf, "email": email, "password": PASSWORD, "name": "Shop"}
        response = browser.post("/dashboard/signup", data=data)
        answers.add((response.status_code, text(response)))
    return len(answers) == 1


def test_open_sign_up_links_from_the_log_in_page(client):
    assert "Create an account" in text(client.get("/dashboard/login"))


@pytest.mark.parametrize(
    ("value", "expected"), [(None, "open"), ("open", "open"), ("closed", "closed"), ("CLOSED", "closed")]
)
def test_dashboard_signup_setting(monkeypatch, value, expected):
    monkeypatch.setenv("DATABASE_URL", "sqlite:///unused.db")
    if value is None:
        monkeypatch.delenv("DASHBOARD_SIGNUP", raising=False)
    else:
        monkeypatch.setenv("DASHBOARD_SIGNUP", value)
    assert Settings.from_env().dashboard_signup == expected


def test_a_mistyped_dashboard_signup_stops_the_process(monkeypatch):
    """A typo must not leave sign-ups open on a server meant to be closed."""
    monkeypatch.setenv("DATABASE_URL", "sqlite:///unused.db")
    monkeypatch.setenv("DASHBOARD_SIGNUP", "close")
    with pytest.raises(ValueError, match="DASHBOARD_SIGNUP"):
        Settings.from_env()
