"""The paywall as WSGI middleware, for any WSGI application (Flask apps may use ``Paywall.require``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from payintent.paywall_request import canonical_method, canonical_path, route_path

if TYPE_CHECKING:
    from payintent.paywall import Outcome, Paywall

__all__ = ["PaywallMiddleware"]


class PaywallMiddleware:
    """WSGI middleware charging for ``routes`` (``{"GET /report": "0.05"}``); other paths pass through.

    A route is matched on the decoded ``PATH_INFO`` without empty or dot segments and trailing slash
    (``/report/``, ``//report`` and ``/x/../report`` are ``/report``), HEAD as GET; its price and its
    key are the configured route's, whatever the request's Host or spelling. A paid request's answer is held
    back until the payment settled (only a 2xx answer is paid for), so it is buffered in memory."""

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
            return _answer(outcome, start_response)

        if outcome.settlement is not None:
            return self._serve_then_settle(environ, start_response, outcome)

        def start_paid(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, [*response_headers, *outcome.headers.items()], exc_info)

        return self.app(environ, start_paid)

    def _serve_then_settle(
        self, environ: dict[str, Any], start_response: Callable[..., Any], outcome: Outcome
    ) -> Iterable[bytes]:
        """Run the application with its answer held back; settle only when it answered 2xx, then send its answer
        with the receipt (or, when the settlement failed, the paywall's answer instead of it)."""
        started: list[Any] = []
        chunks: list[bytes] = []

        def start_held(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, list(response_headers)]
            return chunks.append  # the legacy write() callable: held too

        result = self.app(environ, start_held)
        try:
            chunks.extend(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        status, response_headers = started
        if str(status)[:1] != "2":  # a failed view is not paid for: the authorization stays unused
            start_response(status, response_headers)
            return chunks
        done = self.paywall.settle(outcome)
        if not done.paid:
            return _answer(done, start_response)
        start_response(status, [*response_headers, *done.headers.items()])
        return chunks


def _answer(outcome: Outcome, start_response: Callable[..., Any]) -> Iterable[bytes]:
    body = outcome.body_bytes()
    reason = f"{outcome.status} {HTTPStatus(outcome.status).phrase}"
    start_response(
        reason, [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *outcome.headers.items()]
    )
    return [body]
