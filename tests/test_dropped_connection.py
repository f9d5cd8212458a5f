"""A PostgreSQL connection that dies during a request (the server crashed or restarted, an idle timeout, a
proxy): the answer is never a 500, nothing half-written stays, and the next request works.

The fault is real and connection-level: the request's own backend is ended with ``pg_terminate_backend``
(only that one pid: the test's own connection, never anyone else's), at a chosen point of the request. The
app is called the way gunicorn calls it (:func:`like_gunicorn`): an exception that escapes the WSGI app,
from the view or from the app context's teardown, becomes the server's own ``500 Internal Server Error``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from werkzeug.test import Client
from werkzeug.wrappers import Response

from backend.chains.registry import ChainRegistry
from backend.migrate import upgrade
from tests.conftest import MerchantHandle, create_merchant, make_settings, truncate_all

pytestmark = pytest.mark.db  # also run by `make test-db` against the machine's PostgreSQL (CI)

INTENTS = "/api/v1/x402/intents"


def like_gunicorn(wsgi_app: Callable[..., Any]) -> Callable[..., Any]:
    """What a WSGI server does with an exception out of the app (gunicorn's sync worker: a bare 500 page)."""

    def server(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        try:
            return wsgi_app(environ, start_response)
        except Exception:  # gunicorn writes its own answer in place of the app's, whose headers it never sent
            start_response("500 Internal Server Error", [("Content-Type", "text/html")])
            return [b"<h1><p>Internal Server Error</p></h1>"]

    return server


class Killer:
    """Ends the PostgreSQL backend of the request's own connection (only that pid: the server may be shared),
    once armed, at the point of the request that calls it (a hook, or a wrapped function)."""

    def __init__(self, database_url: str) -> None:
        self.admin = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
        self.armed = False
        self.killed: list[int] = []

    def kill_session_connection(self) -> None:
        from backend.extensions import db

        if self.armed:
            self._kill(db.session.connection())

    def kill_request_connection(self) -> None:
        """The request's autocommit connection (the hot reads': backend.extensions) if it took one, else its
        session's."""
        from backend.extensions import db, taken_autocommit_connection

        if self.armed:
            self._kill(taken_autocommit_connection() or db.session.connection())

    def _kill(self, connection: sa.Connection) -> None:
        self.armed = False
        pid = connection.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        with self.admin.begin() as conn:
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
        self.wait_gone("pid = :pid", {"pid": pid})
        self.killed.append(pid)

    def wait_gone(self, where: str, params: dict[str, Any]) -> None:
        """Until the server has closed the ended backends' sockets."""
        query = sa.text(f"SELECT count(*) FROM pg_stat_activity WHERE {where}")
        deadline = time.monotonic() + 10
        with self.admin.connect() as conn:
            while conn.execute(query, params).scalar():
                assert time.monotonic() < deadline, f"backends ({where}) did not end"
                time.sleep(0.02)
                conn.rollback()


@pytest.fixture
def killer(postgresql_url: str) -> Iterator[Killer]:
    k = Killer(postgresql_url)
    yield k
    k.admin.dispose()


@pytest.fixture
def pg_app(postgresql_url: str, chains: ChainRegistry, killer: Killer) -> Iterator[Any]:
    """An app on PostgreSQL whose requests' connection the test can kill right after the view (before the
    app context's teardown ends the session's transaction)."""
    from backend.app import create_app
    from backend.extensions import db

    upgrade(postgresql_url)
    truncate_all(postgresql_url)
    application = create_app(make_settings(postgresql_url), chains=chains)

    @application.after_request
    def kill_after_the_view(response: Any) -> Any:  # runs first of the after_request hooks: the view is done
        killer.kill_request_connection()
        return response

    with application.app_context():
        application.extensions["test.merchant"] = create_merchant(application, "shop@example.com")
        db.session.remove()
    yield application
    with application.app_context():
        db.engine.dispose()


@pytest.fixture
def server(pg_app: Any) -> Client:
    return Client(like_gunicorn(pg_app.wsgi_app), Response)


def merchant_of(app: Any) -> MerchantHandle:
    return app.extensions["test.merchant"]  # type: ignore[no-any-return]


def create_intent(server: Client, headers: dict[str, str], key: str | None = None) -> Any:
    extra = {"Idempotency-Key": key} if key else {}
    return server.post(INTENTS, json={"amount_usdc": 1.5, "order_id": key or "o"}, headers={**headers, **extra})


def test_a_connection_dropped_after_a_read_keeps_the_answer_and_the_next_request_works(pg_app, server, killer, caplog):
    headers = merchant_of(pg_app).headers
    created = create_intent(server, headers)
    assert created.status_code == 201
    intent_id = created.json["data"]["intent_id"]

    killer.armed = True  # the GET reads outside any transaction (one autocommit statement): nothing is lost
    with caplog.at_level(logging.WARNING, logger="backend.extensions"):
        read = server.get(f"{INTENTS}/{intent_id}", headers=headers)
    assert killer.killed, "the fault was not injected"
    assert read.status_code == 200, read.get_data(as_text=True)
    assert read.json["data"]["intent_id"] == intent_id and read.json["data"]["status"] == "pending"
    assert not [r for r in caplog.records if r.name == "backend.extensions"]

    killer.armed = True  # the list's read transaction is still open when its connection dies
    with caplog.at_level(logging.WARNING, logger="backend.extensions"):
        listed = server.get(INTENTS, headers=headers)
    assert listed.status_code == 200, listed.get_data(as_text=True)
    assert [i["intent_id"] for i in listed.json["data"]["intents"]] == [intent_id]
    (record,) = [r for r in caplog.records if r.name == "backend.extensions"]
    assert record.levelno == logging.WARNING and record.exc_info is None  # expected: one line, no traceback
    assert "connection lost" in record.getMessage()

    for path in (f"{INTENTS}/{intent_id}", INTENTS) * 3:  # the same thread, new app contexts: nothing broken reused
        again = server.get(path, headers=headers)
        assert again.status_code == 200, again.get_data(as_text=True)


def test_a_connection_dropped_after_an_error_keeps_the_error(pg_app, server, killer):
    headers = merchant_of(pg_app).headers
    killer.armed = True
    missing = server.get(f"{INTENTS}/{uuid.uuid4()}", headers=headers)
    assert killer.killed
    assert missing.status_code == 404 and missing.json["error"]["code"] == "NOT_FOUND"
    assert server.get(INTENTS, headers=headers).status_code == 200


def test_a_connection_dropped_before_the_commit_is_503_and_writes_nothing(pg_app, server, killer, monkeypatch):
    """The create's connection dies between its reads and its commit: 503 SERVICE_UNAVAILABLE, no intent and
    no idempotency record; the retry with the same key creates exactly one intent."""
    from backend.intents import views

    remember = views.idempotency.remember_response

    def dies_first(*args: Any, **kwargs: Any) -> None:
        killer.kill_session_connection()
        remember(*args, **kwargs)

    monkeypatch.setattr(views.idempotency, "remember_response", dies_first)
    headers = merchant_of(pg_app).headers
    key = f"order-{uuid.uuid4().hex}"
    killer.armed = True
    failed = create_intent(server, headers, key)
    assert killer.killed
    assert failed.status_code == 503, failed.get_data(as_text=True)
    assert failed.json["error"]["code"] == "SERVICE_UNAVAILABLE"
    with killer.admin.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM intents WHERE order_id = :k"), {"k": key}).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys WHERE key = :k"), {"k": key}).scalar() == 0

    retried = create_intent(server, headers, key)
    assert retried.status_code == 201, retried.get_data(as_text=True)
    with killer.admin.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM intents WHERE order_id = :k"), {"k": key}).scalar() == 1


