"""Process-wide extension objects, bound to the app in :func:`backend.app.create_app`."""

from __future__ import annotations

import contextlib
import logging
import select
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from flask import Flask, g
from flask_smorest import Api
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import JSON, DateTime, MetaData, Select, Table, event, insert
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection, CursorResult, Engine, Result, make_url
from sqlalchemy.exc import DBAPIError, InvalidatePoolError
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    # Every model maps one Table (none maps a join or a select), which Core statements take (insert(X.__table__)).
    __table__: ClassVar[Table]


class PayintentApi(Api):
    """flask-smorest Api whose documented default errors use the service's error envelope."""

    from backend.schemas import ErrorEnvelopeSchema as ERROR_SCHEMA


log = logging.getLogger(__name__)


class PayintentSQLAlchemy(SQLAlchemy):
    """Flask-SQLAlchemy whose end-of-context clean-up cannot fail the request.

    When a request (or a worker's job) ends, its session's transaction is rolled back. If the database
    dropped the connection in the meantime (a crash or restart, ``pg_terminate_backend``, an idle timeout),
    that rollback raises, after the answer was made: Flask's teardown lets the exception out of the WSGI app
    and gunicorn answers its own bare 500 instead. The rollback has nothing to lose there: whatever the
    request committed is kept, whatever it did not commit dies with the connection on the server. So the
    answer stands; the session is invalidated (its connection is thrown away, never returned to the pool)
    and forgotten, and the next request starts from a fresh session and connection."""

    def init_app(self, app: Flask) -> None:
        super().init_app(app)
        app.teardown_appcontext(_close_autocommit_connection)
        with app.app_context():
            for engine in self.engines.values():
                if engine.dialect.driver == "psycopg2":  # kept by the pool that engine.dispose() makes
                    event.listen(engine, "reset", _out_of_autocommit)
                    ping_idle_connections(engine)

    def _teardown_session(self, exc: BaseException | None) -> None:
        registry = self.session.registry
        if not registry.has():
            return
        session = registry()
        try:
            session.close()
        except Exception as error:
            if isinstance(error, DBAPIError) and error.connection_invalidated:
                log.warning("database connection lost before the end of the transaction (nothing uncommitted "
                            "is kept; the answer stands): %s", error.orig or error)  # fmt: skip
            else:
                log.exception("ending the session failed; its connections are discarded")
            try:
                session.invalidate()
            except Exception:
                log.exception("discarding the session's connections failed")
        finally:
            registry.clear()


_AUTOCOMMIT = "_payintent_autocommit_connection"

# A pooled connection checked out again this soon after its previous checkout, whose server has sent nothing
# since, is taken as alive: its checkout sends no ping. A busy process reuses its few connections continuously,
# so a ping on every checkout (SQLAlchemy's pool_pre_ping) was one round trip in two of a GET. HikariCP, the JVM's
# pool, skips its check for the same reason (``aliveBypassWindowMs``, 500 ms by default).
PING_AFTER_IDLE_SECONDS = 0.5
_LAST_USED = "payintent_last_used"


