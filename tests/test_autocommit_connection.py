"""The request's autocommit connection (backend.extensions.autocommit_connection) and the pool: whichever way it
goes back, the next transaction on it is atomic, and after every kind of request nothing stays checked out.

The apps here run each request in its own app context, as under gunicorn (the shared ``app`` fixture holds one
context around the whole test, so its teardown, which returns the connection, never runs per request)."""

from __future__ import annotations

import gc
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from flask import g
from werkzeug.test import Client
from werkzeug.wrappers import Response

from backend.chains.registry import ChainRegistry
from tests.conftest import create_merchant, make_settings, truncate_all

INTENTS = "/api/v1/x402/intents"


def new_app(database_url: str, chains: ChainRegistry) -> Any:
    from backend.app import create_app

    truncate_all(database_url)
    return create_app(make_settings(database_url), chains=chains)


@pytest.fixture
def pg_app(postgresql_url: str, chains: ChainRegistry) -> Iterator[Any]:
    from backend.extensions import db
    from backend.migrate import upgrade

    upgrade(postgresql_url)
    application = new_app(postgresql_url, chains)
    yield application
    with application.app_context():
        db.engine.dispose()


def returned_by_a_with_block() -> None:
    from backend.extensions import autocommit_connection

    with autocommit_connection():  # SQLAlchemy's idiom: closing returns it to the pool
        pass


def dropped_unreturned() -> None:
    """The app context loses it without its teardown: the pool's garbage-collector clean-up returns it."""
    from backend.extensions import _AUTOCOMMIT, autocommit_connection

    autocommit_connection()
    g.pop(_AUTOCOMMIT)
    gc.collect()


def checked_in_directly() -> None:
    from backend.extensions import _AUTOCOMMIT, autocommit_connection

    autocommit_connection().connection.close()  # the pool's own connection object, back to the pool
    g.pop(_AUTOCOMMIT)


@pytest.mark.parametrize("give_back", [returned_by_a_with_block, dropped_unreturned, checked_in_directly])
def test_an_autocommit_connection_returned_without_its_release_serves_an_atomic_transaction_next(
    pg_app: Any, give_back: Callable[[], None]
) -> None:
    from backend.extensions import autocommit_connection, db

    with pg_app.app_context():
        db.engine.dispose()  # the pool holds one connection from here on: the next checkout gets it back
        pid = autocommit_connection().connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        give_back()
        assert db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    with pg_app.app_context():
        connection = db.session.connection().connection.dbapi_connection
        assert connection is not None and connection.info.backend_pid == pid  # the same connection
        db.session.execute(sa.text("CREATE TEMP TABLE atomic_probe (x int)"))
        db.session.commit()
        db.session.execute(sa.text("INSERT INTO atomic_probe VALUES (1)"))
        db.session.rollback()
        kept = db.session.execute(sa.text("SELECT count(*) FROM atomic_probe")).scalar()
        assert kept == 0, "the rollback kept the INSERT: the transaction ran in autocommit"
        assert connection.autocommit is False


def test_an_autocommit_connection_closed_by_someone_else_is_an_error_not_a_second_connection(pg_app: Any) -> None:
    from backend.extensions import autocommit_connection, db

    with pg_app.app_context():
        returned_by_a_with_block()
        with pytest.raises(RuntimeError, match="closed"):
            autocommit_connection()
        assert db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_the_pool_holds_nothing_checked_out_nor_in_autocommit_after_every_kind_of_request(
    db_url: str, chains: ChainRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backend.extensions import db
    from backend.intents import services

    application = new_app(db_url, chains)
    with application.app_context():
        shop = create_merchant(application, "shop@example.com")
        no_wallet = create_merchant(application, "nowallet@example.com", wallets={})
        engine = db.engine
        db.session.remove()
    per_thread: dict[int, int] = {}
    most = 0
    lock = threading.Lock()

    def checkout(*args: Any) -> None:
        nonlocal most
        with lock:
            per_thread[threading.get_ident()] = per_thread.get(threading.get_ident(), 0) + 1
            most = max(most, per_thread[threading.get_ident()])

    def checkin(*args: Any) -> None:
        with lock:
            per_thread[threading.get_ident()] = per_thread.get(threading.get_ident(), 0) - 1

    sa.event.listen(engine, "checkout", checkout)
    sa.event.listen(engine, "checkin", checkin)
    server = Client(application.wsgi_app, Response)  # each request in its own app context
    try:
        idempotent = {**shop.headers, "Idempotency-Key": "order-1"}
        created = server.post(INTENTS, json={"amount_usdc": 1}, headers=shop.headers)
        assert created.status_code == 201
        intent_id = created.json["data"]["intent_id"]  # type: ignore[index]
        statuses = [
            server.get(f"{INTENTS}/{intent_id}", headers=shop.headers).status_code,
            server.post(INTENTS, json={"amount_usdc": 1}, headers=idempotent).status_code,
            server.post(INTENTS, json={"amount_usdc": 1}, headers=idempotent).status_code,  # the replay
            server.get(INTENTS, headers=shop.headers).status_code,
            server.get(f"{INTENTS}/{uuid.uuid4()}", headers=shop.headers).status_code,
            server.post(INTENTS, json={"amount_usdc": "x"}, headers=shop.headers).status_code,
            server.post(INTENTS, json={"amount_usdc": 1}, headers=no_wallet.headers).status_code,
            server.get(f"{INTENTS}/{intent_id}", headers={"Authorization": "Bearer sk_test_nope"}).status_code,
            server.delete(f"{INTENTS}/{intent_id}", headers=shop.headers).status_code,
        ]
        assert statuses == [200, 201, 201, 200, 404, 400, 409, 401, 200]

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the view")

        monkeypatch.setattr(services, "intent_to_dict", broken)
        failed = [
            server.get(f"{INTENTS}/{intent_id}", headers=shop.headers),  # on the autocommit connection
            server.post(INTENTS, json={"amount_usdc": 1}, headers=shop.headers),
            server.post(INTENTS, json={"amount_usdc": 1}, headers={**shop.headers, "Idempotency-Key": "order-2"}),
            server.get(INTENTS, headers=shop.headers),  # in the session's transaction
        ]
        assert [(r.status_code, r.json["error"]["code"]) for r in failed] == [(500, "INTERNAL_ERROR")] * 4  # type: ignore[index]
        monkeypatch.undo()
    finally:
        sa.event.remove(engine, "checkout", checkout)
        sa.event.remove(engine, "checkin", checkin)

    assert most == 1, "a request held two connections at once"
    pool = engine.pool
    assert pool.checkedout() == 0  # type: ignore[attr-defined]
    pooled = [engine.raw_connection() for _ in range(pool.checkedin())]  # type: ignore[attr-defined]
    try:
        assert pooled
        for connection in pooled:
            dbapi_connection = connection.dbapi_connection
            if engine.dialect.driver == "psycopg2":
                assert dbapi_connection.autocommit is False  # type: ignore[union-attr]
            else:
                assert dbapi_connection.isolation_level is not None  # type: ignore[union-attr]  # None: autocommit
    finally:
        for connection in pooled:
            connection.close()
        engine.dispose()