def _kill_once_taken(killer: Any, monkeypatch: Any) -> None:
    """The request's autocommit connection (the hot read's) is killed on the server right after it is taken."""
    from backend import extensions

    taken = extensions.autocommit_connection

    def dies_once_taken() -> Any:
        connection = taken()
        killer.kill_request_connection()
        return connection

    monkeypatch.setattr(extensions, "autocommit_connection", dies_once_taken)
    killer.armed = True


def test_a_connection_dropped_before_the_hot_read_is_503_and_the_next_read_works(pg_app, server, killer, monkeypatch):
    """The GET's one statement (run on the driver's cursor) finds its connection gone: 503 SERVICE_UNAVAILABLE, as
    from SQLAlchemy's execute, and the connection is thrown away, not returned to the pool."""

    headers = merchant_of(pg_app).headers
    intent_id = create_intent(server, headers).json["data"]["intent_id"]
    _kill_once_taken(killer, monkeypatch)
    failed = server.get(f"{INTENTS}/{intent_id}", headers=headers)
    assert killer.killed
    assert failed.status_code == 503, failed.get_data(as_text=True)
    assert failed.json["error"]["code"] == "SERVICE_UNAVAILABLE"
    for _ in range(3):
        again = server.get(f"{INTENTS}/{intent_id}", headers=headers)
        assert again.status_code == 200, again.get_data(as_text=True)


