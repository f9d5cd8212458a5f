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
from typing import Any, ClassVar

from flask import Flask
from rq import Queue
from sqlalchemy import event as sa_event
from sqlalchemy.orm import Session

from backend import appstate
from backend.events import services as events
from backend.events.models import Event
from backend.extensions import db
from backend.queueing import app_job, app_redis
from backend.webhooks import services

log = logging.getLogger(__name__)

WEBHOOK_QUEUE = "payintent-webhooks"
WAKE_KEY = "payintent:webhooks:wake"
_IDLE_POLL_SECONDS = 5.0


def init_app(app: Flask) -> None:
    """Wire webhooks into an app (``create_app`` calls it; nothing happens at import): every event recorded gets
    its deliveries in the same transaction, and a commit that scheduled some wakes the senders. The listeners
    go on the app's session (``db.session``: SQLAlchemy binds them to the class its sessionmaker made for it), not
    on every SQLAlchemy session of the process; once however many apps are made."""
    events.subscribe(_schedule_deliveries)
    session = db.session
    if not sa_event.contains(session, "after_commit", _wake_after_commit):
        sa_event.listen(session, "after_commit", _wake_after_commit)
    if not sa_event.contains(session, "after_rollback", _forget_wake):
        sa_event.listen(session, "after_rollback", _forget_wake)


def _schedule_deliveries(event: Event, endpoint_id: str | None) -> None:
    services.schedule_deliveries(event, endpoint_id=endpoint_id)


def _wake_after_commit(session: Session) -> None:
    if services.wake_requested(session):
        wake_workers()


def _forget_wake(session: Session) -> None:
    services.wake_requested(session)


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
    dispatcher = Dispatcher.current
    if dispatcher is not None:
        dispatcher.poke()  # its senders clear the wake flag when they run out of work
        return 0
    clear_wake_flag()
    return services.deliver_due(**delivery_options(appstate.settings()))


def delivery_options(settings: Any) -> dict[str, Any]:
    """``services.deliver_one``'s keyword arguments from the settings."""
    return {
        "allow_private": settings.webhook_allow_private_targets,
        "deadline": settings.webhook_timeout_seconds,
        "merchant_cap": settings.webhook_max_in_flight_per_merchant,
        "dns_timeout": settings.webhook_dns_timeout_seconds,
    }


def clear_wake_flag() -> None:
    """Let the next commit enqueue a wake-up again. Call before a final look for due deliveries."""
    redis = app_redis(fast=True)
    if redis is not None:
        with contextlib.suppress(Exception):
            redis.delete(WAKE_KEY)


class Dispatcher:
    """A worker process' webhook senders: threads that each claim and send one due delivery at a time.

    A wake-up starts one sender; a sender that claims work wakes one more before sending, so the
    number of busy senders follows the backlog. While senders are draining, the Redis wake flag
    stays set and commits enqueue nothing (the drain picks their deliveries up); the sender that
    finds nothing due clears the flag and looks once more, so no commit is missed.
    """

    current: ClassVar[Dispatcher | None] = None

    def __init__(self, app: Flask, size: int) -> None:
        self.app = app
        self.size = size
        self._cond = threading.Condition()
        self._wanted = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self) -> Dispatcher:
        cap = appstate.settings(self.app).webhook_max_in_flight_per_merchant
        if cap >= self.size:
            log.warning(
                "WEBHOOK_MAX_IN_FLIGHT_PER_MERCHANT=%d is not below WEBHOOK_CONCURRENCY=%d: one merchant's slow "
                "endpoints can hold every webhook sender of this worker",
                cap,
                self.size,
            )
        for n in range(self.size):
            thread = threading.Thread(target=self._run, name=f"webhook-sender-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        Dispatcher.current = self
        return self

    def poke(self) -> None:
        """Wake one idle sender (if all are busy, the next one to finish keeps draining anyway)."""
        with self._cond:
            self._wanted = min(self._wanted + 1, self.size)
            self._cond.notify()

    def stop(self, timeout: float = 15.0) -> None:
        """Let in-flight attempts finish (their deadline is 10 s), then return."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=timeout)
        if Dispatcher.current is self:
            Dispatcher.current = None

    def _wait_for_work(self) -> bool:
        """Block until poked (or the idle poll interval passes); False when stopping."""
        with self._cond:
            if not self._wanted and not self._stopping:
                self._cond.wait(timeout=_IDLE_POLL_SECONDS)
            if self._wanted:
                self._wanted -= 1
            return not self._stopping

    def _drain(self) -> None:
        options = {**delivery_options(appstate.settings(self.app)), "on_claim": self.poke}
        with self.app.app_context():
            while not self._stopping:
                if services.deliver_one(**options):
                    continue
                clear_wake_flag()
                if not services.deliver_one(**options):  # a commit between the last look and the clear
                    return

    def _run(self) -> None:
        while self._wait_for_work():
            try:
                self._drain()
            except Exception:  # database down: log, wait, try again; leases keep others safe
                log.exception("webhook sender failed; retrying shortly")
                with self._cond:
                    self._cond.wait(timeout=1.0)
