"""Charge for HTTP resources with x402: a Flask decorator and a WSGI middleware for resource servers.

    paywall = Paywall(PayIntentClient("http://127.0.0.1:8000", "sk_test_..."), origin="https://api.example")

    @app.get("/report")
    @paywall.require("0.05", description="Today's report")
    def report(): ...

    # or, for any WSGI app:
    app = PaywallMiddleware(app, paywall, {"GET /report": "0.05"})

It follows x402's resource-server semantics, over our facilitator API (``/api/v1/x402/facilitator``):

1. A request without a payment gets **402 Payment Required** with the requirements in every shape
   clients read (see :mod:`payintent.x402`), built from the merchant's networks and wallets as
   ``/supported`` lists them (read once every few minutes): no intent, no row, no API call per request.
2. A request with a payment is checked offline (:mod:`payintent.paywall_verify`; a forged header costs
   nothing), then ``verify``-ed by the facilitator (signature, amount, recipient, window, nonce unused,
   balance).
3. The view runs. Only when it answered 2xx is the payment **settled** (``settle``: the exactly-once
   engine; the merchant's paid intent, its ``payment.completed`` webhook), and the answer carries
   ``PAYMENT-RESPONSE`` (and ``X-Payment-Response``). A view that failed is not paid for: the
   authorization stays unused. A settlement that fails answers 402 (the view's body is not sent).

Rules (the money-safety ones are marked *):

- * One payment is served once. A settled authorization presented again is refused (its data is
  public on chain): the facilitator answers ``success`` once per payment. A buyer's retry is served
  again only with the x402 ``payment-identifier`` extension in its payload (same id, same payment: the
  first result, money moved once); without one the paywall names the settlement with an id of its own
  that nobody else knows, so a copy of the header (read from the mempool) is never served.
- * An access token (``X-Payment-Access``, HMAC over this paywall's name, the method, route, path,
  query and price; short-lived) serves the paid resource again without paying. Keys never come from
  the ``Host`` header (:mod:`payintent.paywall_request`).
- * Nobody spends the merchant's API quota for free: requests that need the API (verify, settle) pass
  a budget per client and in all (429 / 503 with ``Retry-After``). An API error is answered 503 with
  ``Retry-After``, never 500.
- A settlement still running after ``settle_wait_seconds`` answers 503 with ``Retry-After``: retry with
  the same payment (and its payment-identifier); it is never charged twice.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from functools import wraps
from typing import Any

from payintent import access, x402
from payintent.access import ACCESS, AccessError, AccessKeys, Grant
from payintent.client import PayIntentClient, PayIntentError
from payintent.paywall_request import (
    PaidRequest,
    canonical_origin,
    canonical_path,
    canonical_query,
    display_url,
    price_text,
)
from payintent.paywall_state import Budget, Catalog, client_key
from payintent.paywall_verify import Refused, check_payment

__all__ = ["Outcome", "Paywall", "PaywallMiddleware", "Settlement", "require_payment"]

log = logging.getLogger(__name__)

SETTLING_RETRY_SECONDS = 5
UNAVAILABLE_RETRY_SECONDS = 10
DEFAULT_ACCESS_SECONDS = 300
DEFAULT_SETTLE_WAIT_SECONDS = 60.0  # how long a paid request waits for its settlement before a 503
SETTLE_POLL_SECONDS = 2.0
CATALOG_SECONDS = 300.0  # how often the merchant's networks and wallets are read again
CATALOG_STALE_SECONDS = 3600.0  # how long the last catalog serves while the API cannot be read
DEFAULT_REQUESTS_PER_MINUTE = 600  # requests that make API calls (verify, settle), for the whole paywall
DEFAULT_REQUESTS_PER_MINUTE_PER_CLIENT = 60
PAYMENT_IDENTIFIER = "payment-identifier"
_PAYMENT_ID = re.compile(r"^[A-Za-z0-9_-]{16,128}\Z")  # the extension's rule (the facilitator's too)
_V1_ONLY = frozenset({"maxAmountRequired", "resource", "description", "mimeType"})  # a v2 requirement has none
_SETTLED_BEFORE = frozenset({"invalid_exact_evm_nonce_already_used"})


@dataclass(frozen=True)
class Settlement:
    """A verified payment, settled once the view answered 2xx: what goes to the facilitator's ``settle``."""

    request: PaidRequest
    payload: dict[str, Any]
    requirement: dict[str, Any]
    payer: str