def test_a_connection_lost_on_the_driver_cursor_marks_the_pool_stale_as_execute_does(
    pg_app, server, killer, monkeypatch
):
    """SQLAlchemy's execute, on a disconnect, also marks every connection the pool already holds as stale (the
    server that dropped one has likely dropped them all): the hot read on the driver's cursor does the same, so the
    next checkouts get new connections instead of the survivors of the old server."""
    from backend.extensions import db

    headers = merchant_of(pg_app).headers
    intent_id = create_intent(server, headers).json["data"]["intent_id"]
    with pg_app.app_context():
        db.engine.dispose()
        held = [db.engine.connect() for _ in range(2)]  # two in the pool: one for the request, one left behind
        before = {c.connection.dbapi_connection.info.backend_pid for c in held}  # type: ignore[union-attr]
        for connection in held:
            connection.close()
    _kill_once_taken(killer, monkeypatch)
    assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 503
    assert len(killer.killed) == 1 and killer.killed[0] in before
    with pg_app.app_context():
        after = [db.engine.connect() for _ in range(2)]
        pids = {c.connection.dbapi_connection.info.backend_pid for c in after}  # type: ignore[union-attr]
        for connection in after:
            connection.close()
    assert not pids & before, "a connection from before the disconnect was reused"


def _count_pings(pg_app: Any, monkeypatch: Any) -> list[int]:
    """The pings the pool's checkout sends (``extensions.ping_idle_connections``), counted on the engine's dialect."""
    from backend.extensions import db

    with pg_app.app_context():
        dialect = db.engine.dialect
    pings: list[int] = []
    ping = dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        pings.append(dbapi_connection.info.backend_pid)
        return ping(dbapi_connection)

    monkeypatch.setattr(dialect, "do_ping", counted, raising=False)
    return pings


def _request_pids(pg_app: Any) -> list[int]:
    """The backend pid of each request's autocommit connection (the hot read's), in order."""
    from backend.extensions import taken_autocommit_connection

    pids: list[int] = []

    @pg_app.after_request
    def note_pid(response: Any) -> Any:
        connection = taken_autocommit_connection()
        if connection is not None and not connection.invalidated:
            pids.append(connection.connection.dbapi_connection.info.backend_pid)
        return response

    return pids


