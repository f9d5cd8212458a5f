"""Sign up, log in, log out, sessions, CSRF and the login throttle."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from backend.dashboard.security import LOGIN_WINDOW_SECONDS
from backend.extensions import db
from backend.merchants.models import ApiKey, Merchant
from tests.conftest import make_settings
from tests.dashboard.helpers import (
    PASSWORD,
    form_token,
    log_in,
    log_out,
    post,
    revealed_secret,
    session_token,
    sign_up,
    text,
    token,
)

INTENTS_API = "/api/v1/x402/intents"


def _merchants() -> int:
    return db.session.scalar(select(func.count()).select_from(Merchant)) or 0


def _keys() -> int:
    return db.session.scalar(select(func.count()).select_from(ApiKey)) or 0


def test_sign_up_log_out_log_in(client):
    response = sign_up(client, "New@Example.com", name="Mugs & <Co>")
    assert response.status_code == 302
    assert response.headers["Location"] == "/dashboard/"

    page = client.get("/dashboard/")
    assert page.status_code == 200
    body = text(page)
    assert "Mugs &amp; &lt;Co&gt;" in body  # autoescaped
    assert "<Co>" not in body
    first_key = revealed_secret(body)  # sign-up issues a first key: shown on the next page, once
    assert first_key and first_key.startswith("sk_test_")
    assert client.get(INTENTS_API, headers={"Authorization": f"Bearer {first_key}"}).status_code == 200
    assert revealed_secret(text(client.get("/dashboard/"))) is None
    merchant = db.session.scalar(select(Merchant).where(Merchant.email == "new@example.com"))
    assert merchant is not None and merchant.name == "Mugs & <Co>"
    assert merchant.password_hash.startswith("$argon2id$") and PASSWORD not in merchant.password_hash

    assert log_out(client).headers["Location"] == "/dashboard/login"
    assert "You are logged out." in text(client.get("/dashboard/login"))
    response = client.get("/dashboard/keys")
    assert response.status_code == 302 and response.headers["Location"].startswith("/dashboard/login")

    response = log_in(client, "new@example.com")
    assert response.status_code == 302 and response.headers["Location"] == "/dashboard/"
    assert "Mugs &amp; &lt;Co&gt;" in text(client.get("/dashboard/keys"))


@pytest.mark.parametrize(
    ("form", "field_message"),
    [
        ({"email": "a@example.com", "password": "short", "name": "Shop"}, "Use at least 10 characters."),
        ({"email": "a@example.com", "password": "123456789", "name": "Shop"}, "Use at least 10 characters."),
        ({"email": "not-an-email", "password": PASSWORD, "name": "Shop"}, "Enter a valid email address"),
        ({"email": "a@example.com", "password": PASSWORD, "name": ""}, "Enter your shop&#39;s name."),
        ({"email": "a@example.com", "password": PASSWORD, "name": "x" * 201}, "Name must be at most 200 characters"),
    ],
    ids=["short", "nine-chars", "email", "no-name", "long-name"],
)
def test_sign_up_bad_input_re_renders_with_400(client, form, field_message):
    response = client.post("/dashboard/signup", data={"csrf_token": token(client, "/dashboard/signup"), **form})
    assert response.status_code == 400
    body = text(response)
    assert field_message in body
    assert 'aria-invalid="true"' in body
    assert PASSWORD not in body  # the password is never echoed back
    if form["email"] == "a@example.com":
        assert 'value="a@example.com"' in body
    assert _merchants() == 0


def test_sign_up_with_a_taken_email(client, merchant):
    response = sign_up(client, "shop@example.com")
    assert response.status_code == 400
    assert "An account with this email already exists" in text(response)
    assert _merchants() == 1


def test_wrong_password_and_unknown_email_get_the_same_generic_message(client, merchant):
    wrong = log_in(client, "shop@example.com", "not the password")
    unknown = log_in(client, "nobody@example.com", PASSWORD)
    for response in (wrong, unknown):
        assert response.status_code == 400
        assert "Invalid email or password." in text(response)
    assert client.get("/dashboard/").status_code == 302  # still logged out


def test_login_redirects_to_a_dashboard_page_only(client, merchant):
    response = client.get("/dashboard/intents?status=paid")
    assert response.headers["Location"] == "/dashboard/login?next=/dashboard/intents?status%3Dpaid"
    page = text(client.get(response.headers["Location"]))
    assert 'name="next" value="/dashboard/intents?status=paid"' in page
    data = {"csrf_token": token(client), "email": "shop@example.com", "password": PASSWORD}
    response = client.post("/dashboard/login", data={**data, "next": "/dashboard/intents?status=paid"})
    assert response.headers["Location"] == "/dashboard/intents?status=paid"
    log_out(client)
    evil_targets = (
        "https://evil.example/dashboard/",
        "//evil.example/dashboard",
        "/\\evil.example",
        "/api/v1/x402/intents",
        "/dashboard/../api/v1/x402/intents",
        "/dashboardevil",
    )
    for evil in evil_targets:
        data["csrf_token"] = token(client)
        response = client.post("/dashboard/login", data={**data, "next": evil})
        assert response.headers["Location"] == "/dashboard/", evil
        log_out(client)


def test_session_cookie_flags(client, merchant):
    response = log_in(client, "shop@example.com")
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Secure" not in cookie
    secure = client.application.test_client()
    token_page = secure.get("/dashboard/login", base_url="https://dash.example")
    assert "Secure" in token_page.headers["Set-Cookie"]
    data = {"csrf_token": form_token(text(token_page)), "email": "shop@example.com", "password": PASSWORD}
    response = secure.post("/dashboard/login", data=data, base_url="https://dash.example")
    assert response.status_code == 302
    assert "Secure" in response.headers["Set-Cookie"] and "HttpOnly" in response.headers["Set-Cookie"]


def test_logging_in_starts_a_new_session(client, merchant):
    before = token(client)
    log_in(client, "shop@example.com")
    after = session_token(client)
    assert after != before
    # The token from before log-in is no longer accepted.
    response = client.post("/dashboard/keys", data={"csrf_token": before})
    assert response.status_code == 400
    assert _keys() == 1


def test_logout_ends_a_copied_session_too(client, merchant):
    log_in(client, "shop@example.com")
    stolen = client.get_cookie("payintent_session")
    assert stolen is not None
    log_out(client)
    other = client.application.test_client()
    other.set_cookie("payintent_session", stolen.value)
    response = other.get("/dashboard/keys")
    assert response.status_code == 302 and response.headers["Location"].startswith("/dashboard/login")


def test_sessions_end_twelve_hours_after_log_in(clock, client, merchant):
    log_in(client, "shop@example.com")
    clock.advance(hours=11, minutes=59)
    assert client.get("/dashboard/keys").status_code == 200
    clock.advance(minutes=2)
    assert client.get("/dashboard/keys").status_code == 302


# --- CSRF ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_token", [None, "", "forged-token", "\u00e9" * 43], ids=["missing", "empty", "wrong", "odd"]
)
def test_csrf_missing_or_invalid_is_400_and_writes_nothing(client, merchant, bad_token):
    extra = {} if bad_token is None else {"csrf_token": bad_token}
    token(client)  # the session has a token; the forms below do not carry it
    response = client.post(
        "/dashboard/signup", data={**extra, "email": "x@example.com", "password": PASSWORD, "name": "X"}
    )
    assert response.status_code == 400
    assert "nothing was changed" in text(response)
    assert _merchants() == 1
    response = client.post("/dashboard/login", data={**extra, "email": "shop@example.com", "password": PASSWORD})
    assert response.status_code == 400
    assert client.get("/dashboard/").status_code == 302  # not logged in

    log_in(client, "shop@example.com")
    key_id = db.session.scalar(select(ApiKey.id))
    for path, data in [
        ("/dashboard/keys", {}),
        (f"/dashboard/keys/{key_id}/revoke", {}),
        ("/dashboard/wallets", {"network": "eip155:84532", "address": "0x" + "22" * 20}),
        ("/dashboard/webhooks", {"url": "https://hooks.example/x", "events": ["payment.completed"]}),
        ("/dashboard/logout", {}),
    ]:
        response = client.post(path, data={**extra, **data})
        assert response.status_code == 400, path
        assert "text/html" in response.headers["Content-Type"]
    db.session.expire_all()
    assert _keys() == 1
    assert db.session.get(ApiKey, key_id).revoked_at is None
    keys_page = client.get("/dashboard/keys")
    assert keys_page.status_code == 200  # logout without a token did not log out
    wallets = text(client.get("/dashboard/wallets"))
    assert "0x" + "22" * 20 not in wallets
    assert "hooks.example" not in text(client.get("/dashboard/webhooks"))


def test_csrf_token_of_another_session_is_refused(client, merchant):
    other = client.application.test_client()
    foreign = token(other)
    token(client)
    response = client.post(
        "/dashboard/login", data={"csrf_token": foreign, "email": "shop@example.com", "password": PASSWORD}
    )
    assert response.status_code == 400


# --- login throttle ------------------------------------------------------------------------------


def _throttle_scenario(client: Any, clock: Any) -> None:
    for _ in range(5):
        response = log_in(client, "shop@example.com", "wrong password!")
        assert response.status_code == 400
    # Locked, even with the right password, for this email from this address.
    response = log_in(client, "SHOP@example.com", PASSWORD)
    assert response.status_code == 429
    assert "Too many failed attempts" in text(response)
    assert 0 < int(response.headers["Retry-After"]) <= LOGIN_WINDOW_SECONDS
    assert client.get("/dashboard/").status_code == 302
    # Another address is not locked out.
    other_ip = {"REMOTE_ADDR": "203.0.113.9"}
    response = log_in(client, "shop@example.com", PASSWORD, environ_base=other_ip)
    assert response.status_code == 302


def test_login_is_throttled_after_five_failures(clock, client, merchant):
    _throttle_scenario(client, clock)
    log_out(client)
    clock.advance(seconds=LOGIN_WINDOW_SECONDS + 1)
    assert log_in(client, "shop@example.com", PASSWORD).status_code == 302


def test_a_successful_login_clears_the_failures(client, merchant):
    for _ in range(4):
        assert log_in(client, "shop@example.com", "wrong password!").status_code == 400
    assert log_in(client, "shop@example.com", PASSWORD).status_code == 302
    log_out(client)
    for _ in range(4):
        assert log_in(client, "shop@example.com", "wrong password!").status_code == 400
    assert log_in(client, "shop@example.com", PASSWORD).status_code == 302


def test_login_throttle_is_shared_through_redis(db_url, chains, redis_url):
    """With Redis, every API process sees the same failures (two apps stand for two processes)."""
    from redis import Redis

    from backend.app import create_app
    from tests.conftest import create_merchant, truncate_all

    truncate_all(db_url)
    settings = make_settings(db_url, redis_url=redis_url)
    first, second = create_app(settings, chains=chains), create_app(settings, chains=chains)
    with first.app_context():
        create_merchant(first, "shop@example.com")
        client = first.test_client()
        for _ in range(5):
            assert log_in(client, "shop@example.com", "wrong password!").status_code == 400
        keys = Redis.from_url(redis_url).keys("payintent:ephemeral:login-failures:*")
        assert len(keys) == 1
        assert 0 < Redis.from_url(redis_url).ttl(keys[0]) <= LOGIN_WINDOW_SECONDS
        db.session.remove()
    with second.app_context():
        response = log_in(second.test_client(), "shop@example.com", PASSWORD)
        assert response.status_code == 429
        db.session.remove()
        db.engine.dispose()
    with first.app_context():
        db.engine.dispose()


def test_dashboard_errors_are_pages_not_json(dashboard):
    for path, status in [("/dashboard/nowhere", 404), ("/dashboard/intents/not-an-id", 404)]:
        response = dashboard.get(path)
        assert response.status_code == status
        assert "text/html" in response.headers["Content-Type"]
        assert "Page not found" in text(response)
    response = dashboard.get("/dashboard/logout")
    assert response.status_code == 405 and "POST" in response.headers["Allow"]
    methods = response.headers["Allow"].split(", ")
    assert methods == sorted(methods)  # one order whatever PYTHONHASHSEED (the router keeps a set)
    assert "text/html" in response.headers["Content-Type"]
    response = post(dashboard, "/dashboard/wallets", {"network": "eip155:84532", "address": "a\x00b"})
    assert response.status_code == 400 and "text/html" in response.headers["Content-Type"]


def test_security_headers(dashboard):
    response = dashboard.get("/dashboard/keys")
    assert response.headers["Cache-Control"] == "no-store"
    assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
    assert "script-src" not in response.headers["Content-Security-Policy"]  # default-src 'none': no scripts
    assert response.headers["X-Frame-Options"] == "DENY"
    assert "<script" not in text(response)


def test_an_unexpected_failure_is_a_friendly_page(dashboard, monkeypatch):
    from backend.dashboard import services

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(services, "overview", broken)
    response = dashboard.get("/dashboard/")
    assert response.status_code == 500
    body = text(response)
    assert "Something went wrong on our side" in body
    assert "secret internals" not in body and "Traceback" not in body
    assert dashboard.get("/dashboard/keys").status_code == 200  # the session is fine afterwards
