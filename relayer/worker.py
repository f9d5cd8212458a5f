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
