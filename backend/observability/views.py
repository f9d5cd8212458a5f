"""``/readyz`` (public: states only, no URLs) and ``/metrics`` (bearer METRICS_TOKEN; 404 while unset)."""

from __future__ import annotations

import hmac
from typing import Any

from flask import Blueprint, Response, current_app, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backend import appstate
from backend.errors import DomainError, not_found
from backend.observability.health import readiness

bp = Blueprint("observability", __name__)


@bp.get("/readyz")
def readyz() -> Any:
    ready, checks = readiness(current_app)
    return {"status": "ready" if ready else "not_ready", "checks": checks}, 200 if ready else 503


@bp.get("/metrics")
def metrics() -> Any:
    token = appstate.settings().metrics_token
    if not token:
        raise not_found()  # off unless configured: nothing about the service is shown
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise DomainError("UNAUTHORIZED", "Send Authorization: Bearer <METRICS_TOKEN>",
                       headers={"WWW-Authenticate": 'Bearer realm="metrics"'})  # fmt: skip
    registry = appstate.observability().registry
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
