"""Redis and RQ: queues only wake workers; the database holds every durable fact."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from flask import Flask
from redis import Redis
from rq import Queue

DEFAULT_QUEUE = "payintent"

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
