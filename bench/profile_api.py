"""Where the time of one API request goes: an in-process profile with Flask's test client.

Usage::

    .venv/bin/python -m bench.profile_api                  # PostgreSQL (throwaway embedded server)
    .venv/bin/python -m bench.profile_api --engine sqlite
    .venv/bin/python -m bench.profile_api --pg-url postgresql://postgres@127.0.0.1:5432/test --top 30

For the bare app and for get, list and create it prints the mean wall time per request, the SQL
statements per request and the time spent in them (the cursor's execute, so round trips included), the
round trips per request to PostgreSQL (every execute, commit and rollback on the driver's connection, the
pool's pre-ping too) and to Redis (``--redis-url``: the rate limits' counters there),
then, from cProfile run on CPU time, the CPU per request of the main steps (authentication, pool
checkout, the service call, commit, teardown, ...) and the top functions by own time. No gunicorn,
no sockets: this is the application's own CPU per request, the "app" column of bench/api.py split up.
The API rate limits are on (per key and per IP, set too high to refuse anything) as in a deployment; without
``--redis-url`` they count in the process.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import api as bench_api
from bench import bare_app

warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")


class RoundTrips:
    """Round trips to PostgreSQL (counted on the psycopg2 connection, so whatever path a query takes) and Redis."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def psycopg2_connection_factory(self) -> Any:
        import psycopg2.extensions

        counts = self.counts

        class CountingCursor(psycopg2.extensions.cursor):
            def execute(self, query: Any, vars: Any = None) -> Any:
                connection = self.connection
                if not connection.autocommit and connection.status == psycopg2.extensions.STATUS_READY:
                    counts["pg begin"] += 1  # psycopg2 sends BEGIN on its own first
                counts["pg execute"] += 1
                if os.environ.get("PROFILE_API_TRACE"):
                    print("   SQL:", " ".join(str(query)[:100].split()), file=sys.stderr)
                return super().execute(query, vars)

        class CountingConnection(psycopg2.extensions.connection):
            def cursor(self, *args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("cursor_factory", CountingCursor)
                return super().cursor(*args, **kwargs)

            def commit(self) -> None:
                if self.status != psycopg2.extensions.STATUS_READY:  # no transaction open: psycopg2 sends nothing
                    counts["pg commit"] += 1
                super().commit()

            def rollback(self) -> None:
                if self.status != psycopg2.extensions.STATUS_READY:  # no transaction open: psycopg2 sends nothing
                    counts["pg rollback"] += 1
                super().rollback()

        return CountingConnection

    def install_redis(self) -> None:
        from redis.connection import Connection

        send = Connection.send_packed_command
        counts = self.counts

        def counting_send(self: Any, command: Any, check_health: bool = True) -> None:
            counts["redis"] += 1
            send(self, command, check_health)

        Connection.send_packed_command = counting_send  # type: ignore[method-assign]

    def reset(self) -> None:
        self.counts.clear()


ROUND_TRIPS = RoundTrips()


class SqlCounter:
    """Counts statements and the time spent executing them (per request, via reset/snapshot)."""

    def __init__(self) -> None:
        self.statements: Counter[str] = Counter()
        self.seconds = 0.0
        self._started: list[float] = []

    def install(self, engine: Any) -> None:
        from sqlalchemy import event

        @event.listens_for(engine, "before_cursor_execute")
        def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            self._started.append(time.perf_counter())

        @event.listens_for(engine, "after_cursor_execute")
        def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            self.seconds += time.perf_counter() - self._started.pop()
            self.statements[" ".join(statement.split())[:90]] += 1

    def reset(self) -> None:
        self.statements.clear()
        self.seconds = 0.0


@contextlib.contextmanager
def database(engine: str, pg_url: str | None, workdir: Path) -> Iterator[bench_api.Database]:
    if engine == "sqlite":
        with bench_api.sqlite(workdir) as db:
            yield db
    else:
        with bench_api.postgresql(pg_url, workdir) as db:
            yield db


def build_app(url: str, workdir: Path, redis_url: str | None) -> tuple[Any, str, SqlCounter]:
    # Rate limits on, as deployed, but too high to refuse any of the profile's requests.
    os.environ.update(LOG_LEVEL="WARNING", PAYINTENT_VAR_DIR=str(workdir / "var"), REDIS_URL=redis_url or "",
                      API_RATE_LIMIT_PER_KEY="100000000", API_RATE_LIMIT_PER_IP="100000000")  # fmt: skip
    from backend import app as app_module
    from backend.app import create_app
    from backend.config import Settings
    from backend.extensions import db
    from backend.merchants import services
    from backend.migrate import upgrade

    upgrade(url)
    settings = Settings.from_env()
    settings = type(settings)(**{**settings.__dict__, "database_url": url})
    engine_options = app_module._engine_options

    def counted_engine_options(url: str, pool_size: int | None = None) -> dict[str, Any]:
        options = engine_options(url, pool_size)
        if url.startswith("postgresql"):
            options["connect_args"] = {
                **options["connect_args"], "connection_factory": ROUND_TRIPS.psycopg2_connection_factory()}  # fmt: skip
        return options

    app_module._engine_options = counted_engine_options
    if redis_url:
        ROUND_TRIPS.install_redis()
    app = create_app(settings)
    counter = SqlCounter()
    with app.app_context():
        counter.install(db.engine)
        _, issued = services.create_merchant("profile@example.com", "profile-password")
        merchant_id = issued.key.merchant_id
        services.set_wallet(
            merchant_id, bench_api.WALLET_NETWORK, bench_api.WALLET_ADDRESS, app.extensions["payintent.chains"]
        )
    return app, issued.secret, counter


def timed(label: str, n: int, call: Callable[[], Any], counter: SqlCounter | None) -> float:
    """Mean wall and CPU ms per request (best of 3 rounds, the machine may be shared); returns CPU ms."""
    for _ in range(min(50, n)):  # warm caches, pools and lazy imports
        call()
    rounds = []
    for _ in range(3):
        if counter:
            counter.reset()
        ROUND_TRIPS.reset()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            call()
        rounds.append(((time.perf_counter() - wall) / n * 1000, (time.process_time() - cpu) / n * 1000))
    wall_ms, cpu_ms = min(rounds, key=lambda r: r[1])
    line = f"{label:<8} {wall_ms:7.3f} ms wall  {cpu_ms:7.3f} ms CPU per request"
    if counter:
        statements = sum(counter.statements.values()) / n
        line += f"   SQL: {statements:.1f} statements, {counter.seconds / n * 1000:.3f} ms wall in execute"
    trips = ", ".join(f"{name} {count / n:.2f}" for name, count in sorted(ROUND_TRIPS.counts.items()))
    print(line)
    print(f"           round trips per request: {trips or 'none'}")
    if counter:
        for statement, count in counter.statements.most_common():
            print(f"           {count / n:4.1f} x {statement}")
    return cpu_ms


# Functions whose cumulative CPU is reported per request: (label, path suffix, function name).
WATCHED = [
    ("whole request (Flask wsgi_app)", "flask/app.py", "wsgi_app"),
    ("  authentication, limits included (auth.authenticated)", "backend/merchants/auth.py", "authenticated"),
    ("    rate limits: IP, and the key when counted ahead", "backend/ratelimit.py", "enforce_and_count_ahead"),
    ("    rate limits: the key after its check", "backend/ratelimit.py", "enforce_counted"),
    ("    key lookup alone (session: list, cancel, ...)", "backend/merchants/services.py", "authenticate"),
    ("    key + intent, one statement (get)", "backend/intents/services.py", "key_and_intent"),
    ("    key + wallets, one statement (create)", "backend/intents/services.py", "key_and_wallets"),
    ("      the hot read on the driver's cursor", "backend/extensions.py", "fetch_autocommit"),
    ("  pool checkout (incl. the idle ping)", "sqlalchemy/pool/base.py", "_checkout"),
    ("    the idle ping (extensions.ping_idle_connections)", "backend/extensions.py", "ping_if_idle"),
    ("  webargs/marshmallow body parsing", "webargs/core.py", "parse"),
    ("  services.get_intent()", "backend/intents/services.py", "get_intent"),
    ("  services.new_intent() (the row)", "backend/intents/services.py", "new_intent"),
    ("  services.insert_intent() (the INSERT)", "backend/intents/services.py", "insert_intent"),
    ("  SQLAlchemy Core execute (statements not on the cursor)", "sqlalchemy/engine/base.py", "_execute_clauseelement"),
    ("    payable_networks() (wallet query)", "backend/intents/services.py", "payable_networks"),
    ("  session.commit() (flush + INSERT + COMMIT)", "sqlalchemy/orm/scoping.py", "commit"),
    ("  intent_to_dict()", "backend/intents/services.py", "intent_to_dict"),
    ("  jsonio.dumps()", "backend/jsonio.py", "dumps"),
    ("  teardown: session.remove() (ROLLBACK, pool return)", "sqlalchemy/orm/scoping.py", "remove"),
    ("  SQL statement building (coercions.expect)", "sqlalchemy/sql/coercions.py", "expect"),
    ("  SQL cache key generation", "sqlalchemy/sql/cache_key.py", "_generate_cache_key"),
    ("  ORM row loading (loading.instances)", "sqlalchemy/orm/loading.py", "instances"),
    ("  psycopg2 cursor.execute (client side)", "~", "<method 'execute' of 'psycopg2.extensions.cursor' objects>"),
    ("  psycopg2 commit", "~", "<method 'commit' of 'psycopg2.extensions.connection' objects>"),
    ("  psycopg2 rollback", "~", "<method 'rollback' of 'psycopg2.extensions.connection' objects>"),
]


def profile(label: str, n: int, call: Callable[[], Any], top: int, cpu_ms: float) -> None:
    """cProfile on CPU time; cumulative CPU of WATCHED functions scaled to the unprofiled CPU per request."""
    for _ in range(min(50, n)):
        call()
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(n):
        call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in rows.values())
    print(f"\n--- {label}: CPU per request by function (cumulative; profile scaled to {cpu_ms:.3f} ms) ---")
    for name, path, func in WATCHED:
        cum = sum(ct for (file, _, fn), (_, _, _, ct, _) in rows.items() if fn == func and file.endswith(path))
        calls = sum(nc for (file, _, fn), (_, nc, _, _, _) in rows.items() if fn == func and file.endswith(path))
        if calls:
            share = cum / total if total else 0.0
            print(f"  {name:<54} {share * cpu_ms:6.3f} ms  {100 * share:3.0f}%  ({calls / n:.1f} calls)")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    body = out.getvalue()
    print(f"\n--- {label}: top {top} by own CPU time ({n} requests, profiled; times are totals) ---")
    print(body[body.find("   ncalls") :].rstrip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=bench_api.ENGINES, default="postgresql")
    parser.add_argument("--pg-url", default=None)
    parser.add_argument("-n", type=int, default=1000, help="requests per endpoint")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--redis-url", default=None, help="count the rate limits in this Redis (else in-process)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="payintent-profile-"))
    try:
        return run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace, workdir: Path) -> int:
    with database(args.engine, args.pg_url, workdir) as db:
        print(f"{db.engine} {db.version} ({db.where})")
        app, token, counter = build_app(db.url, workdir, args.redis_url)
        client = app.test_client()
        auth = {"Authorization": f"Bearer {token}"}
        ids = [
            client.post(bench_api.INTENTS, json={"amount_usdc": 10.5, "order_id": f"seed-{i}"}, headers=auth).json[
                "data"
            ]["intent_id"]
            for i in range(200)
        ]
        bare = bare_app.create_app().test_client()
        state = {"i": 0}

        def get() -> None:
            state["i"] += 1
            response = client.get(f"{bench_api.INTENTS}/{ids[state['i'] % len(ids)]}", headers=auth)
            assert response.status_code == 200, response.data

        def list_() -> None:
            response = client.get(f"{bench_api.INTENTS}?limit=20", headers=auth)
            assert response.status_code == 200, response.data

        def create() -> None:
            state["i"] += 1
            body = {"amount_usdc": 10.5, "order_id": f"profile-{state['i']}"}
            response = client.post(bench_api.INTENTS, json=body, headers=auth)
            assert response.status_code == 201, response.data

        def healthz() -> None:
            assert client.get("/healthz").status_code == 200

        timed("bare", args.n, lambda: bare.get("/bare"), None)
        timed("healthz", args.n, healthz, counter)
        get_ms = timed("get", args.n, get, counter)
        list_ms = timed("list", args.n // 4, list_, counter)
        create_ms = timed("create", args.n, create, counter)
        profile("GET /intents/<id>", args.n, get, args.top, get_ms)
        profile("GET /intents?limit=20", args.n // 4, list_, args.top, list_ms)
        profile("POST /intents", args.n, create, args.top, create_ms)
        from backend.extensions import db as sqla

        with app.app_context():
            sqla.engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
