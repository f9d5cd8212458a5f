"""The stack bench/load needs: bench/pay's stack (devnet, Redis, PostgreSQL, API, relayers) plus a
`payintent worker`, a webhook receiver and many merchants."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import api as bench_api
from bench._common import HOST, BenchError
from bench.load.measure import WEBHOOK_EVENTS, WEBHOOKS, Merchant, call
from bench.pay.stack import Stack as PayStack
from bench.webhooks.measure import ReceiverClient
from harness import servers
from harness.ready import wait_all_registered

# --- the stack ---------------------------------------------------------------------------------------


class LoadStack(PayStack):
    """bench.pay's stack (devnet, Redis, PostgreSQL, API, relayers, no proxy), plus many merchants, one
    `payintent worker` and a webhook receiver."""

    def __init__(self, workdir: Path, procs: common.ProcessSet, workers: int) -> None:
        super().__init__(workdir, procs, workers)
        self.worker: subprocess.Popen[Any] | None = None
        self.merchants: list[Merchant] = []
        self.buyers: list[Any] = []  # LocalAccount: the devnet's funded buyers

    def start_devnet(self, stack: contextlib.ExitStack) -> None:
        from eth_account import Account

        super().start_devnet(stack)
        self.buyers = [Account.from_key(b["private_key"]) for b in self.devnet_info["buyers"]]

    def env(self, accounts: int | None = None) -> dict[str, str]:
        return {**super().env(accounts), "WEBHOOK_ALLOW_PRIVATE_TARGETS": "1"}  # the receiver is on 127.0.0.1

    def start_receiver(self) -> None:
        log = self.workdir / "receiver.log"
        self.receiver_proc, port = servers.start_helper(
            self.procs, "bench.webhooks", ["--receiver"], log, "webhook receiver"
        )
        self.receiver = ReceiverClient(port)
        self.receiver_url = f"http://{HOST}:{port}/webhooks"
        self.receiver.count()

    def create_merchants(self, database: bench_api.Database, count: int) -> None:
        """Migrate, then create `count` merchants in-process (the service's functions), each with an API key
        and a payout wallet of its own on every network."""
        from dataclasses import replace

        from eth_account import Account

        from backend.app import create_app
        from backend.chains.registry import ChainRegistry
        from backend.config import Settings
        from backend.extensions import db
        from backend.merchants import services

        self.database = database
        common.payintent(self.env(), "db", "upgrade")
        chains_file = self.chains_file[max(self.chains_file)]
        settings = replace(
            Settings.from_env(), database_url=database.url, redis_url=self.redis_url, chains_file=chains_file,
            log_level="WARNING", secret_key=secrets.token_hex(32),
        )  # fmt: skip
        app = create_app(settings, chains=ChainRegistry.load(chains_file))
        with app.app_context():
            for i in range(count):
                created, issued = services.create_merchant(f"load-{i}@example.com", "bench-password", f"Shop {i}")
                payout = Account.from_key(secrets.token_bytes(32)).address
                for network in self.networks:
                    services.set_wallet(created.id, network, payout, app.extensions["payintent.chains"])
                self.merchants.append(Merchant(i, created.id, issued.secret, payout))
            db.session.remove()
            db.engine.dispose()

    def register_webhooks(self, count: int) -> None:
        """The first `count` merchants register an endpoint at the receiver, through the API."""
        for merchant in self.merchants[:count]:
            body = {"url": self.receiver_url, "events": WEBHOOK_EVENTS}
            answer = call(self.api_port, "POST", WEBHOOKS, merchant.api_key, body)
            if answer.status != 201:
                raise BenchError(f"POST {WEBHOOKS}: HTTP {answer.status}: {str(answer.body)[:300]}")
            merchant.webhook_id = str(answer.body["data"]["webhook_id"])

    def start_worker(self) -> None:
        from backend.webhooks.tasks import WEBHOOK_QUEUE

        self.worker = common.start_service(self.procs, "worker", self.env(), self.workdir / "worker.log")
        worker = self.worker

        def check() -> None:
            if worker.poll() is not None:
                tail = (self.workdir / "worker.log").read_text(errors="replace")[-2000:]
                raise BenchError(f"the worker exited with {worker.returncode}:\n{tail}")

        wait_all_registered(self.redis, WEBHOOK_QUEUE, [worker], "worker", check, timeout=90, poll=0.2)

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.procs.stop(self.worker, grace=20)
            self.worker = None

    def log_problems(self) -> list[str]:
        problems = super().log_problems()
        log = self.workdir / "worker.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        bad = [line for line in lines if "Traceback" in line or "ERROR" in line or "WARNING" in line]
        if bad:
            problems.append(f"{log.name}: {len(bad)} error/warning lines, e.g. {bad[0][:200]}")
        return problems

    def load_cpu_groups(self) -> common.CpuGroups:
        worker = self.worker
        return common.CpuGroups(
            {
                "API": lambda: common.process_tree(self.api_pid),
                "relayers": lambda: {p.pid for p in self.relayers},
                "worker": lambda: common.process_tree(worker.pid) if worker else set(),
                "PostgreSQL": self.database.pids,
                "Redis": lambda: {self.redis_proc.pid},
                "Anvil": lambda: set(self.anvil_pids),
                "receiver": lambda: {self.receiver_proc.pid},
            },
            "clients",
        )

    def wait_webhooks_settled(self, timeout: float) -> None:
        """Until no delivery is pending (the worker has sent every one), or `timeout` s."""
        deadline = time.monotonic() + timeout
        while query(self.database.url, "SELECT count(*) AS n FROM webhook_deliveries WHERE status = 'pending'")[0].n:
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)


def query(url: str, sql: str, **params: Any) -> list[Any]:
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params))
    finally:
        engine.dispose()
