"""``payintent relayer``: an RQ worker on the relayer queue, the only process holding relay keys."""

from __future__ import annotations

import logging

from flask import Flask
from redis import Redis
from rq import SimpleWorker

from backend.queueing import queue, set_job_app
from relayer import tasks
from relayer.keys import load_relay_accounts

log = logging.getLogger(__name__)


def run_relayer(app: Flask, connection: Redis, *, burst: bool = False) -> None:
    accounts = load_relay_accounts(app.extensions["payintent.chains"])
    tasks.RELAY_ACCOUNTS.clear()
    tasks.RELAY_ACCOUNTS.update(accounts)
    for network, loaded in accounts.items():
        log.info("relayer: %d relay account(s) on %s: %s", len(loaded), network, ", ".join(a.address for a in loaded))
    set_job_app(app)
    queue_name = app.config["PAYINTENT_SETTINGS"].relayer_queue
    worker = SimpleWorker([queue(queue_name, connection)], connection=connection)
    worker.work(burst=burst, with_scheduler=False, logging_level="INFO")


def run_pool(processes: int, argv: list[str]) -> int:
    """Supervise ``processes`` relayer processes (one job at a time each), restarting any that dies.

    Each job leases a free relay account of its chain, so N processes use up to N accounts of a
    chain in parallel. SIGTERM/SIGINT stop them all.
    """
    import signal
    import subprocess
    import time

    children: list[subprocess.Popen[bytes]] = [subprocess.Popen(argv) for _ in range(processes)]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping:
            for i, child in enumerate(children):
                if child.poll() is not None and not stopping:
                    log.warning("relayer process %d exited with %s; restarting it", child.pid, child.returncode)
                    time.sleep(1)
                    children[i] = subprocess.Popen(argv)
            time.sleep(0.5)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    return 0
