"""``payintent``: the admin CLI for operators, tests and QA.

Every command prints one JSON object on stdout. Bad input exits non-zero with
``{"success": false, "error": {"code", "message"}}`` on stdout and the message on stderr.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click

from backend import appstate
from backend.config import DEVELOPMENT_SECRET_KEY, MAX_RELAYER_THREADS, Settings
from backend.jsonio import dumps
from payintent.jsonlimits import has_surrogate

if TYPE_CHECKING:
    from flask import Flask

log = logging.getLogger(__name__)

# Each command imports what it uses inside itself, on purpose: importing the app (Flask, SQLAlchemy, web3, every
# domain) costs seconds, which `payintent --help`, `serve` (it execs gunicorn), `dev` (it spawns the processes) and
# the relayer pool's supervisor never pay. This module is an entry point: it may import anything.


class CLIError(click.ClickException):
    def __init__(self, code: str, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.code = code
        # click declares exit_code a ClassVar (each exception class has one) but reads it from the instance;
        # a CLIError carries the code of its failure.
        self.exit_code = exit_code  # type: ignore[misc]


def _emit(obj: dict[str, Any]) -> None:
    click.echo(dumps(obj))


def _app(relayer_threads: int | None = None) -> Flask:
    """The Flask app, with the schema checked (the default local SQLite is upgraded for you)."""
    from backend.app import create_app
    from backend.chains.registry import ChainConfigError
    from backend.migrate import SchemaOutOfDate, ensure_schema

    settings = Settings.from_env()
    try:
        ensure_schema(settings.database_url, auto_upgrade=settings.default_database)
        return create_app(settings, relayer_threads=relayer_threads)
    except SchemaOutOfDate as exc:
        raise CLIError("SCHEMA_OUT_OF_DATE", str(exc), exit_code=1) from None
    except ChainConfigError as exc:
        raise CLIError("INVALID_CHAINS_FILE", str(exc), exit_code=1) from None


def _loopback(host: str) -> bool:
    """Whether ``serve --host`` only listens on this machine: a loopback address, or a name that resolves
    only to loopback addresses (``localhost``). ``0.0.0.0``, ``::`` and any other address are not."""
    import ipaddress
    import socket

    name = host.strip().removeprefix("[").removesuffix("]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        found = {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(address).is_loopback for address in found)


def _refuse_development_secret_key(host: str) -> None:
    """``serve`` reachable from other machines with the public development SECRET_KEY would let anyone forge
    a dashboard session: refused. On loopback (``make run``, tests) it stays a warning."""
    if Settings.from_env().secret_key == DEVELOPMENT_SECRET_KEY and not _loopback(host):
        raise CLIError(
            "INSECURE_SECRET_KEY",
            f"SECRET_KEY is the development default, which anyone can read in the source: refusing to serve on "
            f"{host}, which is not a loopback address. Set SECRET_KEY (or SECRET_KEY_FILE in the image) to a long "
            f"random value, e.g. the output of: python -c 'import secrets; print(secrets.token_urlsafe(48))'",
            exit_code=1,
        )


def _warn_about_development_settings(app: Flask, *, sessions: bool = False) -> None:
    """Logged as ``serve``, ``worker`` and ``relayer`` start: settings fit for development only. Not refused:
    the tests run these processes so (``payintent dev`` names its SQLite file in DATABASE_URL and makes a
    SECRET_KEY); but ``serve`` on a non-loopback address refuses the development SECRET_KEY first
    (:func:`_refuse_development_secret_key`). ``sessions``: the process serves the dashboard, the only user
    of SECRET_KEY."""
    from sqlalchemy.engine import make_url

    settings: Settings = appstate.settings(app)
    if settings.default_database:
        log.warning(
            "DATABASE_URL is not set: using the SQLite file %s, for development only; "
            "set DATABASE_URL to a PostgreSQL database in production",
            make_url(settings.database_url).database,
        )
    if sessions and settings.secret_key == DEVELOPMENT_SECRET_KEY:
        log.warning("SECRET_KEY is the development default: set SECRET_KEY before exposing the dashboard")


SLOW_CLIENTS_WARNING = "must run behind a buffering reverse proxy"
# Threads per gunicorn worker of ``serve`` (WEB_THREADS): 32 /pay calls may wait for the chain at once per worker
# and reads still get a thread. The database pool (backend.app) holds fewer connections: a waiting /pay holds none.
DEFAULT_WEB_THREADS = 32


def _warn_without_a_proxy(app: Flask, host: str) -> None:
    """``serve`` reachable from other machines with no proxy declared (TRUSTED_PROXY_HOPS=0): each of gunicorn's
    worker threads holds one connection until its request is whole, so a few dozen clients sending a byte every few
    seconds (slowloris) hold them all. Warned, not refused: a proxy may be in front whose headers the api ignores."""
    settings: Settings = appstate.settings(app)
    if settings.trusted_proxy_hops == 0 and not _loopback(host):
        log.warning(
            "serving on %s, reachable from other machines, with no proxy in front (TRUSTED_PROXY_HOPS=0): the api %s "
            "(nginx with deploy/nginx.conf, as docker-compose.yml runs it; docs/deploy.md#the-proxy). Each worker "
            "thread reads a request whole with no timeout of its own: a few dozen clients sending or reading a request "
            "a byte at a time hold every thread and the api stops answering. Behind the proxy set TRUSTED_PROXY_HOPS=1",
            host,
            SLOW_CLIENTS_WARNING,
        )


@click.group(help=__doc__)
def cli() -> None:
    pass


# --- merchants -------------------------------------------------------------------------------


@cli.group(help="Merchant accounts.")
def merchant() -> None:
    pass


@merchant.command("create", help="Create a merchant and its first API key (shown once).")
@click.option("--email", required=True)
@click.option("--password", required=True)
@click.option("--name", default=None)
def merchant_create(email: str, password: str, name: str | None) -> None:
    from backend.merchants import services

    with _app().app_context():
        created, issued = services.create_merchant(email, password, name)
        _emit(
            {
                "merchant_id": created.id,
                "email": created.email,
                "name": created.name,
                "key_id": issued.key.id,
                "api_key": issued.secret,
            }
        )


@cli.group(help="API keys.")
def key() -> None:
    pass


@key.command("create", help="Issue a new API key (shown once).")
@click.option("--merchant", "merchant_id", required=True)
def key_create(merchant_id: str) -> None:
    from backend.merchants import services

    with _app().app_context():
        issued = services.create_api_key(merchant_id)
        _emit({"key_id": issued.key.id, "api_key": issued.secret, "merchant_id": merchant_id})


@key.command("revoke", help="Revoke an API key; it stops working at once.")
@click.option("--merchant", "merchant_id", required=True)
@click.option("--key", "key_id", required=True)
def key_revoke(merchant_id: str, key_id: str) -> None:
    from backend.clock import isoformat
    from backend.merchants import services

    with _app().app_context():
        revoked = services.revoke_api_key(merchant_id, key_id)
        _emit({"key_id": revoked.id, "merchant_id": merchant_id, "revoked_at": isoformat(revoked.revoked_at)})


@key.command("list", help="List a merchant's keys (prefix and last use; never the secret).")
@click.option("--merchant", "merchant_id", required=True)
def key_list(merchant_id: str) -> None:
    from backend.clock import isoformat
    from backend.merchants import services

    with _app().app_context():
        services.get_merchant(merchant_id)
        keys = services.list_api_keys(merchant_id)
        _emit(
            {
                "merchant_id": merchant_id,
                "keys": [
                    {
                        "key_id": k.id,
                        "prefix": k.display_prefix,
                        "created_at": isoformat(k.created_at),
                        "last_used_at": isoformat(k.last_used_at),
                        "revoked_at": isoformat(k.revoked_at),
                    }
                    for k in keys
                ],
            }
        )


@cli.group(help="Payout wallets (one per merchant per network).")
def wallet() -> None:
    pass


@wallet.command("set", help="Register or replace the merchant's wallet on a network.")
@click.option("--merchant", "merchant_id", required=True)
@click.option("--network", required=True, help="CAIP-2 id, e.g. eip155:84532")
@click.option("--address", required=True)
def wallet_set(merchant_id: str, network: str, address: str) -> None:
    from backend.merchants import services

    app = _app()
    with app.app_context():
        saved = services.set_wallet(merchant_id, network, address, appstate.chains(app))
        _emit({"wallet_id": saved.id, "merchant_id": merchant_id, "network": saved.network, "address": saved.address})


@wallet.command("list", help="List the merchant's wallets.")
@click.option("--merchant", "merchant_id", required=True)
def wallet_list(merchant_id: str) -> None:
    from backend.merchants import services

    with _app().app_context():
        services.get_merchant(merchant_id)
        _emit(
            {
                "merchant_id": merchant_id,
                "wallets": [
                    {"network": w.network, "address": w.address, "verified": w.verified_at is not None}
                    for w in services.list_wallets(merchant_id)
                ],
            }
        )


# --- operations ------------------------------------------------------------------------------


@cli.group(help="Database schema.")
def db() -> None:
    pass


@db.command("upgrade", help="Apply all migrations (SQLite or PostgreSQL, per DATABASE_URL).")
def db_upgrade() -> None:
    from backend.migrate import current_revision, upgrade

    url = Settings.from_env().database_url
    upgrade(url)
    _emit({"database": _redact(url), "revision": current_revision(url)})


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@cli.command(help="Run the API under gunicorn.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--workers", default=None, type=click.IntRange(1, 64), help="Default: WEB_CONCURRENCY or 2 x cores")
@click.option(
    "--threads",
    default=None,
    type=click.IntRange(1, 256),
    help=f"Threads per worker (gthread), each serving one request; default: WEB_THREADS or {DEFAULT_WEB_THREADS}",
)
def serve(host: str, port: int, workers: int | None, threads: int | None) -> NoReturn:
    # _app(): fail fast, with a clear message, on a bad configuration or schema. Warned here, once, rather than
    # by each gunicorn worker's create_app().
    _refuse_development_secret_key(host)
    app = _app()
    _warn_about_development_settings(app, sessions=True)
    _warn_without_a_proxy(app, host)
    count = workers or int(os.environ.get("WEB_CONCURRENCY") or 2 * (os.cpu_count() or 1))
    per_worker = threads or int(os.environ.get("WEB_THREADS") or DEFAULT_WEB_THREADS)
    argv = [
        sys.executable, "-m", "gunicorn",
        "--bind", f"{host}:{port}",
        "--workers", str(count),
        # Threads: a /pay waiting up to PAY_WAIT_SECONDS for the chain holds a thread, not the whole worker
        # (nor a database connection: settlement.flow ends its transaction before it waits).
        "--worker-class", "gthread",
        "--threads", str(per_worker),
        # Logging (no access log: the app logs each request) and metrics across workers.
        "--config", "python:backend.observability.gunicorn_conf",
        "--timeout", "60",
        # On SIGTERM a worker finishes the requests it has: a /pay may still wait PAY_WAIT_SECONDS.
        "--graceful-timeout", str(math.ceil(appstate.settings(app).pay_wait_seconds) + 5),
        # gunicorn's control socket would be ~/.gunicorn/gunicorn.ctl: a write outside the temporary directory
        # (the image's home is not writable) shared by every gunicorn of the user. Nothing of ours uses it.
        "--no-control-socket",
        "backend.app:create_app()",
    ]  # fmt: skip
    os.execvp(argv[0], argv)


@cli.command(help="Run a background worker (periodic sweeps, and later webhooks and reconciliation).")
@click.option("--burst", is_flag=True, help="Drain the queue and exit (tests, cron).")
def worker(burst: bool) -> None:
    from backend.queueing import RedisNotConfigured, redis_from_url, set_job_app
    from backend.worker import run_worker

    app = _app()
    _warn_about_development_settings(app)
    set_job_app(app)
    try:
        connection = redis_from_url(Settings.from_env().redis_url)
    except RedisNotConfigured as exc:
        raise CLIError("REDIS_NOT_CONFIGURED", str(exc), exit_code=1) from None
    run_worker(connection, burst=burst)
    _emit({"worker": "stopped"})


@cli.command(help="Run the relayer: the only process that loads relay keys (RQ worker on the relayer queue).")
@click.option("--burst", is_flag=True, help="Drain the queue and exit (tests).")
@click.option(
    "--processes",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Relayer processes to run (each with --threads settlement threads; one process is the usual shape).",
)
@click.option(
    "--threads",
    default=None,
    type=click.IntRange(1, MAX_RELAYER_THREADS),
    help="Settlements each relayer process runs at once (default: RELAYER_THREADS, 32).",
)
def relayer(burst: bool, processes: int, threads: int | None) -> None:
    from backend.queueing import RedisNotConfigured, redis_from_url
    from relayer.keys import RelayKeyError
    from relayer.worker import run_pool, run_relayer

    threads = threads or Settings.from_env().relayer_threads
    app = _app(relayer_threads=threads)
    if processes > 1:
        from relayer.keys import load_relay_keys

        try:
            load_relay_keys(appstate.chains(app))  # fail fast, once, on bad keys
        except RelayKeyError as exc:
            raise CLIError("RELAY_KEYS", str(exc), exit_code=1) from None
        argv = [sys.argv[0], "relayer", "--threads", str(threads), *(["--burst"] if burst else [])]
        run_pool(processes, argv)
        _emit({"relayer": "stopped", "processes": processes})
        return
    _warn_about_development_settings(app)  # in each process of a pool, not in its supervisor
    try:
        connection = redis_from_url(Settings.from_env().redis_url)
    except RedisNotConfigured as exc:
        raise CLIError("REDIS_NOT_CONFIGURED", str(exc), exit_code=1) from None
    try:
        run_relayer(app, connection, burst=burst, threads=threads)
    except RelayKeyError as exc:
        raise CLIError("RELAY_KEYS", str(exc), exit_code=1) from None
    _emit({"relayer": "stopped"})


@cli.group(
    help="Local chains for development: three Anvils (Base Sepolia, Ethereum Sepolia, Arc ids) with a test USDC, "
    "and a local Solana RPC over LiteSVM with a USDC-like mint."
)
def devnet() -> None:
    pass


def _devnet_call(fn: Callable[..., Any], *args: Any) -> Any:
    from devnet import DevnetError

    try:
        return fn(*args)
    except DevnetError as exc:
        raise CLIError(exc.code, exc.message, exit_code=1) from None


@devnet.command(
    "up",
    help="Start three Anvil chains and the local Solana RPC, deploy a test USDC on each, fund demo buyers and "
    "relay accounts, write var/devnet/chains.json (for CHAINS_FILE) and relay_keys.json. "
    "Does nothing if already running.",
)
@click.option(
    "--port-base",
    type=click.IntRange(1, 65533),
    default=None,
    help="Anvil RPC ports are this and the next two, the Solana RPC the one after "
    "(default: PAYINTENT_DEVNET_PORT_BASE or 8545).",
)
def devnet_up(port_base: int | None) -> None:
    import devnet as local_devnet

    info, _started = _devnet_call(local_devnet.up, port_base)
    _emit(info)


@devnet.command("down", help="Stop the Anvil and Solana RPC processes `devnet up` started.")
def devnet_down() -> None:
    import devnet as local_devnet

    _emit(_devnet_call(local_devnet.down))


@devnet.command("status", help="Whether each chain's process is alive and its RPC answers.")
def devnet_status() -> None:
    import devnet as local_devnet

    _emit(_devnet_call(local_devnet.status))


@cli.command(
    help="Run the whole local stack (what `make run` does) until SIGTERM, SIGINT (Ctrl-C) or SIGHUP, which stop "
    "everything it started."
)
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(1, 65535), envvar="PAYINTENT_DEV_PORT",
    help="The API's port (also PAYINTENT_DEV_PORT); the devnet's are PAYINTENT_DEVNET_PORT_BASE's.",
)  # fmt: skip
def dev(port: int) -> None:
    from backend.devstack import run_dev_stack

    run_dev_stack(port=port)


def _undecodable_argument(args: list[str]) -> int | None:
    """The position (from 1) of the first argument that was not UTF-8: Python keeps its bytes as lone surrogates
    (surrogateescape), which no database, JSON or e-mail address accepts."""
    return next((i for i, arg in enumerate(args, 1) if has_surrogate(arg)), None)


def main(argv: list[str] | None = None) -> NoReturn:
    bad = _undecodable_argument(sys.argv[1:] if argv is None else argv)
    if bad is not None:
        message = f"argument {bad} is not valid UTF-8 text"
        _emit({"success": False, "error": {"code": "USAGE", "message": message}})
        click.echo(f"payintent: {message}", err=True)
        sys.exit(2)
    try:
        cli.main(args=argv, prog_name="payintent", standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except CLIError as exc:
        _emit({"success": False, "error": {"code": exc.code, "message": exc.message}})
        click.echo(f"payintent: {exc.message}", err=True)
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        _emit({"success": False, "error": {"code": "USAGE", "message": exc.format_message()}})
        click.echo(f"payintent: {exc.format_message()}", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        _emit({"success": False, "error": {"code": "ERROR", "message": exc.format_message()}})
        click.echo(f"payintent: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except Exception as exc:  # still one JSON object on stdout; the traceback goes to stderr
        from backend.errors import DomainError

        if isinstance(exc, DomainError):  # a service refused (backend.errors.CATALOG): no traceback
            _emit({"success": False, "error": {"code": exc.code, "message": exc.message}})
            click.echo(f"payintent: {exc.message}", err=True)
            sys.exit(2 if exc.http_status < 500 else 1)  # bad input, like CLIError; else the service's trouble
        import traceback

        traceback.print_exc()
        _emit({"success": False, "error": {"code": "INTERNAL_ERROR", "message": f"{type(exc).__name__}: {exc}"}})
        sys.exit(1)
    sys.exit(0)
