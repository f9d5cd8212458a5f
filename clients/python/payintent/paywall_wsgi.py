"""The paywall as WSGI middleware, for any WSGI application (Flask apps may use ``Paywall.require``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from payintent.paywall_request import canonical_method, canonical_path, route_path

if TYPE_CHECKING:
    from payintent.paywall import Paywall

__all__ = ["PaywallMiddleware"]


class PaywallMiddleware:
    """WSGI middleware charging for ``routes`` (``{"GET /report": "0.05"}``); other paths pass through.

    A route is matched on the decoded ``PATH_INFO`` without empty or dot segments and trailing slash
    (``/report/``, ``//report`` and ``/x/../report`` are ``/report``), HEAD as GET; its price and its
    key are the configured route's, whatever the request's Host or spelling."""

    def __init__(
        self, app: Callable[..., Iterable[bytes]], paywall: Paywall, routes: Mapping[str, Decimal | str | int]
    ) -> None:
        self.app = app
        self.paywall = paywall
        self.routes: dict[tuple[str, str], Decimal] = {}
        for route, price in routes.items():
            method, _, path = str(route).strip().partition(" ")
            if not path.strip().startswith("/"):
                raise ValueError(f"a route is 'METHOD /path', not {route!r}")
            self.routes[(canonical_method(method), route_path(canonical_path(path.strip())))] = Decimal(str(price))

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = canonical_method(str(environ.get("REQUEST_METHOD") or "GET"))
        path = route_path(canonical_path(str(environ.get("PATH_INFO") or "")))
        price = self.routes.get((method, path))
        if price is None:
            return self.app(environ, start_response)
        outcome = self.paywall.check_environ(environ, price, route=path, route_target=path)
        if not outcome.paid:
            body = outcome.body_bytes()
            reason = f"{outcome.status} {HTTPStatus(outcome.status).phrase}"
            start_response(
                reason,
                [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *outcome.headers.items()],
            )
            return [body]

        def start_paid(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, [*response_headers, *outcome.headers.items()], exc_info)

        return self.app(environ, start_paid)
