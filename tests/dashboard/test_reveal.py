"""New API keys and webhook signing secrets are shown once, from server-side state.

Flask's session is a signed, not encrypted, cookie: whatever it holds is readable wherever the
cookie goes (Set-Cookie in proxy logs, the browser's cookie store, an old copy kept after logout).
So the secret must never be in it, not even in part; the cookie carries an opaque handle at most.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy import text as text_sql

from backend.extensions import db
from tests.conftest import make_settings
from tests.dashboard.helpers import log_in, log_out, post, revealed_secret, sign_up, text

COOKIE = "payintent_session"
HOOK_URL = "https://hooks.example/payintent"
REVEAL_TTL_SECONDS = 5 * 60  # backend.dashboard.reveals.REVEAL_TTL (a literal: this module also runs on 0729c92)


def _session_cookies(app: Any, response: Any) -> list[tuple[str, Any]]:
    """Every session cookie this response sets: (raw value, what the app's serializer decodes it to)."""
    serializer = app.session_interface.get_signing_serializer(app)
    found = []
    for header in response.headers.getlist("Set-Cookie"):
        name, _, rest = header.partition("=")
        if name.strip() == COOKIE:
            value = rest.split(";", 1)[0].strip('"')
            found.append((value, serializer.loads(value) if value else {}))
    return found


def _fragments(secret: str, size: int = 8) -> list[str]:
    """The secret and every run of ``size`` characters of its random part (after sk_test_ / whsec_)."""
    body = secret.split("_")[-1]
    return [secret, body] + [body[i : i + size] for i in range(len(body) - size + 1)]


def _assert_not_in_cookies(app: Any, responses: list[Any], secret: str) -> None:
    for response in responses:
        for raw, decoded in _session_cookies(app, response):
            content = json.dumps(decoded)
            for fragment in _fragments(secret):
                assert fragment not in raw, "the raw Set-Cookie carries part of a secret"
                assert fragment not in content, f"the session cookie carries part of a secret: {decoded}"


def _pending() -> int:
    from backend.dashboard.models import PendingReveal

    db.session.expire_all()
    return db.session.scalar(select(func.count()).select_from(PendingReveal)) or 0


def test_no_set_cookie_carries_a_new_secret(client):
    """Sign up, create a key, add a webhook endpoint, rotate its secret: each secret shown once, never in a cookie."""
    app = client.application
    seen: list[Any] = []
    secrets: list[str] = []

    def reveal_after(response: Any) -> str:
        seen.append(response)
        assert response.status_code == 302, text(response)
        page = client.get(response.headers["Location"])
        seen.append(page)
        secret = revealed_secret(text(page))
        assert secret is not None, "the page after the POST shows the secret"
        again = client.get(response.headers["Location"])
        seen.append(again)
        assert revealed_secret(text(again)) is None and secret not in text(again), "shown once"
        secrets.append(secret)
        return secret

    assert reveal_after(sign_up(client, "new@example.com")).startswith("sk_test_")
    assert reveal_after(post(client, "/dashboard/keys")).startswith("sk_test_")
    created = post(client, "/dashboard/webhooks", {"url": HOOK_URL, "events": ["payment.completed"]})
    assert reveal_after(created).startswith("whsec_")
    webhook_id = created.headers["Location"].rsplit("/", 1)[1]
    assert reveal_after(post(client, f"/dashboard/webhooks/{webhook_id}/rotate")).startswith("whsec_")

    assert len(set(secrets)) == 4
    for secret in secrets:
        _assert_not_in_cookies(app, seen, secret)
    assert _pending() == 0  # shown, so gone from the server too


def test_an_old_cookie_replayed_after_logout_shows_nothing(client, merchant, db_url, chains):
    log_in(client, "shop@example.com")
    assert post(client, "/dashboard/keys").status_code == 302
    copied = client.get_cookie(COOKIE)
    assert copied is not None
    log_out(client)

    # The same app (it remembers the logout) and a second one (another API process that does not: no Redis).
    from backend.app import create_app

    other_process = create_app(make_settings(db_url), chains=chains)
    for app in (client.application, other_process):
        replay = app.test_client()
        replay.set_cookie(COOKIE, copied.value)
        for path in ("/dashboard/keys", "/dashboard/", "/dashboard/login"):
            page = text(replay.get(path, follow_redirects=True))
            assert revealed_secret(page) is None, (app, path)
            assert not re.search(r"sk_test_[A-Za-z0-9_-]{7}", page)  # key listings show 6 characters
    with other_process.app_context():
        db.session.remove()
        db.engine.dispose()
    assert _pending() == 0  # logging out forgot the secret that was never shown


def test_a_secret_never_shown_expires(clock, dashboard):
    assert post(dashboard, "/dashboard/keys").status_code == 302
    clock.advance(seconds=REVEAL_TTL_SECONDS + 1)
    page = text(dashboard.get("/dashboard/keys"))
    assert revealed_secret(page) is None
    assert _pending() == 0


def test_a_handle_shows_nothing_in_another_session(client, dashboard, other_merchant):
    """The handle belongs to the merchant and the login session that made the secret."""
    assert post(dashboard, "/dashboard/keys").status_code == 302
    with dashboard.session_transaction() as session:
        handle = session["reveal"]
    assert isinstance(handle, str) and not handle.startswith("sk_test_")
    thief = client.application.test_client()
    assert log_in(thief, "other@example.com").status_code == 302
    with thief.session_transaction() as session:
        session["reveal"] = handle
    assert revealed_secret(text(thief.get("/dashboard/keys"))) is None
    assert revealed_secret(text(dashboard.get("/dashboard/keys"))) is None  # a handle is used up once presented


def test_the_database_never_holds_the_secret_in_clear(dashboard, merchant):
    from backend.dashboard import reveals
    from backend.dashboard.models import PendingReveal

    assert reveals.REVEAL_TTL.total_seconds() == REVEAL_TTL_SECONDS
    with dashboard.application.test_request_context():
        handle = reveals.store(merchant.id, "sid-1", "api_key", "sk_test_" + "A1b2C3d4" * 5, "a key")
    row = db.session.scalars(select(PendingReveal)).one()
    assert b"A1b2C3d4" not in row.ciphertext and handle not in row.id
    assert reveals.take(handle, merchant.id, "sid-2") is None  # another session: nothing (and it is used up)
    handle = reveals.store(merchant.id, "sid-1", "api_key", "sk_test_" + "A1b2C3d4" * 5, "a key")
    shown = reveals.take(handle, merchant.id, "sid-1")
    assert shown == {"kind": "api_key", "secret": "sk_test_" + "A1b2C3d4" * 5, "subject": "a key"}
    assert reveals.take(handle, merchant.id, "sid-1") is None
    assert reveals.take("not a handle", merchant.id, "sid-1") is None


def test_a_second_secret_before_the_page_replaces_the_first(dashboard):
    assert post(dashboard, "/dashboard/keys").status_code == 302
    assert post(dashboard, "/dashboard/keys").status_code == 302
    assert _pending() == 1
    page = text(dashboard.get("/dashboard/keys"))
    assert revealed_secret(page) is not None
    assert _pending() == 0


# --- rows at rest: integrity, and expired rows do not linger ---------------------------------------


def _tamper(statement: str, **params: Any) -> None:
    """What someone who can write to the database (not holding the handle in the merchant's cookie) does."""
    db.session.execute(text_sql(statement), params)
    db.session.commit()


@pytest.mark.parametrize("attack", ["flip", "relabel", "both", "truncate"])
def test_a_row_changed_in_the_database_shows_nothing(dashboard, attack):
    """The encryption was a bare keystream XOR: flipping bits of the stored ciphertext flipped the same bits of
    the secret shown (the known prefix sk_test_ became whsec_XX), and kind and subject were not bound to it, so
    a database writer could show the new API key as "the signing secret of https://evil.example/"."""
    assert post(dashboard, "/dashboard/keys").status_code == 302
    length = len(revealed_secret(text(dashboard.get("/dashboard/keys"))) or "")  # every key is as long
    assert length > 8
    assert post(dashboard, "/dashboard/keys").status_code == 302
    stored = bytes(db.session.execute(text_sql("SELECT ciphertext FROM dashboard_reveals")).scalar_one())
    start = len(stored) - length  # the encrypted secret ends the column, whatever comes before it
    delta = bytes(a ^ b for a, b in zip(b"sk_test_", b"whsec_XX", strict=True))
    flipped = (
        stored[:start]
        + bytes(x ^ y for x, y in zip(stored[start : start + 8], delta, strict=True))
        + stored[start + 8 :]
    )
    relabel = "kind = 'webhook_secret', subject = 'the signing secret of https://evil.example/'"
    if attack == "flip":
        _tamper("UPDATE dashboard_reveals SET ciphertext = :c", c=flipped)
    elif attack == "relabel":
        _tamper(f"UPDATE dashboard_reveals SET {relabel}")
    elif attack == "both":
        _tamper(f"UPDATE dashboard_reveals SET ciphertext = :c, {relabel}", c=flipped)
    else:
        _tamper("UPDATE dashboard_reveals SET ciphertext = :c", c=stored[:start])
    page = text(dashboard.get("/dashboard/keys"))
    assert revealed_secret(page) is None, "a tampered row was shown"
    assert "evil.example" not in page and "whsec_" not in page
    assert _pending() == 0  # and it is gone


def _key_created_in_another_session(client: Any, email: str) -> None:
    browser = client.application.test_client()
    assert log_in(browser, email).status_code == 302
    assert post(browser, "/dashboard/keys").status_code == 302  # and never looked at


def test_expired_rows_are_deleted_when_a_secret_is_shown(clock, client, dashboard, other_merchant):
    _key_created_in_another_session(client, "other@example.com")
    clock.advance(seconds=REVEAL_TTL_SECONDS - 60)
    assert post(dashboard, "/dashboard/keys").status_code == 302  # not expired yet: this store leaves it
    assert _pending() == 2
    clock.advance(seconds=120)
    assert revealed_secret(text(dashboard.get("/dashboard/keys"))) is not None
    assert _pending() == 0


def test_expired_rows_are_deleted_at_logout(clock, client, dashboard, other_merchant):
    _key_created_in_another_session(client, "other@example.com")
    clock.advance(seconds=REVEAL_TTL_SECONDS + 1)
    log_out(dashboard)
    assert _pending() == 0


def test_the_worker_sweeps_expired_rows(app, clock, client, other_merchant, redis_url):
    from redis import Redis

    from backend.queueing import set_job_app
    from backend.worker import PERIODIC, enqueue_due, run_worker

    assert "purge_expired_reveals" in {p.func.__name__ for p in PERIODIC}
    _key_created_in_another_session(client, "other@example.com")
    clock.advance(seconds=REVEAL_TTL_SECONDS + 1)
    assert _pending() == 1  # nobody stored, showed or logged out since
    connection = Redis.from_url(redis_url)
    set_job_app(app)
    try:
        enqueue_due(connection)
        run_worker(connection, burst=True)
    finally:
        set_job_app(None)
    assert _pending() == 0