def test_a_connection_reused_at_once_is_not_pinged_and_one_the_server_ended_is_replaced_before_use(
    pg_app, server, killer, monkeypatch
):
    """No round trip for the pool's check on a connection given back moments ago (a busy process's), but a pooled
    connection whose server ended it meanwhile is found by a look at its socket, pinged and replaced before the
    request gets it: 200, not 503."""
    from backend import extensions

    monkeypatch.setattr(extensions, "PING_AFTER_IDLE_SECONDS", 3600.0)  # only the socket can tell
    headers = merchant_of(pg_app).headers
    pids = _request_pids(pg_app)  # (hooks are added before the app's first request)
    intent_id = create_intent(server, headers).json["data"]["intent_id"]
    pings = _count_pings(pg_app, monkeypatch)
    for _ in range(3):
        assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 200
    assert pings == [] and len(set(pids)) == 1, (pings, pids)

    killer.armed = True  # ended after the view: the connection goes back to the pool dead
    assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 200
    assert killer.killed == [pids[-1]]
    again = server.get(f"{INTENTS}/{intent_id}", headers=headers)
    assert again.status_code == 200, again.get_data(as_text=True)
    assert pings == killer.killed, "the ended connection was not pinged"
    assert pids[-1] != killer.killed[0], "the ended connection was used"
    assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 200
    assert pings == killer.killed, "the new connection was pinged although it had just been used"


def test_a_connection_idle_in_the_pool_past_the_window_is_pinged(pg_app, server, monkeypatch):
    from backend import extensions

    headers = merchant_of(pg_app).headers
    pids = _request_pids(pg_app)
    intent_id = create_intent(server, headers).json["data"]["intent_id"]
    pings = _count_pings(pg_app, monkeypatch)
    monkeypatch.setattr(extensions, "PING_AFTER_IDLE_SECONDS", 0.0)  # every checkout is "after the window"
    del pids[:]
    for _ in range(2):
        assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 200
    assert pings == pids and len(pids) == 2, (pings, pids)


def test_a_pooled_connection_found_dead_at_checkout_marks_the_pool_stale(pg_app, server, killer, monkeypatch):
    """As with pool_pre_ping: the checkout's ping that finds its connection gone also marks every connection the
    pool already holds as stale (the server that dropped one has likely dropped them all)."""
    from backend import extensions
    from backend.extensions import db

    monkeypatch.setattr(extensions, "PING_AFTER_IDLE_SECONDS", 3600.0)
    headers = merchant_of(pg_app).headers
    intent_id = create_intent(server, headers).json["data"]["intent_id"]
    with pg_app.app_context():
        db.engine.dispose()
        held = [db.engine.connect() for _ in range(2)]
        before = [c.connection.dbapi_connection.info.backend_pid for c in held]  # type: ignore[union-attr]
        for connection in held:
            connection.close()  # back to the pool; the last one returned is the next one taken
    with killer.admin.begin() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": before[-1]}).scalar()
    killer.wait_gone("pid = :pid", {"pid": before[-1]})
    assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 200
    with pg_app.app_context():
        after = [db.engine.connect() for _ in range(2)]
        pids = {c.connection.dbapi_connection.info.backend_pid for c in after}  # type: ignore[union-attr]
        for connection in after:
            connection.close()
    assert not pids & set(before), "a connection from before the disconnect was reused"


def test_only_a_checkout_after_the_window_is_pinged(pg_app, server, monkeypatch):
    """The window counts from the connection's previous checkout: back-to-back requests send no ping, a request
    after a pause longer than the window does."""
    from backend import extensions

    monkeypatch.setattr(extensions, "PING_AFTER_IDLE_SECONDS", 0.2)
    headers = merchant_of(pg_app).headers
    intent_id = create_intent(server, headers).json["data"]["intent_id"]
    pings = _count_pings(pg_app, monkeypatch)
    for _ in range(3):
        assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 200
    assert pings == []
    time.sleep(0.3)
    assert server.get(f"{INTENTS}/{intent_id}", headers=headers).status_code == 200
    assert len(pings) == 1
