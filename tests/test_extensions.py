"""The engines' connection settings: the pools' sizes (the api's, a relayer's), and on a real PostgreSQL a bounded
connect, and pooled connections that outlive a server that dropped them."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa

from backend.extensions import POSTGRESQL_CONNECT_TIMEOUT_SECONDS
from tests.conftest import make_settings


def with_query(url: str, parameter: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{parameter}"


def driver_dsn(database_url: str) -> str:
    """The libpq connection string the app's engine opens its connections with."""
    from backend.app import create_app
    from backend.extensions import db

    with create_app(make_settings(database_url)).app_context():
        with db.engine.connect() as connection:
            dsn = connection.connection.dbapi_connection.dsn  # type: ignore[union-attr]
        db.engine.dispose()
    return dsn


@pytest.mark.parametrize(("threads", "size", "overflow"), [(None, 5, 15), (1, 1, 0), (4, 4, 0), (32, 10, 0)])
def test_the_api_pool_keeps_5_connections_and_15_more_a_relayer_at_most_10_whatever_its_threads(
    db_url, threads, size, overflow
):
    """A relayer's threads share at most RELAYER_POOL_SIZE connections: 4 relayers of 32 threads once opened
    4 x 47 connections when a block finished their settlements together, past PostgreSQL's max_connections."""
    from backend.app import create_app
    from backend.extensions import db

    with create_app(make_settings(db_url), relayer_threads=threads).app_context():
        pool = db.engine.pool
        assert isinstance(pool, sa.pool.QueuePool)
        assert (pool.size(), pool._max_overflow) == (size, overflow)
        db.engine.dispose()


def test_postgresql_connections_give_up_after_the_connect_timeout_unless_the_url_sets_one(postgresql_url):
    assert f"connect_timeout={POSTGRESQL_CONNECT_TIMEOUT_SECONDS}" in driver_dsn(postgresql_url).split()
    given = driver_dsn(with_query(postgresql_url, "connect_timeout=2")).split()
    assert "connect_timeout=2" in given
    assert sum(p.startswith("connect_timeout=") for p in given) == 1


@pytest.fixture
def silent_postgresql() -> Iterator[str]:
    """A PostgreSQL URL whose server accepts TCP connections and never answers (a hung or half-dead host):
    without a connect timeout, a connection attempt waits forever."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"postgresql+psycopg2://payintent@127.0.0.1:{server.getsockname()[1]}/payintent"
    # Closing the listener resets the connections it never accepted: a thread still waiting ends.


def timed(call: Callable[[], Any], limit: float = 30) -> tuple[Any, float]:
    """``call()``'s result (or exception) and its duration; gives up waiting after ``limit`` seconds."""
    pool = ThreadPoolExecutor(1)
    started = time.monotonic()

    def run() -> Any:
        try:
            return call()
        except Exception as exc:
            return exc

    try:
        return pool.submit(run).result(timeout=limit), time.monotonic() - started
    finally:
        pool.shutdown(wait=False)


def test_an_api_request_to_an_unanswering_database_is_503_after_the_connect_timeout(silent_postgresql, chains):
    from backend.app import create_app
    from backend.extensions import db

    app = create_app(make_settings(silent_postgresql), chains=chains)
    response, elapsed = timed(
        lambda: app.test_client().get("/api/v1/x402/intents", headers={"Authorization": "Bearer sk_test_" + "a" * 43})
    )
    with app.app_context():
        db.engine.dispose()
    assert response.status_code == 503 and response.get_json()["error"]["code"] == "SERVICE_UNAVAILABLE"
    assert POSTGRESQL_CONNECT_TIMEOUT_SECONDS - 1 < elapsed < POSTGRESQL_CONNECT_TIMEOUT_SECONDS + 5


def test_migrations_give_up_on_an_unanswering_database_after_the_connect_timeout(silent_postgresql):
    """`payintent db upgrade` and every command's schema check open their own engine."""
    from backend.migrate import current_revision

    error, elapsed = timed(lambda: current_revision(silent_postgresql))
    assert isinstance(error, sa.exc.OperationalError) and "timeout expired" in str(error)
    assert elapsed < POSTGRESQL_CONNECT_TIMEOUT_SECONDS + 5


def test_a_connection_the_server_killed_does_not_fail_the_next_request(app, client, merchant, db_url):
    """A PostgreSQL restart (or an idle timeout) drops every pooled connection: the next request gets a new one."""
    from backend.extensions import db

    if db.engine.dialect.name != "postgresql":
        pytest.skip("pooled server connections: PostgreSQL only")
    db.session.remove()
    db.engine.dispose()  # the pool starts empty: every connection from here on is seen opening
    pids: list[int] = []
    sa.event.listen(db.engine, "connect", lambda connection, _record: pids.append(connection.get_backend_pid()))
    assert client.get("/api/v1/x402/intents", headers=merchant.headers).status_code == 200
    db.session.remove()  # its connection back in the pool, idle
    assert pids

    admin = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with admin.begin() as connection:
        for pid in pids:
            assert connection.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the backends exit shortly after being told to
        with admin.connect() as connection:
            alive = connection.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(:pids)"), {"pids": pids}
            ).scalar()
        if not alive:
            break
        time.sleep(0.05)
    admin.dispose()
    assert not alive

    response = client.get("/api/v1/x402/intents", headers=merchant.headers)
    assert response.status_code == 200, response.get_data(as_text=True)
    assert len(pids) > 1  # a new connection replaced the killed one