@dataclass(frozen=True)
class Outcome:
    """What the paywall decided: serve the resource (``paid``) with ``headers``, or answer with this.

    ``settlement``: a verified payment to settle (:meth:`Paywall.settle`) once the view answered 2xx;
    None when an access token serves the resource (nothing to settle)."""

    paid: bool
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None
    settlement: Settlement | None = None

    def body_bytes(self) -> bytes:
        return json.dumps(self.body or {}, separators=(",", ":"), default=str).encode()


class Paywall:
    """Decides, per request, between a 402 challenge and serving a paid resource, and settles after serving.

    ``secret`` keys the access tokens (default: ``PAYINTENT_PAYWALL_SECRET``, else derived from the
    client's API key, so every process of a deployment shares it); ``origin`` is the public
    ``scheme://host`` of the resource server (shown in 402s); ``name`` the paywall's name in its tokens
    (default: ``origin``; give each service selling with one merchant key its own); ``access_seconds`` is
    how long a payment's token serves its resource; ``requests_per_minute`` (all clients) and
    ``requests_per_minute_per_client`` bound the requests that make API calls (0: no bound);
    ``settle_wait_seconds`` how long a paid request waits for its settlement; ``clock`` and ``sleep`` are
    injectable for tests.
    """

    def __init__(
        self,
        client: PayIntentClient,
        *,
        secret: str | bytes | None = None,
        name: str | None = None,
        origin: str | None = None,
        access_seconds: int = DEFAULT_ACCESS_SECONDS,
        requests_per_minute: int = DEFAULT_REQUESTS_PER_MINUTE,
        requests_per_minute_per_client: int = DEFAULT_REQUESTS_PER_MINUTE_PER_CLIENT,
        settle_wait_seconds: float = DEFAULT_SETTLE_WAIT_SECONDS,
        catalog_seconds: float = CATALOG_SECONDS,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if access_seconds < 1 or settle_wait_seconds < 0:
            raise ValueError("access_seconds must be positive and settle_wait_seconds not negative")
        self.origin = canonical_origin(origin) if origin else ""
        if origin and not self.origin:
            raise ValueError(f"origin must be scheme://host[:port], not {origin!r}")
        self.name = str(name) if name is not None else self.origin
        self.client = client
        self.access_seconds = int(access_seconds)
        self.settle_wait_seconds = float(settle_wait_seconds)
        self.clock = clock
        self.sleep = sleep
        self.keys = AccessKeys(access.resolve_secret(secret, getattr(client, "api_key", None)))
        self.catalog = Catalog(client, clock, catalog_seconds, CATALOG_STALE_SECONDS)
        self.budget = Budget(requests_per_minute_per_client, requests_per_minute, clock)

    # --- before the view ---------------------------------------------------------------------------

    def check(
        self,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        amount_usdc: Decimal | str | int,
        description: str | None = None,
        *,
        route: str | None = None,
        route_target: str | None = None,
        url: str | None = None,
        client: str = "",
    ) -> Outcome:
        """The outcome for ``method path?query`` priced ``amount_usdc`` (``headers`` case-insensitive).

        ``path`` is the decoded path the application sees (WSGI ``SCRIPT_NAME + PATH_INFO``) and
        ``query`` the query string as sent; no URL, no host. ``route`` names the resource's route (the
        route template; default: the path), ``route_target`` replaces the path in the resource key,
        ``url`` is shown in 402s, ``client`` names the requester for the API budget. A paid outcome
        with a ``settlement`` must be settled with :meth:`settle` once the view answered 2xx."""
        if not isinstance(path, str) or not isinstance(query, str):
            raise TypeError("check() takes the path and the query string separately (strings), never a URL")
        request = PaidRequest.make(
            method, path, query, Decimal(str(amount_usdc)), audience=self.name, route=route,
            route_target=route_target, url=url, description=description, client=client,
        )  # fmt: skip
        try:
            return self._decide(request, headers)
        except PayIntentError as err:  # the API refused or failed: the paywall cannot decide now
            log.warning("paywall: the API answered %s; answering 503", err)
            return _unavailable("The payment service is unavailable: retry later", UNAVAILABLE_RETRY_SECONDS)

    def check_environ(
        self,
        environ: Mapping[str, Any],
        amount_usdc: Decimal | str | int,
        description: str | None = None,
        *,
        route: str | None = None,
        route_target: str | None = None,
    ) -> Outcome:
        """:meth:`check` for a WSGI request: path, query, headers and client taken from ``environ``."""
        path = str(environ.get("SCRIPT_NAME") or "") + str(environ.get("PATH_INFO") or "")
        query = str(environ.get("QUERY_STRING") or "")
        shown_query = canonical_query(query)
        target = canonical_path(path) + (f"?{shown_query}" if shown_query else "")
        headers = {k[5:].replace("_", "-"): str(v) for k, v in environ.items() if k.startswith("HTTP_")}
        return self.check(
            str(environ.get("REQUEST_METHOD") or "GET"), path, query, headers, amount_usdc, description,
            route=route, route_target=route_target, url=display_url(dict(environ), target, self.origin),
            client=client_key(environ.get("REMOTE_ADDR")),
        )  # fmt: skip

    def _decide(self, request: PaidRequest, headers: Mapping[str, str]) -> Outcome:
        lowered = {k.lower(): v for k, v in headers.items()}
        raw = lowered.get(x402.V2_PAYMENT.lower()) or lowered.get(x402.PAYMENT.lower())
        token = lowered.get(x402.PAYMENT_ACCESS.lower())
        if token:
            outcome = self._by_token(request, token)
            if outcome.paid or not raw:
                return outcome
        if not raw:
            return self._challenge(request, "Payment required: pay one of the accepts")
        try:
            payment = x402.decode_header(raw)
        except x402.HeaderError as exc:
            return self._challenge(request, f"Invalid payment header: {exc}")
        return self._verify(request, payment)

    def _verify(self, request: PaidRequest, payment: dict[str, Any]) -> Outcome:
        requirements = self.catalog.requirements(request)
        try:  # offline: a forged header costs nothing
            checked = check_payment(payment, requirements, self.clock())
        except Refused as exc:
            return self._challenge(request, f"Invalid payment: {exc}")
        requirement = next(r for r in requirements if r["network"] == checked.network)
        try:
            buyer_id = _payment_id(payment)
            payload, sent_requirement = _for_facilitator(payment, requirement, self._settlement_id(request, buyer_id))
        except Refused as exc:
            return self._challenge(request, f"Invalid payment: {exc}")
        denied = self._admit(request)
        if denied is not None:
            return denied
        answer = self.client.facilitator_verify(payload, sent_requirement)
        settlement = Settlement(request, payload, sent_requirement, checked.payer)
        if answer.get("isValid") is not True:
            reason = str(answer.get("invalidReason") or "invalid_payload")
            if reason in _SETTLED_BEFORE and buyer_id is not None:
                # The buyer's retry of a payment settled before (its answer lost): the facilitator answers the
                # first result for the same payment-identifier and payment, and refuses anything else.
                return self.settle(Outcome(True, settlement=settlement))
            if reason in _SETTLED_BEFORE:
                return self._challenge(request, _NOT_PROOF)
            return self._challenge(request, f"{reason}: {_message(answer, 'invalidMessage')}")
        return Outcome(True, settlement=settlement)

    def _settlement_id(self, request: PaidRequest, buyer_id: str | None) -> str:
        """The payment-identifier the facilitator sees: derived (HMAC under this paywall's secret) from the buyer's
        own id and this resource and price, so a buyer's retry of one resource gets its first result and the same
        header at another resource (or paywall) is a new settlement that the spent nonce refuses. No buyer id: a
        random one, known to nobody, so no copy of the payment is answered success."""
        if buyer_id is None:
            return secrets.token_urlsafe(24)
        return self.keys.derive("payment-identifier", buyer_id, request.key, price_text(request.price))

    def _admit(self, request: PaidRequest) -> Outcome | None:
        """None when ``request`` may make API calls, else the answer refusing it for now."""
        refused = self.budget.take(request.client)
        if refused is None:
            return None
        status, wait = refused
        retry = max(1, int(wait + 0.999))
        if status == 429:
            return _unavailable("Too many payment requests from this client: retry later", retry, 429)
        return _unavailable("The paywall is busy: retry later", retry)

    # --- after the view ----------------------------------------------------------------------------

    def settle(self, outcome: Outcome) -> Outcome:
        """Settle a verified payment (call it only once the view answered 2xx): the headers to add to the
        view's answer, or the answer to send instead (402 refused, 503 still settling or the API down).

        A settlement still pending, or a 5xx/429 from the API, is asked again with the same payment and
        payment-identifier (it settles once) until ``settle_wait_seconds`` have passed."""
        settlement = outcome.settlement
        if settlement is None:
            return outcome
        request = settlement.request
        deadline = self.clock() + self.settle_wait_seconds
        while True:
            try:
                answer = self.client.facilitator_settle(settlement.payload, settlement.requirement)
            except PayIntentError as err:
                if (err.transient or err.status == 429) and self.clock() + SETTLE_POLL_SECONDS < deadline:
                    self.sleep(SETTLE_POLL_SECONDS)
                    continue
                log.warning("paywall: settling for %s: the API answered %s", request.label, err)
                if err.transient or err.status == 429:
                    return _settling("The payment may still settle: retry with the same payment header")
                return self._challenge(request, f"{err.code}: {err.message}")
            if answer.get("success") is True:
                return self._granted(request, answer, settlement.payer)
            reason = str(answer.get("errorReason") or "unexpected_settle_error")
            if reason == "settlement_pending":
                if self.clock() + SETTLE_POLL_SECONDS < deadline:
                    self.sleep(SETTLE_POLL_SECONDS)
                    continue
                return _settling("The payment is settling: retry with the same payment header")
            if reason in _SETTLED_BEFORE:
                return self._challenge(request, _NOT_PROOF)
            return self._challenge(request, f"{reason}: {_message(answer, 'errorMessage')}")

    # --- access tokens -----------------------------------------------------------------------------

    def _by_token(self, request: PaidRequest, token: str) -> Outcome:
        try:
            price = price_text(request.price)
            grant = self.keys.read(token, request.key, self.clock(), audience=self.name, price=price)
        except AccessError as err:
            return self._challenge(request, f"{err}: pay again")
        if grant.kind != ACCESS:
            return self._challenge(request, "the access token is not valid")
        return Outcome(True, 200, {x402.PAYMENT_ACCESS_EXPIRES: str(grant.expires), "Cache-Control": "no-store"})

    # --- answers -----------------------------------------------------------------------------------

    def _challenge(self, request: PaidRequest, error: str) -> Outcome:
        """402 with the requirements in our, x402 v1 and x402 v2 shapes (no intent: one is recorded when paid)."""
        requirements = self.catalog.requirements(request)
        ours = {"x402Version": x402.X402_VERSION, "accepts": requirements}
        v2 = x402.v2_payment_required(requirements, None, request.url, request.description, error)
        body = {
            "x402Version": x402.X402_VERSION,
            "error": error,
            "accepts": x402.v1_accepts(requirements, request.url),
            "payment_requirements": requirements,
        }
        headers = {
            x402.PAYMENT_REQUIRED: x402.encode_header(ours),
            x402.V2_PAYMENT_REQUIRED: x402.encode_header(v2),
            "Cache-Control": "no-store",
        }
        return Outcome(False, 402, headers, body)

    def _granted(self, request: PaidRequest, answer: Mapping[str, Any], payer: str) -> Outcome:
        receipt = x402.encode_header(
            {
                "success": True,
                "transaction": str(answer.get("transaction") or ""),
                "network": x402.caip2_network(str(answer.get("network") or "")),
                "payer": str(answer.get("payer") or payer),
            }
        )
        expires = int(self.clock()) + self.access_seconds
        grant = Grant(ACCESS, request.key, str(answer.get("transaction") or ""), payer, expires, self.name,
                      price_text(request.price))  # fmt: skip
        headers = {
            x402.PAYMENT_RESPONSE: receipt,
            x402.V2_PAYMENT_RESPONSE: receipt,
            x402.PAYMENT_ACCESS: self.keys.issue(grant),
            x402.PAYMENT_ACCESS_EXPIRES: str(expires),
            "Cache-Control": "no-store",
        }
        return Outcome(True, 200, headers)

    # --- Flask -------------------------------------------------------------------------------------

    def require(self, amount_usdc: Decimal | str | int, *, description: str | None = None) -> Callable[..., Any]:
        """Flask view decorator: serve the view only to requests that paid ``amount_usdc``; settle the payment
        only when the view answered 2xx. A token is for the exact path and query."""
        from flask import Response, make_response, request

        def decorator(view: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(view)
            def guarded(*args: Any, **kwargs: Any) -> Any:
                rule = request.url_rule.rule if request.url_rule is not None else None
                outcome = self.check_environ(request.environ, amount_usdc, description, route=rule)
                if not outcome.paid:
                    return Response(outcome.body_bytes(), outcome.status, outcome.headers, mimetype="application/json")
                response = make_response(view(*args, **kwargs))
                if outcome.settlement is not None:
                    if not 200 <= response.status_code < 300:
                        return response  # a failed view is not paid for: the authorization stays unused
                    outcome = self.settle(outcome)
                    if not outcome.paid:
                        response.close()
                        return Response(outcome.body_bytes(), outcome.status, outcome.headers,
                                        mimetype="application/json")  # fmt: skip
                response.headers.update(outcome.headers)
                return response

            return guarded

        return decorator


_NOT_PROOF = (
    "This payment was already settled; a settled payment is not proof of access (its data is public). "
    "Present the X-Payment-Access token its answer carried, or pay again"
)


def _message(answer: Mapping[str, Any], key: str) -> str:
    error = answer.get("error")
    text = answer.get(key) or (error.get("message") if isinstance(error, Mapping) else None)
    return str(text or "refused")[:300]


def _payment_id(payment: Mapping[str, Any]) -> str | None:
    extensions = payment.get("extensions")
    found = extensions.get(PAYMENT_IDENTIFIER) if isinstance(extensions, Mapping) else None
    info = found.get("info") if isinstance(found, Mapping) else None
    payment_id = info.get("id") if isinstance(info, Mapping) else None
    if payment_id is None:
        return None
    if not isinstance(payment_id, str) or not _PAYMENT_ID.match(payment_id):
        raise Refused("extensions.payment-identifier.info.id must be 16 to 128 characters of A-Z, a-z, 0-9, _ and -")
    return payment_id


def _for_facilitator(
    payment: Mapping[str, Any], requirement: Mapping[str, Any], payment_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The facilitator's ``paymentPayload`` and ``paymentRequirements`` for a payment header checked against
    ``requirement``: v2 as sent (``resource`` the paywall's); v1 and ours as a v1 payload (our ``intent_id`` left
    out), on the requirement's network. The payload carries ``payment_id`` as its payment-identifier."""
    extensions = payment.get("extensions")
    merged = {
        **(extensions if isinstance(extensions, Mapping) else {}),
        PAYMENT_IDENTIFIER: {"info": {"id": payment_id}},
    }
    if payment.get("x402Version") == 2:
        payload = {k: v for k, v in payment.items() if k != "intent_id"}
        payload["extensions"] = merged
        payload["resource"] = {k: requirement[k] for k in ("description", "mimeType")} | {
            "url": requirement["resource"]
        }
        sent = {
            k: v
            for k, v in requirement.items()
            if k not in ("maxAmountRequired", "resource", "description", "mimeType")
        }
        sent["amount"] = requirement["maxAmountRequired"]
        return payload, sent
    network = payment.get("network")
    if not isinstance(network, str) or x402.caip2_network(network) != requirement["network"]:
        raise Refused("the payment's network is not the one it was checked for")
    payload = {"x402Version": 1, "scheme": "exact", "network": network, "payload": payment.get("payload"),
               "extensions": merged}  # fmt: skip
    return payload, {**requirement, "network": network}


def _settling(message: str) -> Outcome:
    headers = {"Retry-After": str(SETTLING_RETRY_SECONDS), "Cache-Control": "no-store"}
    return Outcome(False, 503, headers, {"error": "SETTLING", "message": message})


def _unavailable(message: str, retry_after: int, status: int = 503) -> Outcome:
    code = "RATE_LIMITED" if status == 429 else "PAYWALL_UNAVAILABLE"
    headers = {"Retry-After": str(retry_after), "Cache-Control": "no-store"}
    return Outcome(False, status, headers, {"error": code, "message": message})


def require_payment(
    amount_usdc: Decimal | str | int,
    *,
    description: str | None = None,
    client: PayIntentClient | None = None,
    api_url: str | None = None,
    api_key: str | None = None,
    **options: Any,
) -> Callable[..., Any]:
    """Flask view decorator: ``@require_payment("0.05")``. The merchant's client is ``client``, or one
    made from ``api_url``/``api_key`` (default: the ``PAYINTENT_URL`` and ``PAYINTENT_API_KEY``
    environment variables); ``options`` go to :class:`Paywall` (``secret``, ``origin``, ...)."""
    import os

    if client is None:
        url = api_url or os.environ.get("PAYINTENT_URL", "http://127.0.0.1:8000")
        key = api_key or os.environ.get("PAYINTENT_API_KEY")
        if not key:
            raise ValueError("require_payment needs a merchant API key (api_key= or PAYINTENT_API_KEY)")
        client = PayIntentClient(url, key)
    return Paywall(client, **options).require(amount_usdc, description=description)


from payintent.paywall_wsgi import PaywallMiddleware  # noqa: E402  (re-exported: it uses Paywall)
