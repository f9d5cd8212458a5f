"""``payintent worker``: an RQ worker plus the ticker that enqueues periodic sweeps.

Several workers may run at once: each periodic job is enqueued at most once per interval
across all of them (a Redis ``SET NX EX`` claim), and every sweep is safe to run twice anyway
because its state changes are conditional updates.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis import Redis

from backend import appstate
from backend.dashboard.tasks import purge_expired_reveals
from backend.idempotency.tasks import purge_idempotency_keys
from backend.intents.tasks import expire_intents
from backend.queueing import DEFAULT_QUEUE, job_app, queue, work
from backend.settlement.tasks import reconcile_settlements
from backend.webhooks.tasks import WEBHOOK_QUEUE, Dispatcher, deliver_webhooks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Periodic:
    func: Callable[[], Any]
    every_seconds: int
    queue: str = DEFAULT_QUEUE


PERIODIC: tuple[Periodic, ...] = (
    Periodic(deliver_webhooks, 2, WEBHOOK_QUEUE),
    Periodic(expire_intents, 10),
    Periodic(reconcile_settlements, 15),
    Periodic(purge_idempotency_keys, 3600),
    Periodic(purge_expired_reveals, 300),
)


def enqueue_due(connection: Redis, periodic: tuple[Periodic, ...] = PERIODIC) -> list[str]:
    """Enqueue each periodic job whose interval has passed; returns the names enqueued."""
    enqueued = []
    for job in periodic:
        name = f"{job.func.__module__}.{job.func.__name__}"
        if connection.set(f"payintent:periodic:{name}", "1", nx=True, ex=job.every_seconds):
            queue(job.queue, connection).enqueue(job.func, job_timeout=600, result_ttl=60, failure_ttl=24 * 3600)
            enqueued.append(name)
    return enqueued


def _ticker(connection: Redis, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            enqueue_due(connection)
        except Exception:  # Redis down: log and keep ticking; the worker reconnects too.
            log.exception("could not enqueue periodic jobs")
        stop.wait(1.0)


def run_worker(
    connection: Redis, *, burst: bool = False, queues: tuple[str, ...] = (WEBHOOK_QUEUE, DEFAULT_QUEUE)
) -> None:
    """Work the queues (webhook wake-ups first). Outside burst mode, also run the periodic ticker and
    the webhook dispatcher threads; in burst mode webhook jobs deliver inline."""
    stop = threading.Event()
    ticker = None
    dispatcher = None
    if not burst:
        app = job_app()
        dispatcher = Dispatcher(app, appstate.settings(app).webhook_concurrency).start()
        ticker = threading.Thread(target=_ticker, args=(connection, stop), name="periodic", daemon=True)
        ticker.start()
    try:
        work(list(queues), connection, burst=burst, logging_level=appstate.settings(job_app()).log_level)
    finally:
        stop.set()
        if ticker is not None:
            ticker.join(timeout=2)
        if dispatcher is not None:
            dispatcher.stop()
