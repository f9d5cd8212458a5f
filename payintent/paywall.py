"""Charge for HTTP resources with x402: a Flask decorator and a WSGI middleware for resource servers.

    paywall = Paywall(PayIntentClient("http://127.0.0.1:8000", "sk_test_..."))

    @app.get("/report")
    @paywall.require("0.05", description="Today's report")
    def report(): ...

    # or, for any WSGI app:
    app = PaywallMiddleware(app, paywall, {"GET /report": "0.05"})

A request without a payment gets **402 Payment Required**: the paywall creates an intent through
the payintent API (its metadata ties it to this method and URL) and answers with its requirements
in every shape clients read (see :mod:`payintent.x402`). A request that carries a payment is
settled through ``/api/v1/x402/pay`` and, once paid, served with ``X-Payment-Response``.

Rules (the money-safety ones are marked *):

- * A payment settles only the intent made for this method and URL at this price; a payment
  naming another resource's intent gets a new 402.
- * An intent already paid is honoured (served again without paying twice) only for the same
  resource and when the presented payment was signed by the account that paid it, so an agent whose
  connection broke after paying can retry with the same header.
- A payment from a client that names no intent (plain x402 v1 clients) settles a fresh intent
  made for this request.
- A settlement still running answers 503 with ``Retry-After``: retry the same request with the
  same payment header; it is never charged twice (one authorization settles once).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from functools import wraps
from typing import Any
from urllib.parse import urlsplit

from payintent import x402
from payintent.client import PayIntentClient, PayIntentError

__all__ = ["Outcome", "Paywall", "PaywallMiddleware", "require_payment"]

log = logging.getLogger(__name__)

RESOURCE_KEY = "paywall_resource"  # intent metadata: a digest of "<METHOD> <path?query>"
PATH_KEY = "paywall_path"  # intent metadata: the path, for people reading the dashboard
SETTLING_RETRY_SECONDS = 5
# /pay answers meaning "a settlement for this intent is still running".
_SETTLING = frozenset({"PAYMENT_IN_PROGRESS", "SETTLEMENT_PENDING"})


@dataclass(frozen=True)
class Outcome:
    """What the paywall decided: serve the resource (``paid``) with ``headers``, or answer with this."""

    paid: bool
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None

    def body_bytes(self) -> bytes:
        return json.dumps(self.body or {}, separators=(",", ":"), default=str).encode()


def resource_key(method: str, path_and_query: str) -> str:
    """The digest that ties an intent to one resource (metadata values are capped at 500 characters)."""
    return hashlib.sha256(f"{method.upper()} {path_and_query}".encode()).hexdigest()[:40]


class Paywall:
    """Decides, per request, between a 402 challenge and serving a paid resource."""

    def __init__(self, client: PayIntentClient) -> None:
        self.client = client

    # --- the decision ------------------------------------------------------------------------------

    def check(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        amount_usdc: Decimal | str | int,
        description: str | None = None,
    ) -> Outcome:
        """The outcome for a request to ``url`` priced ``amount_usdc`` (``headers`` case-insensitive)."""
        price = Decimal(str(amount_usdc))
        split = urlsplit(url)
        path = split.path + (f"?{split.query}" if split.query else "")
        key = resource_key(method, path)
        label = description or f"{method.upper()} {split.path}"
        lowered = {k.lower(): v for k, v in headers.items()}
        raw = lowered.get(x402.V2_PAYMENT.lower()) or lowered.get(x402.PAYMENT.lower())
        if not raw:
            return self._challenge(url, key, path, price, label, "Payment required: pay one of the accepts")
        try:
            payment = x402.decode_header(raw)
        except x402.HeaderError as exc:
            return self._challenge(url, key, path, price, label, f"Invalid payment header: {exc}")
        intent_id = x402.intent_id_of(payment)
        intent = self._intent_for(intent_id, key, price) if intent_id else None
        if intent_id and intent is None:
            return self._challenge(url, key, path, price, label, "The payment names an intent for another resource")
        if intent is not None and intent.get("status") == "paid":
            return self._honour(intent, payment, url, key, path, price, label)
        if intent is None:  # a client that names no intent: settle a fresh one made for this request
            intent = self._create(key, path, price, label)
        return self._settle(intent, payment, url, key, path, price, label)

    # --- steps -------------------------------------------------------------------------------------

    def _intent_for(self, intent_id: str, key: str, price: Decimal) -> dict[str, Any] | None:
        """The named intent if it was made for this resource at this price (else None)."""
        try:
            intent = self.client.get_intent(intent_id)
        except PayIntentError as err:
            if err.status == 404:
                return None
            raise
        metadata = intent.get("metadata") or {}
        if metadata.get(RESOURCE_KEY) != key or Decimal(str(intent.get("amount_usdc"))) != price:
            return None
        return intent

    def _create(self, key: str, path: str, price: Decimal, label: str) -> dict[str, Any]:
        return self.client.create_intent(
            price, description=label[:500], metadata={RESOURCE_KEY: key, PATH_KEY: path[:500]}
        )

    def _challenge(
        self, url: str, key: str, path: str, price: Decimal, label: str, error: str, intent: Any = None
    ) -> Outcome:
        """402 with a payable intent's requirements in our, x402 v1 and x402 v2 shapes."""
        if intent is None or intent.get("status") != "pending":
            intent = self._create(key, path, price, label)
        requirements = list(intent["payment_requirements"])
        intent_id = str(intent["intent_id"])
        ours = {"x402Version": x402.X402_VERSION, "intent_id": intent_id, "accepts": requirements}
        v2 = x402.v2_payment_required(requirements, intent_id, url, label, error)
        body = {
            "x402Version": x402.X402_VERSION,
            "error": error,
            "accepts": x402.v1_accepts(requirements, url),
            "intent_id": intent_id,
            "payment_requirements": requirements,
        }
        headers = {
            x402.PAYMENT_REQUIRED: x402.encode_header(ours),
            x402.V2_PAYMENT_REQUIRED: x402.encode_header(v2),
            "Cache-Control": "no-store",
        }
        return Outcome(False, 402, headers, body)

    def _settle(
        self, intent: dict[str, Any], payment: dict[str, Any], url: str, key: str, path: str, price: Decimal, label: str
    ) -> Outcome:
        signature = {k: v for k, v in payment.items() if k != "intent_id"}
        try:
            result = self.client.settle(str(intent["intent_id"]), signature)
        except PayIntentError as err:
            if err.code == "ALREADY_PAID":
                return self._honour(
                    self.client.get_intent(str(intent["intent_id"])), payment, url, key, path, price, label
                )
            if err.code in _SETTLING or err.transient:
                log.warning("paywall: settlement of %s not finished: %s", intent["intent_id"], err.code)
                body = {"error": "SETTLING", "message": "The payment is settling: retry with the same payment header"}
                return Outcome(False, 503, {"Retry-After": str(SETTLING_RETRY_SECONDS)}, body)
            return self._challenge(url, key, path, price, label, f"{err.code}: {err.message}", intent)
        return _granted(result)

    def _honour(
        self, intent: dict[str, Any], payment: dict[str, Any], url: str, key: str, path: str, price: Decimal, label: str
    ) -> Outcome:
        """Serve a paid intent again only to the account that paid it (an agent retrying)."""
        payer = x402.payer_of(payment)
        paid_by = intent.get("buyer_address")
        if payer and paid_by and payer.lower() == str(paid_by).lower():
            return _granted(
                {
                    "tx_hash": intent.get("tx_hash"),
                    "network": intent.get("chain"),
                    "buyer_address": paid_by,
                    "intent_id": intent.get("intent_id"),
                }
            )
        return self._challenge(url, key, path, price, label, "That intent is already paid by another account")

    # --- Flask -------------------------------------------------------------------------------------

    def require(self, amount_usdc: Decimal | str | int, *, description: str | None = None) -> Callable[..., Any]:
        """Flask view decorator: serve the view only to requests that paid ``amount_usdc``."""
        from flask import Response, make_response, request

        def decorator(view: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(view)
            def guarded(*args: Any, **kwargs: Any) -> Any:
                outcome = self.check(request.method, request.url, request.headers, amount_usdc, description)
                if not outcome.paid:
                    return Response(outcome.body_bytes(), outcome.status, outcome.headers, mimetype="application/json")
                response = make_response(view(*args, **kwargs))
                response.headers.update(outcome.headers)
                return response

            return guarded

        return decorator


def _granted(result: Mapping[str, Any]) -> Outcome:
    receipt = x402.encode_header(x402.payment_response(result))
    return Outcome(True, 200, {x402.PAYMENT_RESPONSE: receipt, x402.V2_PAYMENT_RESPONSE: receipt})


def require_payment(
    amount_usdc: Decimal | str | int,
    *,
    description: str | None = None,
    client: PayIntentClient | None = None,
    api_url: str | None = None,
    api_key: str | None = None,
) -> Callable[..., Any]:
    """Flask view decorator: ``@require_payment("0.05")``. The merchant's client is ``client``, or one
    made from ``api_url``/``api_key`` (default: the ``PAYINTENT_URL`` and ``PAYINTENT_API_KEY``
    environment variables)."""
    import os

    if client is None:
        url = api_url or os.environ.get("PAYINTENT_URL", "http://127.0.0.1:8000")
        key = api_key or os.environ.get("PAYINTENT_API_KEY")
        if not key:
            raise ValueError("require_payment needs a merchant API key (api_key= or PAYINTENT_API_KEY)")
        client = PayIntentClient(url, key)
    return Paywall(client).require(amount_usdc, description=description)


class PaywallMiddleware:
    """WSGI middleware charging for ``routes`` (``{"GET /report": "0.05"}``); other paths pass through."""

    def __init__(self, app: Callable[..., Any], paywall: Paywall, routes: Mapping[str, Decimal | str | int]) -> None:
        self.app = app
        self.paywall = paywall
        self.routes = {
            route.split(" ", 1)[0].upper() + " " + route.split(" ", 1)[1]: price for route, price in routes.items()
        }

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        from wsgiref.util import request_uri

        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        price = self.routes.get(f"{method} {environ.get('PATH_INFO', '')}")
        if price is None:
            return self.app(environ, start_response)  # type: ignore[no-any-return]
        headers = {k[5:].replace("_", "-"): str(v) for k, v in environ.items() if k.startswith("HTTP_")}
        outcome = self.paywall.check(method, request_uri(environ), headers, price)
        if not outcome.paid:
            body = outcome.body_bytes()
            reason = "402 Payment Required" if outcome.status == 402 else f"{outcome.status} Service Unavailable"
            start_response(
                reason,
                [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *outcome.headers.items()],
            )
            return [body]

        def start_paid(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, [*response_headers, *outcome.headers.items()], exc_info)

        return self.app(environ, start_paid)  # type: ignore[no-any-return]
