"""Charge for HTTP resources with x402: a Flask decorator and a WSGI middleware for resource servers.

    paywall = Paywall(PayIntentClient("http://127.0.0.1:8000", "sk_test_..."))

    @app.get("/report")
    @paywall.require("0.05", description="Today's report")
    def report(): ...

    # or, for any WSGI app:
    app = PaywallMiddleware(app, paywall, {"GET /report": "0.05"})

A request without a payment gets **402 Payment Required** with a payable intent's requirements in
every shape clients read (see :mod:`payintent.x402`). A request that carries a payment is settled
through ``/api/v1/x402/pay`` and, once paid, served with ``X-Payment-Response`` and an access token
(``X-Payment-Access``, see :mod:`payintent.access`).

Rules (the money-safety ones are marked *):

- * Proof, not data: a paid resource is served again only to a request carrying the access token
  the settlement returned (HMAC, bound to the method, path and query, short-lived), or a proof
  signed with the payer's key over a fresh challenge of this paywall (``X-Payment-Proof``, within
  ``recovery_seconds`` of paying). A settled payment presented again is *not* proof (its data is
  public on chain): it gets a 402.
- * A payment settles only an intent made for this method and path at this price; a payment
  naming another route's intent gets a new 402.
- One intent per route and price is shared by all 402s while it is pending and not close to expiry
  (anonymous requests create no intents). A payment that names no intent (plain x402 v1 clients)
  settles that shared intent. When another buyer took the intent first, an EVM authorization (it
  names no intent) is settled on a fresh shared intent instead; a Solana transaction (its memo
  names the intent) gets a 402 with a fresh intent, nothing charged.
- A settlement still running answers 503 with ``Retry-After`` and a claim token in
  ``X-Payment-Access``: retry with that header; it is never charged twice (one authorization
  settles once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from functools import wraps
from typing import Any
from urllib.parse import urlsplit

from payintent import access, x402
from payintent.access import ACCESS, CLAIM, AccessError, AccessKeys, Grant
from payintent.client import PayIntentClient, PayIntentError

__all__ = ["Outcome", "Paywall", "PaywallMiddleware", "require_payment"]

log = logging.getLogger(__name__)

RESOURCE_KEY = "paywall_resource"  # intent metadata: a digest of "<METHOD> <path>" (the route, no query)
PATH_KEY = "paywall_path"  # intent metadata: the path, for people reading the dashboard
SETTLING_RETRY_SECONDS = 5
DEFAULT_ACCESS_SECONDS = 300
DEFAULT_RECOVERY_SECONDS = 120
INTENT_MARGIN_SECONDS = 300  # a shared intent this close to expiry is replaced (buyers need time to pay)
RECHECK_SECONDS = 15  # how often a shared intent's state is read again (another process may have settled it)
CLAIM_SECONDS = 1800  # a claim token outlives any settlement (an intent lives 30 minutes)
REROUTES = 2  # fresh intents an EVM authorization may be settled on after the named one was taken
REMEMBERED_SETTLEMENTS = 4096
# /pay answers meaning "a settlement for this intent is still running".
_SETTLING = frozenset({"PAYMENT_IN_PROGRESS", "SETTLEMENT_PENDING"})
# /pay answers meaning "this intent takes no more payments" (someone else's settlement, or its end).
_TAKEN = frozenset({"ALREADY_PAID", "PAYMENT_IN_PROGRESS", "INTENT_EXPIRED", "INTENT_CANCELLED"})


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
    """The digest naming one resource (metadata values are capped at 500 characters)."""
    return hashlib.sha256(f"{method.upper()} {path_and_query}".encode()).hexdigest()[:40]


@dataclass(frozen=True)
class _Request:
    """One priced request: ``key`` names the exact resource (tokens), ``route`` its method and path
    (intents), ``label`` is what a proof signs (``GET /path?query``)."""

    url: str
    key: str
    route: str
    path: str
    label: str
    price: Decimal
    description: str

    @classmethod
    def of(cls, method: str, url: str, price: Decimal, description: str | None) -> _Request:
        split = urlsplit(url)
        target = split.path + (f"?{split.query}" if split.query else "")
        return cls(
            url=url,
            key=resource_key(method, target),
            route=resource_key(method, split.path),
            path=split.path,
            label=f"{method.upper()} {target}",
            price=price,
            description=description or f"{method.upper()} {split.path}",
        )


def _timestamp(text: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except (TypeError, ValueError):
        return None


class _SharedIntents:
    """The pending intent each (route, price) shows in its 402s, created once and reused."""

    def __init__(self, client: PayIntentClient, clock: Callable[[], float], margin: float, recheck: float) -> None:
        self.client = client
        self.clock = clock
        self.margin = margin
        self.recheck = recheck
        self._lock = threading.Lock()
        self._slot_locks: dict[tuple[str, Decimal], threading.Lock] = {}
        self._intents: dict[tuple[str, Decimal], tuple[dict[str, Any], float]] = {}  # intent, last read

    def current(self, request: _Request) -> dict[str, Any]:
        slot = (request.route, request.price)
        with self._lock:
            slot_lock = self._slot_locks.setdefault(slot, threading.Lock())
        with slot_lock:  # concurrent 402s for one route make one intent
            cached = self._intents.get(slot)
            now = self.clock()
            if cached is not None and self._usable(cached[0], now):
                intent, read_at = cached
                if now - read_at < self.recheck:
                    return intent
                try:
                    fresh = self.client.get_intent(str(intent["intent_id"]))
                except PayIntentError as err:
                    if not err.transient:
                        raise
                    return intent  # the API is busy: show the intent we have
                if fresh.get("status") == "pending":
                    self._intents[slot] = (fresh, now)
                    return fresh
            intent = self.client.create_intent(
                request.price,
                description=request.description[:500],
                metadata={RESOURCE_KEY: request.route, PATH_KEY: request.path[:500]},
            )
            self._intents[slot] = (intent, now)
            return intent

    def _usable(self, intent: Mapping[str, Any], now: float) -> bool:
        expires = _timestamp(intent.get("expires_at"))
        return intent.get("status") == "pending" and expires is not None and expires - now > self.margin

    def drop(self, request: _Request, intent_id: str) -> None:
        """Stop showing ``intent_id`` (paid, being settled or closed); the next 402 gets a new one."""
        slot = (request.route, request.price)
        with self._lock:
            cached = self._intents.get(slot)
            if cached is not None and str(cached[0]["intent_id"]) == intent_id:
                del self._intents[slot]


class Paywall:
    """Decides, per request, between a 402 challenge and serving a paid resource.

    ``secret`` keys the access tokens (default: ``PAYINTENT_PAYWALL_SECRET``, else derived from the
    client's API key, so every process of a deployment shares it); ``access_seconds`` is how long a
    payment's token serves its resource; ``recovery_seconds`` how long after paying a payer may get
    a new token with a signed proof; ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        client: PayIntentClient,
        *,
        secret: str | bytes | None = None,
        access_seconds: int = DEFAULT_ACCESS_SECONDS,
        recovery_seconds: int = DEFAULT_RECOVERY_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if access_seconds < 1 or recovery_seconds < 0:
            raise ValueError("access_seconds must be positive and recovery_seconds not negative")
        self.client = client
        self.access_seconds = int(access_seconds)
        self.recovery_seconds = int(recovery_seconds)
        self.clock = clock
        self.keys = AccessKeys(access.resolve_secret(secret, getattr(client, "api_key", None)))
        self.intents = _SharedIntents(client, clock, INTENT_MARGIN_SECONDS, RECHECK_SECONDS)
        self._settled_on: OrderedDict[tuple[str, str], str] = OrderedDict()  # (payer, nonce) -> intent id
        self._settled_lock = threading.Lock()

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
        request = _Request.of(method, url, Decimal(str(amount_usdc)), description)
        lowered = {k.lower(): v for k, v in headers.items()}
        raw = lowered.get(x402.V2_PAYMENT.lower()) or lowered.get(x402.PAYMENT.lower())
        token = lowered.get(x402.PAYMENT_ACCESS.lower())
        proof = lowered.get(x402.PAYMENT_PROOF.lower())
        if token:
            outcome = self._by_token(request, token)
            if outcome.paid or outcome.status != 402 or not (raw or proof):
                return outcome
        if proof:
            return self._by_proof(request, proof)
        if not raw:
            return self._challenge(request, "Payment required: pay one of the accepts")
        try:
            payment = x402.decode_header(raw)
        except x402.HeaderError as exc:
            return self._challenge(request, f"Invalid payment header: {exc}")
        return self._pay(request, payment)

    # --- paying ------------------------------------------------------------------------------------

    def _pay(self, request: _Request, payment: dict[str, Any]) -> Outcome:
        authorization = x402.authorization_of(payment)  # EVM: may be settled on another intent
        payer = authorization[0] if authorization else _solana_payer(payment)
        target: dict[str, Any] | None = None
        intent_id = x402.intent_id_of(payment)
        if intent_id:
            named = self._intent_for(intent_id, request)
            if named is None:
                return self._challenge(request, "The payment names an intent for another resource or price")
            if named.get("status") == "pending":
                target = named
            elif named.get("status") == "paid" and access.same_payer(named.get("buyer_address"), payer):
                return self._challenge(request, _NOT_PROOF)  # a settled payment again (a replay, or a lost answer)
            elif authorization is None:
                return self._challenge(request, _taken(intent_id))
        if target is None:
            target = self.intents.current(request)
        signature = {k: v for k, v in payment.items() if k != "intent_id"}
        for attempt in range(REROUTES + 1):
            target_id = str(target["intent_id"])
            if authorization is not None:
                self._remember(authorization, target_id)
            try:
                result = self.client.settle(target_id, signature)
            except PayIntentError as err:
                if err.code in _TAKEN:
                    self.intents.drop(request, target_id)
                    if authorization is not None and attempt < REROUTES:
                        log.info("paywall: intent %s was taken (%s); settling on a fresh one", target_id, err.code)
                        target = self.intents.current(request)
                        continue
                    if err.code == "PAYMENT_IN_PROGRESS":
                        return _settling("Another payment for this intent is settling: retry with the same payment")
                    taken = self._intent_for(target_id, request) or {}
                    if access.same_payer(taken.get("buyer_address"), payer):  # this very payment, settled before
                        return self._challenge(request, _NOT_PROOF)
                    return self._challenge(request, _taken(target_id))
                return self._refused(request, target_id, payer, err)
            self.intents.drop(request, target_id)
            return self._granted(request, result)
        raise AssertionError("unreachable")  # pragma: no cover - the loop always returns

    def _refused(self, request: _Request, intent_id: str, payer: str | None, err: PayIntentError) -> Outcome:
        if err.code == "SETTLEMENT_PENDING" and payer:
            # This request's own payment holds the intent: its sender may collect it once paid.
            claim = self.keys.issue(Grant(CLAIM, request.key, intent_id, payer, int(self.clock()) + CLAIM_SECONDS))
            return _settling("The payment is settling: retry with this X-Payment-Access header", claim)
        if err.code in _SETTLING or err.transient:
            log.warning("paywall: settlement of %s not finished: %s", intent_id, err.code)
            return _settling("The payment is settling: retry with the same payment header")
        if err.code == "NONCE_ALREADY_USED":
            return self._challenge(request, _NOT_PROOF)
        return self._challenge(request, f"{err.code}: {err.message}")

    def _remember(self, authorization: tuple[str, str], intent_id: str) -> None:
        with self._settled_lock:
            self._settled_on[(authorization[0].lower(), authorization[1].lower())] = intent_id
            while len(self._settled_on) > REMEMBERED_SETTLEMENTS:
                self._settled_on.popitem(last=False)

    # --- proof -------------------------------------------------------------------------------------

    def _by_token(self, request: _Request, token: str) -> Outcome:
        try:
            grant = self.keys.read(token, request.key, self.clock())
        except AccessError as err:
            return self._challenge(request, f"{err}: pay again, or prove an earlier payment with X-Payment-Proof")
        if grant.kind == ACCESS:
            return Outcome(True, 200, {x402.PAYMENT_ACCESS_EXPIRES: str(grant.expires), "Cache-Control": "no-store"})
        if grant.kind == CLAIM:
            return self._collect(request, grant.intent_id, grant.payer, token)
        return self._challenge(request, "the access token is not valid")

    def _by_proof(self, request: _Request, raw: str) -> Outcome:
        try:
            proof = access.read_proof(x402.decode_header(raw))
            self.keys.check_challenge(proof["challenge"], request.key, self.clock())
        except (x402.HeaderError, AccessError) as err:
            return self._challenge(request, f"Invalid X-Payment-Proof: {err}")
        message = access.proof_message(request.label, proof["intent_id"], proof["payer"], proof["challenge"])
        if not access.signed_by(proof["payer"], message, proof["signature"]):
            return self._challenge(request, "Invalid X-Payment-Proof: it is not signed by the payer's key")
        candidates = [proof["intent_id"]]
        if "nonce" in proof:  # the authorization may have been settled on a fresh intent (another buyer came first)
            with self._settled_lock:
                moved = self._settled_on.get((proof["payer"].lower(), proof["nonce"].lower()))
            if moved and moved not in candidates:
                candidates.insert(0, moved)
        outcomes = [self._collect(request, intent_id, proof["payer"]) for intent_id in candidates]
        served = next((o for o in outcomes if o.paid), None)
        return served or next((o for o in outcomes if o.status == 503), outcomes[0])

    def _collect(self, request: _Request, intent_id: str, payer: str, claim: str | None = None) -> Outcome:
        """Serve ``payer``'s payment of ``intent_id`` (proven by a claim token or a signed proof).

        A claim names this exact resource and is collected within ``access_seconds`` of the payment;
        a proof is checked against the route's intent only, so it is held to ``recovery_seconds``."""
        intent = self._intent_for(intent_id, request)
        if intent is None:
            return self._challenge(request, "No payment for this resource under that intent")
        status = intent.get("status")
        if status == "pending":
            return _settling("The payment is settling: retry", claim)
        if status != "paid" or not access.same_payer(intent.get("buyer_address"), payer):
            return self._challenge(request, "That intent was not paid by this payer")
        paid_at = _timestamp(intent.get("paid_at"))
        window = self.access_seconds if claim else self.recovery_seconds
        if paid_at is None or self.clock() > paid_at + window:
            return self._challenge(request, "That payment is too old to recover access: pay again")
        return self._granted(
            request,
            {
                "tx_hash": intent.get("tx_hash"),
                "network": intent.get("chain"),
                "buyer_address": intent.get("buyer_address"),
                "intent_id": intent.get("intent_id"),
            },
        )

    # --- answers -----------------------------------------------------------------------------------

    def _intent_for(self, intent_id: str, request: _Request) -> dict[str, Any] | None:
        """The named intent if it was made for this route at this price (else None)."""
        try:
            intent = self.client.get_intent(intent_id)
        except PayIntentError as err:
            if err.status in (400, 404):
                return None
            raise
        metadata = intent.get("metadata") or {}
        if metadata.get(RESOURCE_KEY) != request.route or Decimal(str(intent.get("amount_usdc"))) != request.price:
            return None
        return intent

    def _challenge(self, request: _Request, error: str) -> Outcome:
        """402 with the route's shared intent's requirements in our, x402 v1 and x402 v2 shapes."""
        intent = self.intents.current(request)
        requirements = list(intent["payment_requirements"])
        intent_id = str(intent["intent_id"])
        ours = {"x402Version": x402.X402_VERSION, "intent_id": intent_id, "accepts": requirements}
        v2 = x402.v2_payment_required(requirements, intent_id, request.url, request.description, error)
        body = {
            "x402Version": x402.X402_VERSION,
            "error": error,
            "accepts": x402.v1_accepts(requirements, request.url),
            "intent_id": intent_id,
            "payment_requirements": requirements,
        }
        headers = {
            x402.PAYMENT_REQUIRED: x402.encode_header(ours),
            x402.V2_PAYMENT_REQUIRED: x402.encode_header(v2),
            x402.PAYMENT_ACCESS_CHALLENGE: self.keys.challenge(request.key, self.clock()),
            "Cache-Control": "no-store",
        }
        return Outcome(False, 402, headers, body)

    def _granted(self, request: _Request, result: Mapping[str, Any]) -> Outcome:
        receipt = x402.encode_header(x402.payment_response(result))
        expires = int(self.clock()) + self.access_seconds
        grant = Grant(ACCESS, request.key, str(result.get("intent_id")), str(result.get("buyer_address")), expires)
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


_NOT_PROOF = (
    "This payment was already settled; a settled payment is not proof of access (its data is public). "
    "Present the X-Payment-Access token its answer carried, or an X-Payment-Proof signed by the payer"
)


def _taken(intent_id: str) -> str:
    return (
        f"Intent {intent_id} was paid or closed before this payment reached it; nothing was charged: "
        "pay the intent in this answer"
    )


def _solana_payer(payment: Mapping[str, Any]) -> str | None:
    """The buyer of a Solana payment (the transaction's second signer), or None."""
    payload = payment.get("payload")
    if not isinstance(payload, Mapping) or "transaction" not in payload:
        return None
    from payintent import solana_tx

    try:
        keys = list(solana_tx.decode(payload["transaction"]).message.account_keys)
    except solana_tx.SolanaTransactionError:
        return None
    return str(keys[1]) if len(keys) > 1 else None


def _settling(message: str, claim: str | None = None) -> Outcome:
    headers = {"Retry-After": str(SETTLING_RETRY_SECONDS), "Cache-Control": "no-store"}
    if claim:
        headers[x402.PAYMENT_ACCESS] = claim
    return Outcome(False, 503, headers, {"error": "SETTLING", "message": message})


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
    environment variables); ``options`` go to :class:`Paywall` (``secret``, ``access_seconds``, ...)."""
    import os

    if client is None:
        url = api_url or os.environ.get("PAYINTENT_URL", "http://127.0.0.1:8000")
        key = api_key or os.environ.get("PAYINTENT_API_KEY")
        if not key:
            raise ValueError("require_payment needs a merchant API key (api_key= or PAYINTENT_API_KEY)")
        client = PayIntentClient(url, key)
    return Paywall(client, **options).require(amount_usdc, description=description)


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
