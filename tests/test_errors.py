"""The error envelope for failures no view raises itself: a database that cannot be reached."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from backend.chains.registry import ChainRegistry
from tests.conftest import free_port, make_settings

UNAVAILABLE = {
    "success": False,
    "error": {"code": "SERVICE_UNAVAILABLE", "message": "The database cannot be reached right now; try again"},
}


@pytest.fixture
def unreachable_app(chains: ChainRegistry) -> Iterator[Any]:
    """An app whose PostgreSQL refuses connections (nothing listens on its port)."""
    from backend.app import create_app
    from backend.extensions import db

    application = create_app(
        make_settings(f"postgresql+psycopg2://payintent@127.0.0.1:{free_port()}/payintent"), chains=chains
    )
    with application.app_context():
        yield application
        db.session.remove()
        db.engine.dispose()


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/api/v1/x402/intents", {"Authorization": "Bearer sk_test_" + "a" * 43}),  # the key lookup
        ("/api/v1/checkout/intents/4b0c6a8e-52b4-4d44-9a0b-3c1f7a0e2d11", {}),  # the public checkout API
    ],
)
def test_the_api_answers_503_without_a_trace_when_the_database_is_unreachable(unreachable_app, caplog, path, headers):
    with caplog.at_level(logging.ERROR):
        response = unreachable_app.test_client().get(path, headers=headers)
    assert response.status_code == 503
    assert response.content_type == "application/json"
    assert response.get_json() == UNAVAILABLE
    (record,) = [r for r in caplog.records if "database unavailable" in r.getMessage()]
    assert record.exc_info is None  # an expected condition: one line, no traceback
    assert "Connection refused" in record.getMessage()


def test_the_dashboard_shows_its_503_page_when_the_database_is_unreachable(unreachable_app):
    from backend.dashboard import security

    client = unreachable_app.test_client()
    with client.session_transaction() as session:  # logged in: each page loads the merchant
        session.update({security._MERCHANT: "mer_x", security._SID: "sid", security._STARTED: int(time.time())})
    response = client.get("/dashboard/")
    assert response.status_code == 503
    assert "Temporarily unavailable" in response.get_data(as_text=True)


def test_a_405_lists_the_allowed_methods_in_one_order(client):
    """The router keeps a route's methods in a set; the Allow header sorts them, so it does not change with
    PYTHONHASHSEED (between processes, or between gunicorn workers)."""
    response = client.delete("/api/v1/x402/intents")
    assert response.status_code == 405
    assert response.get_json()["error"]["code"] == "METHOD_NOT_ALLOWED"
    methods = response.headers["Allow"].split(", ")
    assert "POST" in methods and "GET" in methods and methods == sorted(methods)


@pytest.fixture
def one_connection_app(db_url: str, chains: ChainRegistry, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An app whose pool holds one connection and waits a moment for it."""
    import backend.app
    from backend.extensions import db
    from tests.conftest import truncate_all

    monkeypatch.setattr(backend.app, "POOL_SIZE", 1)
    monkeypatch.setattr(backend.app, "POOL_OVERFLOW", 0)
    monkeypatch.setattr(backend.app, "POOL_TIMEOUT_SECONDS", 0.2)
    truncate_all(db_url)
    application = backend.app.create_app(make_settings(db_url), chains=chains)
    with application.app_context():
        yield application
        db.session.remove()
        db.engine.dispose()


def test_a_request_that_finds_every_pooled_connection_taken_is_503_not_500(one_connection_app, caplog):
    """Every connection of the pool held (by other threads of the worker) past pool_timeout: SQLAlchemy's
    TimeoutError is the database being busy, answered 503 SERVICE_UNAVAILABLE like an unreachable one."""
    from backend.extensions import db
    from tests.conftest import create_merchant

    shop = create_merchant(one_connection_app, "pool@example.com")
    db.session.remove()  # the merchant is committed; its connection is back in the pool
    client = one_connection_app.test_client()
    assert client.get("/api/v1/x402/intents", headers=shop.headers).status_code == 200
    db.session.remove()
    held = db.engine.connect()  # the pool's one connection, taken
    try:
        with caplog.at_level(logging.ERROR):
            response = client.get("/api/v1/x402/intents", headers=shop.headers)
        assert response.status_code == 503
        assert response.content_type == "application/json"
        assert response.get_json() == UNAVAILABLE
        assert any("database unavailable" in r.getMessage() for r in caplog.records)
    finally:
        db.session.remove()
        held.close()
    assert client.get("/api/v1/x402/intents", headers=shop.headers).status_code == 200  # the connection is back
