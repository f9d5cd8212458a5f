"""Readiness (``GET /readyz``): the database, Redis and every configured chain's RPC answer.

Each check reports ``ok``, its time in ms and, on failure, a short reason that names no URL or
secret. Chain answers come from :class:`backend.observability.chains.ChainProbes` (2 s timeout,
cached 5 s), so frequent probes cannot hammer an RPC.
"""

from __future__ import annotations

from typing import Any

from flask import Flask
from sqlalchemy import text

from backend import appstate
from backend.extensions import db
from backend.observability.chains import Outcome, ProbeError, timed
from backend.queueing import app_redis


def _database() -> None:
    with db.engine.connect() as connection:
        connection.execute(text("SELECT 1"))


def _redis() -> None:
    redis = app_redis(fast=True)
    if redis is None:
        raise ProbeError("REDIS_URL is not set")
    redis.ping()


def readiness(app: Flask) -> tuple[bool, dict[str, Any]]:
    """(all ready, the checks as JSON: database, redis, chains by network)."""
    checks = {"database": timed(_database)[0], "redis": timed(_redis)[0]}
    chains = appstate.observability(app).probes.readiness()
    ready = all(c.ok for c in checks.values()) and all(c.ok for c in chains.values())
    body = {name: _public(outcome) for name, outcome in checks.items()}
    body["chains"] = {network: _public(outcome) for network, outcome in sorted(chains.items())}
    return ready, body


def _public(outcome: Outcome) -> dict[str, Any]:
    answer: dict[str, Any] = {"ok": outcome.ok, "ms": outcome.ms}
    if outcome.error:
        answer["error"] = outcome.error
    return answer
