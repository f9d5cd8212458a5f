"""Redis and RQ: queues only wake workers; the database holds every durable fact."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import wraps
from typing import Any, ParamSpec, TypeVar

from flask import Flask, has_app_context
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.utils import now as rq_now
from rq.worker import WorkerStatus

from backend import appstate
from backend.appstate import AppSlot

log = logging.getLogger(__name__)

DEFAULT_QUEUE = "payintent"
REDIS_RETRY_MAX_SECONDS = 10.0

P = ParamSpec("P")
R = TypeVar("R")
_job_app: Flask | None = None


class RedisNotConfigured(RuntimeError):
    pass


def redis_from_url(url: str | None = None, **options: Any) -> Redis:
    url = url or os.environ.get("REDIS_URL")
    if not url:
        raise RedisNotConfigured(
            "REDIS_URL is not set (for example redis://127.0.0.1:6379/0); `make run` starts a private Redis"
        )
    return Redis.from_url(url, **options)


def relayer_queue(base: str, network: str) -> str:
    """The queue of one network's relayer jobs: ``RELAYER_QUEUE:<CAIP-2 id>``. A relayer listens on the
    queues of the networks it holds keys for, so relayers can be split by chain (deploy/healthcheck.py
    knows this naming too)."""
    return f"{base}:{network}"


def queue(name: str, connection: Redis) -> Queue:
    return Queue(name, connection=connection)


def set_job_app(app: Flask | None) -> None:
    """The Flask app jobs run in, handed in by the entry point that runs them (``payintent worker``,
    ``payintent relayer``; tests may too). This module knows no app factory: infrastructure imports no domain."""
    global _job_app
    _job_app = app


def job_app() -> Flask:
    if _job_app is None:
        raise RuntimeError("no app for jobs: the entry point that runs them calls set_job_app(app) first")
    return _job_app


def app_job(func: Callable[P, R]) -> Callable[P, R]:
    """Run an RQ job function inside a fresh app context (its own DB session)."""

    @wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with job_app().app_context():
            return func(*args, **kwargs)

    return wrapper


# Connections each of the app's Redis clients may open: one per thread using it at once (a /pay waiting in BLPOP
# holds one). redis-py's from_url caps its pool at 100 and then raises "Too many connections": above the most threads
# `payintent serve --threads` runs (256).
APP_REDIS_MAX_CONNECTIONS = 512
_REDIS: AppSlot[Redis] = AppSlot("payintent.redis")
_FAST_REDIS: AppSlot[Redis] = AppSlot("payintent.redis.fast")


def app_redis(*, fast: bool = False) -> Redis | None:
    """The current app's Redis connection (made once per app), or None when REDIS_URL is not set.

    ``fast=True`` gives a separate connection with 0.5 s timeouts, for best-effort calls made
    inside other work (waking workers after a commit) that must never stall it.
    """
    if not has_app_context():
        return None
    slot = _FAST_REDIS if fast else _REDIS
    redis = slot.peek()
    if redis is None:
        url = appstate.settings().redis_url
        if not url:
            return None
        options: dict[str, Any] = {"max_connections": APP_REDIS_MAX_CONNECTIONS}
        if fast:
            options |= {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
        # One client per app, made once (get_or_make: under a lock), shared by the worker's threads.
        redis = slot.get_or_make(lambda: redis_from_url(url, **options))
    return redis


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# After a stop signal: a job in progress gets STOP_GRACE_SECONDS to finish, then it is interrupted (StopNow); the
# process exits by STOP_DEADLINE_SECONDS whatever it waits on (an unreachable Redis, a thread that does not end),
# which leaves a webhook POST in flight (10 s deadline) time to finish.
STOP_GRACE_SECONDS = 5.0
STOP_DEADLINE_SECONDS = 15.0


class StopNow(BaseException):
    """Raised into a job still running STOP_GRACE_SECONDS after a stop signal. A BaseException, so a job's
    ``except Exception`` does not swallow it: the job unwinds (its locks and leases released, its open
    transaction rolled back) as if the process had died there, which every job tolerates (the database holds
    the durable facts; the relayer re-checks the chain before sending anything again)."""


class _Stop(SystemExit):
    """A stop signal while no job runs. A SystemExit, which RQ's loop lets through (after its teardown) and which
    an ``except Exception`` on the way, logging's own for one, does not swallow (a StopRequested raised while
    RQ logged a Redis error was swallowed so, and the worker retried Redis until the deadline)."""


_stopping = threading.Event()
_stop_times: list[float] = []  # when (time.monotonic) each stop signal came, in stop_flag_on_signals


def _stop_requested(signum: int, note: str = "") -> None:
    """The first stop signal: note it, and make sure the process is gone by STOP_DEADLINE_SECONDS."""
    if _stopping.is_set():
        return
    _stopping.set()

    def deadline() -> None:
        log.info("%s: stopping%s", signal.Signals(signum).name, note)  # here: logging in a signal handler may clash
        time.sleep(STOP_DEADLINE_SECONDS)
        # Straight to fd 2: the logging handler's lock may be held by a thread stuck writing.
        os.write(2, f"still running {STOP_DEADLINE_SECONDS:.0f}s after the stop signal: exiting now\n".encode())
        os._exit(1)

    threading.Thread(target=deadline, name="stop-deadline", daemon=True).start()


def stop_requested() -> bool:
    """Whether a stop signal ended (or is ending) :func:`work`, as opposed to ``burst`` draining the queues."""
    return _stopping.is_set()


def stop_signal_times() -> list[float]:
    """When (``time.monotonic()``) each stop signal came in :func:`stop_flag_on_signals`, first first."""
    return list(_stop_times)


class StoppableWorker(SimpleWorker):
    """RQ's SimpleWorker, stopping within seconds of SIGTERM, SIGINT or SIGHUP whatever it is doing.

    RQ's own handler writes to Redis inside the signal handler when a job runs (so with Redis gone the
    error lands in the job), waits for the job however long it takes, and ignores SIGHUP. Here: idle, the
    worker stops at once; busy, the job has STOP_GRACE_SECONDS to finish, then StopNow interrupts it
    (SIGALRM, as RQ's HerokuWorker does); a second signal a second or more later interrupts it at once.

    Only RQ's public methods are overridden, and the stop is our own flag (:attr:`stop_requested_at`), read by
    :meth:`heartbeat`, which RQ's loop calls after every job: RQ's own flag and date are private attributes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_requested_at: datetime | None = None

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        """RQ's start of work, then SIGHUP too stops the worker (RQ then binds SIGINT and SIGTERM to
        :meth:`request_stop`, ours; no private hook of RQ is overridden)."""
        super().bootstrap(*args, **kwargs)
        signal.signal(signal.SIGHUP, self.request_stop)

    def request_stop(self, signum: int, frame: Any) -> None:
        busy = self.get_state() == WorkerStatus.BUSY
        _stop_requested(signum, f" after the job in progress (up to {STOP_GRACE_SECONDS:.0f}s)" if busy else "")
        self.stop_requested_at = rq_now()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.request_force_stop)
        if not busy:  # busy: heartbeat() stops RQ's loop once the job is done
            raise _Stop()
        signal.signal(signal.SIGALRM, self._grace_over)  # replaces the job's timeout: it ends sooner
        signal.setitimer(signal.ITIMER_REAL, STOP_GRACE_SECONDS)

    def request_force_stop(self, signum: int, frame: Any) -> None:
        if self.stop_requested_at is not None and (rq_now() - self.stop_requested_at).total_seconds() < 1:
            return  # the same stop twice (the process group's signal and a parent's own, as make sends)
        if self.get_state() == WorkerStatus.BUSY:
            raise StopNow(f"{signal.Signals(signum).name} again: the job in progress is interrupted")
        raise _Stop()

    def heartbeat(self, *args: Any, **kwargs: Any) -> None:
        """RQ beats at each turn of its loops, also while it retries a Redis that has gone: a stop requested
        while idle (whose _Stop a finalizer could have swallowed) or after a job ends here."""
        if self.stop_requested_at is not None and self.get_state() != WorkerStatus.BUSY:
            raise _Stop()
        super().heartbeat(*args, **kwargs)

    def _grace_over(self, signum: int, frame: Any) -> None:
        if self.get_state() == WorkerStatus.BUSY:
            raise StopNow(f"the job did not finish within {STOP_GRACE_SECONDS:.0f}s of the stop signal")


