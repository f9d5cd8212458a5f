"""Waking webhook senders: RQ jobs carry no delivery, they only make a worker look at the database.

After a transaction that scheduled deliveries commits, :func:`wake_workers` enqueues one
``deliver_webhooks`` job (coalesced: at most one waits in the queue at a time). The worker's
:class:`Dispatcher` threads then claim and send every due delivery. The periodic sweep enqueues
the same job every few seconds, which brings retries when they fall due and recovers from a
Redis flush or a crashed worker (its leases run out).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import ClassVar

from flask import Flask, current_app
from redis.exceptions import RedisError
from rq import Queue

from backend.queueing import app_job, app_redis
from backend.webhooks import services

log = logging.getLogger(__name__)

WEBHOOK_QUEUE = "payintent-webhooks"
WAKE_KEY = "payintent:webhooks:wake"
_IDLE_POLL_SECONDS = 5.0


def wake_workers() -> None:
    """Ask a worker to deliver what is due now (best effort: the periodic sweep is the safety net)."""
    try:
        redis = app_redis(fast=True)
        if redis is not None and redis.set(WAKE_KEY, "1", nx=True, ex=5):
            Queue(WEBHOOK_QUEUE, connection=redis).enqueue(
                "backend.webhooks.tasks.deliver_webhooks", result_ttl=0, failure_ttl=3600, job_timeout=3600
            )
    except Exception as exc:  # runs after a commit: never let it fail or stall the caller
        log.warning("could not wake webhook workers (the sweep will deliver): %s", type(exc).__name__)


@app_job
def deliver_webhooks() -> int:
    """Deliver what is due: hand over to this process' dispatcher, or send inline (burst mode, tests)."""
    redis = app_redis()
    if redis is not None:
        with contextlib.suppress(RedisError):
            redis.delete(WAKE_KEY)  # before looking, so a commit after this point wakes us again
    dispatcher = Dispatcher.current
    if dispatcher is not None:
        dispatcher.poke()
        return 0
    settings = current_app.config["PAYINTENT_SETTINGS"]
    return services.deliver_due(
        allow_private=settings.webhook_allow_private_targets, deadline=settings.webhook_timeout_seconds
    )


class Dispatcher:
    """A worker process' webhook senders: threads that each claim and send one due delivery at a time."""

    current: ClassVar[Dispatcher | None] = None

    def __init__(self, app: Flask, size: int) -> None:
        self.app = app
        self.size = size
        self._cond = threading.Condition()
        self._generation = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self) -> Dispatcher:
        for n in range(self.size):
            thread = threading.Thread(target=self._run, name=f"webhook-sender-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        Dispatcher.current = self
        return self

    def poke(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def stop(self, timeout: float = 15.0) -> None:
        """Let in-flight attempts finish (their deadline is 10 s), then return."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=timeout)
        if Dispatcher.current is self:
            Dispatcher.current = None

    def _run(self) -> None:
        settings = self.app.config["PAYINTENT_SETTINGS"]
        seen = -1
        while True:
            with self._cond:
                if self._generation == seen and not self._stopping:
                    self._cond.wait(timeout=_IDLE_POLL_SECONDS)
                seen = self._generation
                if self._stopping:
                    return
            try:
                with self.app.app_context():
                    while not self._stopping and services.deliver_one(
                        allow_private=settings.webhook_allow_private_targets,
                        deadline=settings.webhook_timeout_seconds,
                    ):
                        pass
            except Exception:  # database down: log, wait, try again; leases keep others safe
                log.exception("webhook sender failed; retrying shortly")
                with self._cond:
                    self._cond.wait(timeout=1.0)
