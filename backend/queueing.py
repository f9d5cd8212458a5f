"""Redis and RQ: queues only wake workers; the database holds every durable fact."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any, TypeVar

from flask import Flask
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue, SimpleWorker

log = logging.getLogger(__name__)

DEFAULT_QUEUE = "payintent"
REDIS_RETRY_MAX_SECONDS = 10.0

F = TypeVar("F", bound=Callable[..., Any])
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
    """The Flask app jobs run in (the worker sets it; tests may too)."""
    global _job_app
    _job_app = app


def job_app() -> Flask:
    global _job_app
    if _job_app is None:
        from backend.app import create_app

        _job_app = create_app()
    return _job_app


def app_job(func: F) -> F:
    """Run an RQ job function inside a fresh app context (its own DB session)."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with job_app().app_context():
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def app_redis(*, fast: bool = False) -> Redis | None:
    """The current app's Redis connection (made once per app), or None when REDIS_URL is not set.

    ``fast=True`` gives a separate connection with 0.5 s timeouts, for best-effort calls made
    inside other work (waking workers after a commit) that must never stall it.
    """
    from flask import current_app, has_app_context

    if not has_app_context():
        return None
    name = "payintent.redis.fast" if fast else "payintent.redis"
    redis = current_app.extensions.get(name)
    if redis is None:
        url = current_app.config["PAYINTENT_SETTINGS"].redis_url
        if not url:
            return None
        options = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5} if fast else {}
        redis = current_app.extensions[name] = redis_from_url(url, **options)
    return redis


def work(queues: list[str], connection: Redis, *, burst: bool = False, logging_level: str = "INFO") -> None:
    """Run an RQ ``SimpleWorker`` on ``queues`` until it is stopped (SIGTERM/SIGINT) or, in burst mode, idle.

    RQ survives Redis going away while it waits for a job, but not while a job runs: recording the
    job's end then raises out of its work loop. Here such a loss waits for Redis to answer again
    (backing off up to REDIS_RETRY_MAX_SECONDS) and starts a new worker, so a Redis restart does not
    take the worker or the relayer down with it. The interrupted job needs nothing: the database
    holds every durable fact and the periodic sweeps pick up what it left open.
    """
    while True:
        worker = SimpleWorker([queue(name, connection) for name in queues], connection=connection)
        try:
            worker.work(burst=burst, with_scheduler=False, logging_level=logging_level)  # RQ sets its loggers' level
            return
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if burst or worker._stop_requested:
                raise
            log.warning("lost Redis while working (%s); waiting for it, then starting again", type(exc).__name__)
            try:
                with _stop_on_signals():
                    wait_for_redis(connection)
            except _Stop:
                return


class _Stop(Exception):
    """SIGTERM or SIGINT while waiting for Redis: the worker stops (there is no job to finish)."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise _Stop

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for_redis(connection: Redis) -> None:
    """Until Redis answers PING, retrying after 0.5 s, 1 s, 2 s ... up to REDIS_RETRY_MAX_SECONDS."""
    delay = 0.5
    while True:
        try:
            connection.ping()
            return
        except (RedisConnectionError, RedisTimeoutError):
            time.sleep(delay)
            delay = min(delay * 2, REDIS_RETRY_MAX_SECONDS)