def work(queues: list[str], connection: Redis, *, burst: bool = False, logging_level: str = "INFO") -> None:
    """Run an RQ worker on ``queues`` until it is stopped (SIGTERM, SIGINT, SIGHUP) or, in burst mode, idle.

    RQ survives Redis going away while it waits for a job, but not while a job runs: recording the
    job's end then raises out of its work loop. Here such a loss waits for Redis to answer again
    (backing off up to REDIS_RETRY_MAX_SECONDS) and starts a new worker, so a Redis restart does not
    take the worker or the relayer down with it. The interrupted job needs nothing: the database
    holds every durable fact and the periodic sweeps pick up what it left open.

    A stop signal stops it within seconds whatever it waits on (StoppableWorker, STOP_DEADLINE_SECONDS),
    also while Redis is gone: then the worker's end is simply not recorded there (RQ's registries
    forget a dead worker once its heartbeat expires).
    """
    _stopping.clear()
    # A stop signal raises _Stop, in RQ's loop (StoppableWorker) or outside it (between workers, waiting for
    # Redis); RQ's own StopRequested, should anything raise it, ends the work too.
    with contextlib.suppress(_Stop, StopRequested), _stop_on_signals():
        _work(queues, connection, burst=burst, logging_level=logging_level)


def _work(queues: list[str], connection: Redis, *, burst: bool, logging_level: str) -> None:
    while True:
        worker = StoppableWorker([queue(name, connection) for name in queues], connection=connection)
        try:
            try:
                worker.work(burst=burst, with_scheduler=False, logging_level=logging_level)  # sets RQ loggers' level
                return
            finally:
                _install_stop_handlers()  # RQ leaves its own installed, bound to a worker that is done
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if _stopping.is_set():
                log.info("stopped without Redis (%s): nothing recorded there", type(exc).__name__)
                return
            if burst:
                raise
            log.warning("lost Redis while working (%s); waiting for it, then starting again", type(exc).__name__)
            wait_for_redis(connection)