def _server_spoke(dbapi_connection: Any) -> bool:
    """Whether the server sent anything to an idle connection (no query in flight): a server that ends a session
    (a shutdown or restart, ``pg_terminate_backend``, an idle timeout) says so, or closes the socket, which makes
    it readable. A look at the socket, no round trip; a peer that vanished without a word is the idle ping's."""
    try:
        poller = select.poll()
        poller.register(dbapi_connection.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (ValueError, OSError):  # no socket to look at (fileno -1): the ping decides
        return True


def ping_idle_connections(engine: Engine) -> None:
    """In place of the pool's ``pool_pre_ping`` (a round trip on every checkout): a connection is pinged when it
    is checked out ``PING_AFTER_IDLE_SECONDS`` or more after its previous checkout (so a connection held long
    unused is pinged too), or when its server sent something meanwhile (:func:`_server_spoke`). For psycopg2
    (other drivers keep ``pool_pre_ping``: ``app._engine_options``). One the server dropped is then replaced before the
    request gets it, and, as with ``pool_pre_ping``, the pool's older connections are marked stale. What is left
    (a connection lost without a word within the window) fails its first statement: SQLAlchemy (and
    :func:`fetch_autocommit`) then throw it and the pool's older connections away and the request answers 503,
    as it does while the database is down."""
    dialect = engine.dialect

    def connected(dbapi_connection: Any, connection_record: Any) -> None:
        connection_record.info[_LAST_USED] = time.monotonic()

    def ping_if_idle(dbapi_connection: Any, connection_record: Any, connection_proxy: Any) -> None:
        now = time.monotonic()
        last_used = connection_record.info.get(_LAST_USED)
        connection_record.info[_LAST_USED] = now  # the next checkout counts from this one
        try:
            recent = last_used is not None and now - last_used < PING_AFTER_IDLE_SECONDS
            if recent and not _server_spoke(dbapi_connection):
                return
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as exc:
            if dialect.is_disconnect(exc, dbapi_connection, None):
                raise InvalidatePoolError(str(exc)) from exc  # the pool connects again, as after pool_pre_ping
            raise

    event.listen(engine, "connect", connected)
    event.listen(engine, "checkout", ping_if_idle)


_COMPILED: dict[tuple[Select[Any], str], tuple[str, tuple[str, ...]]] = {}


def fetch_autocommit(statement: Select[Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a SELECT built once (a hot path's), as dicts, run on :func:`autocommit_connection`.

    On psycopg2 the statement, compiled once, runs on the driver's cursor (:func:`_on_cursor`): SQLAlchemy's
    execution and result machinery cost about as much CPU as the driver's round trip. Only for statements whose
    parameters are plain strings or numbers and whose columns need no result processing on PostgreSQL (its driver
    returns timezone-aware datetimes and, through the JSON decoders SQLAlchemy registers on every connection, the
    stored JSON)."""
    connection = autocommit_connection()
    dialect = connection.dialect
    if dialect.driver != "psycopg2":
        return [dict(row._mapping) for row in connection.execute(statement, params)]
    compiled = _COMPILED.get((statement, dialect.name))
    if compiled is None:
        sql = str(statement.compile(dialect=dialect))
        compiled = _COMPILED.setdefault((statement, dialect.name), (sql, tuple(statement.selected_columns.keys())))
    sql, names = compiled
    rows = _on_cursor(connection, sql, params, fetch=True)
    return [dict(zip(names, row, strict=True)) for row in rows]


_INSERTS: dict[tuple[Table, Any, tuple[str, ...]], tuple[str, tuple[tuple[str, Any], ...]]] = {}


def insert_autocommit(table: Table, row: dict[str, Any]) -> None:
    """One INSERT of ``row`` (column name -> value) into ``table`` on :func:`autocommit_connection`: it commits
    by itself. On psycopg2 the statement is compiled once per set of columns and run on the driver's cursor
    (:func:`_on_cursor`), each value put through its column type's own bind processing first, as ``execute``
    does (JSON written with the engine's serializer, ``UTCDateTime``'s refusal of a naive datetime)."""
    connection = autocommit_connection()
    dialect = connection.dialect
    if dialect.driver != "psycopg2":
        connection.execute(insert(table), row)
        return
    keys = tuple(row)
    prepared = _INSERTS.get((table, dialect, keys))  # the dialect: its JSON serializer is the engine's
    if prepared is None:
        compiled = insert(table).compile(dialect=dialect, column_keys=list(keys))
        if set(compiled.params) != set(keys) or compiled.escaped_bind_names:  # a bind not named as its column
            raise ValueError(f"INSERT into {table.name}: bind names {sorted(compiled.params)} are not the columns")
        processors = tuple((key, table.c[key].type.dialect_impl(dialect).bind_processor(dialect)) for key in keys)
        prepared = _INSERTS.setdefault((table, dialect, keys), (str(compiled), processors))
    sql, processors = prepared
    params = {key: row[key] if process is None else process(row[key]) for key, process in processors}
    _on_cursor(connection, sql, params, fetch=False)


def _on_cursor(connection: Connection, sql: str, params: dict[str, Any], *, fetch: bool) -> list[Any]:
    """Run compiled ``sql`` on the driver's cursor of ``connection`` (psycopg2); its rows when ``fetch``. A driver
    error is raised as SQLAlchemy's ``DBAPIError`` subclass for it (as from ``execute``); on a disconnect the
    connection is thrown away and the pool's older connections are marked stale (replaced at their next
    checkout), as ``execute`` does, and the request answers 503. Unlike ``execute``, the engine's
    ``handle_error`` listeners are not called (there are none)."""
    dialect = connection.dialect
    dbapi_connection = connection.connection.dbapi_connection
    assert dbapi_connection is not None
    try:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(sql, params)
            return list(cursor.fetchall()) if fetch else []
        finally:
            cursor.close()
    except dialect.loaded_dbapi.Error as exc:
        lost = dialect.is_disconnect(exc, dbapi_connection, None)
        if lost:  # what SQLAlchemy's execute does on a disconnect (Connection._handle_dbapi_exception)
            connection.engine.pool._invalidate(connection.connection, exc)
            connection.invalidate(exc)
        raise DBAPIError.instance(sql, params, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost) from exc


def taken_autocommit_connection() -> Connection | None:
    """The app context's :func:`autocommit_connection` if it took one (tests end its backend)."""
    connection: Connection | None = g.get(_AUTOCOMMIT)
    return connection


def release_autocommit_connection() -> None:
    """The app context's :func:`autocommit_connection` (if it took one) back to the pool now: a request that goes
    on in the session's transaction holds one connection at a time; the pool's reset takes it out of autocommit
    (:func:`_out_of_autocommit`). A connection the database dropped goes back too (it holds nothing uncommitted;
    :func:`ping_idle_connections` replaces it when next checked out)."""
    connection: Connection | None = g.pop(_AUTOCOMMIT, None)
    if connection is None or connection.closed:  # closed: someone else already gave it back
        return
    try:
        connection.close()
    except Exception:
        log.exception("returning the autocommit connection failed; it is discarded")
        with contextlib.suppress(Exception):
            connection.invalidate()


def _close_autocommit_connection(exc: BaseException | None) -> None:
    release_autocommit_connection()


def _out_of_autocommit(dbapi_connection: Any, connection_record: Any, reset_state: Any) -> None:
    """The pool's reset (psycopg2 engines): a connection goes back to the pool out of autocommit whichever way it
    goes back (:func:`release_autocommit_connection`, a ``with`` block, the garbage collector's clean-up of a
    connection nobody returned): the next checkout may be a session's transaction, which must be atomic. The flag
    is the driver's, set on the client: no round trip. A connection in autocommit has no transaction open to stop
    the change; a closed one is left alone (:func:`ping_idle_connections` replaces it)."""
    if not dbapi_connection.closed and dbapi_connection.autocommit:
        dbapi_connection.autocommit = False


db = PayintentSQLAlchemy(model_class=Base)
api = PayintentApi()

if TYPE_CHECKING:
    # The models' base class as the type checker sees it: Flask-SQLAlchemy builds db.Model from Base at run time,
    # and a class held in an attribute cannot be a base class to mypy.
    Model = Base
else:
    Model = db.Model


def autocommit_connection() -> Connection:
    """The app context's (a request's) connection on which each statement commits by itself: no BEGIN, COMMIT or
    ROLLBACK round trips. For a hot path's reads and a lone INSERT, never for statements that must commit
    together. Checked out of the app's pool at the first call (once per request however many statements use it)
    and returned at the end of the app context (:func:`release_autocommit_connection`; do not close it yourself).
    Whichever way it goes back to the pool, the pool's reset takes it out of autocommit (:func:`_out_of_autocommit`).

    On psycopg2 the driver's ``autocommit`` flag is set and cleared directly: SQLAlchemy's
    ``isolation_level="AUTOCOMMIT"`` costs a round trip (``SET default_transaction_isolation``) every time the
    connection goes back to the pool."""
    connection: Connection | None = g.get(_AUTOCOMMIT)
    if connection is not None and connection.closed:
        # Closed by someone else (a ``with`` block): taking a second one would hold two connections at once.
        raise RuntimeError("the app context's autocommit connection was closed; only release_autocommit_connection()"
                           " may return it")  # fmt: skip
    if connection is None:
        connection = db.engine.connect()
        if connection.dialect.driver == "psycopg2":
            connection.connection.dbapi_connection.autocommit = True  # type: ignore[union-attr]
        else:
            connection = connection.execution_options(isolation_level="AUTOCOMMIT")
        setattr(g, _AUTOCOMMIT, connection)
    return connection


def rowcount(result: Result[Any]) -> int:
    """How many rows an INSERT, UPDATE or DELETE run by ``db.session.execute`` matched.

    ``Session.execute`` is typed to return a Result; for those statements it is a CursorResult, which has the count."""
    if not isinstance(result, CursorResult):
        raise TypeError(f"{type(result).__name__} has no rowcount: not the result of an INSERT, UPDATE or DELETE")
    return result.rowcount


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC, returns timezone-aware UTC on every engine (SQLite keeps no zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are not stored; use backend.clock.now()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


JSONType = JSON().with_variant(JSONB(), "postgresql")

# How long opening a PostgreSQL connection may take: an unreachable server fails the request (503) instead of
# holding it for the TCP timeout. ``?connect_timeout=N`` in DATABASE_URL overrides it.
POSTGRESQL_CONNECT_TIMEOUT_SECONDS = 5


def connect_args(database_url: str) -> dict[str, Any]:
    """The driver's connection arguments, for every engine of ours (the app's and the migrations')."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        return {"timeout": 30, "check_same_thread": False}
    if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
        return {"connect_timeout": POSTGRESQL_CONNECT_TIMEOUT_SECONDS}
    return {}


@event.listens_for(Engine, "connect")
def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    """WAL lets readers run beside the one writer; busy_timeout makes writers queue, not fail."""
    module = type(dbapi_connection).__module__
    if not module.startswith("sqlite3"):
        return
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
