"""Request hooks and set-up of observability for an app.

``init_app`` (called first in ``create_app``) configures logging, registers secrets the logs must
never show, and wraps every request: an ``X-Request-Id`` (the caller's if it is a sane token, else
a new one) is put on every log line of the request and echoed in the response; when the answer is
ready its latency is observed per route and one log line records it. See docs/observability.md.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from flask import Flask, Response, g, request
from prometheus_client import CollectorRegistry

from backend import appstate
from backend.logs import (
    REQUEST_ID_HEADER,
    configure_logging,
    register_rpc_urls,
    register_secret,
    valid_request_id,
)
from backend.observability.chains import ChainProbes
from backend.observability.metrics import REQUEST_DURATION, scrape_registry
from backend.observability.views import bp

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Probes and scrapes come every few seconds: their successful answers are logged at DEBUG only.
_QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
request_log = logging.getLogger("payintent.request")


@dataclass(frozen=True)
class Observability:
    probes: ChainProbes
    registry: CollectorRegistry


def init_app(app: Flask) -> None:
    settings = appstate.settings(app)
    configure_logging(settings.log_level, settings.log_format)
    chains = appstate.chains(app)
    register_rpc_urls(network.rpc_url for network in chains)
    register_secret(settings.secret_key, settings.metrics_token)
    appstate.set_observability(app, Observability(ChainProbes(chains), scrape_registry(app)))
    app.before_request(_start)
    # after_request functions run last-registered first: this one, registered first, sees the final answer.
    app.after_request(_finish)
    app.register_blueprint(bp)


def _start() -> None:
    ctx = g._get_current_object()
    ctx.request_started = time.perf_counter()
    ctx.request_id = valid_request_id(request.headers.get(REQUEST_ID_HEADER)) or uuid.uuid4().hex


def _finish(response: Response) -> Response:
    ctx = g._get_current_object()
    # A LocalProxy method: Flask types `request` as the Request it stands for.
    req = request._get_current_object()  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - getattr(ctx, "request_started", time.perf_counter())
    request_id = getattr(ctx, "request_id", None)
    if request_id:
        response.headers[REQUEST_ID_HEADER] = request_id
    rule = req.url_rule
    route = rule.rule if rule is not None else "unmatched"
    method = req.method if req.method in _METHODS else "OTHER"
    status = response.status_code
    REQUEST_DURATION.labels(method, route, str(status)).observe(elapsed)
    level = logging.DEBUG if route in _QUIET_ROUTES and status < 400 else logging.INFO
    if request_log.isEnabledFor(level):
        duration_ms = round(elapsed * 1000, 1)
        # A URL rule, a method and numbers: nothing to redact (the filter skips the line).
        fields: dict[str, Any] = {"method": method, "route": route, "status": status, "duration_ms": duration_ms,
                                  "request_id": request_id, "_redacted": True}  # fmt: skip
        request_log.log(level, "%s %s %d %.1f ms", method, route, status, duration_ms, extra=fields)
    return response