def _raise_stop(signum: int, _frame: Any) -> None:
    _stop_requested(signum)
    raise _Stop


def _install_stop_handlers() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _raise_stop)


@contextlib.contextmanager
def _stop_signals_to(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Stop signals go to ``handler`` in here (in the main thread; elsewhere nothing changes: signals reach only
    it); the caller's handlers are back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous_handler in previous.items():
            signal.signal(sig, previous_handler)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Stop signals raise _Stop in here (RQ's worker installs its own while it works); the caller's handlers
    are back afterwards."""
    with _stop_signals_to(_raise_stop):
        yield


def _note_stop(signum: int, _frame: Any) -> None:
    _stop_times.append(time.monotonic())
    _stop_requested(signum)


@contextlib.contextmanager
def stop_flag_on_signals() -> Iterator[None]:
    """In here a stop signal only notes the stop (:func:`stop_requested` turns True, STOP_DEADLINE_SECONDS is armed),
    for a loop that checks it between its steps and must never be interrupted inside one (the relayer's: between
    taking a settlement off its list and handing it to a thread); each signal's time is kept
    (:func:`stop_signal_times`). The caller's handlers are back afterwards."""
    _stopping.clear()
    _stop_times.clear()
    with _stop_signals_to(_note_stop):
        yield


def wait_for_redis(connection: Redis, *, until: Callable[[], bool] | None = None) -> None:
    """Until Redis answers PING, retrying after 0.5 s, 1 s, 2 s ... up to REDIS_RETRY_MAX_SECONDS; or until
    ``until()`` (checked every 0.5 s) is True."""
    delay = 0.5
    while True:
        try:
            connection.ping()
            return
        except (RedisConnectionError, RedisTimeoutError):
            waited = 0.0
            while waited < delay:
                if until is not None and until():
                    return
                time.sleep(0.5)
                waited += 0.5
            delay = min(delay * 2, REDIS_RETRY_MAX_SECONDS)
