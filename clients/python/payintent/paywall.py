"""Charge for HTTP resources with x402: a Flask decorator and a WSGI middleware for resource servers.

    paywall = Paywall(PayIntentClient("http://127.0.0.1:8000", "sk_test_..."), origin="https://api.example")

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
  the settlement returned (HMAC over this paywall's name, the method, route, path, query and price;
  short-lived), or a proof signed with the payer's key over a fresh challenge of this paywall
  (``X-Payment-Proof``, within ``recovery_seconds`` of paying, for the very resource the payment
  bought). A settled payment presented again is *not* proof (its data is public on chain): a 402.
- * Keys never come from the ``Host`` header: method, route, path and query are passed separately
  (:mod:`payintent.paywall_request`); the middleware keys and prices by its configured route.
- * A payment settles only an intent made for this route at this price; a payment naming another
  route's intent gets a new 402.
- * Nobody spends the merchant's API quota for free: a payment is checked offline first
  (:mod:`payintent.paywall_verify`), a named intent must be one this paywall issued, and requests
  that still need the API pass a budget per client and in all (429 / 503 with ``Retry-After``). An
  API error is answered 503 with ``Retry-After``, never 500.
- One intent per route (the Flask rule, e.g. ``/items/<int:n>``) and price is shared by all 402s
  while it is pending and not close to expiry. A payment that names no intent (plain x402 v1
  clients) settles that shared intent. When another buyer took the intent first, an EVM
  authorization (it names no intent) is settled on a fresh shared intent instead; a Solana
  transaction (its memo names the intent) gets a 402 with a fresh intent, nothing charged.
- A settlement still running answers 503 with ``Retry-After`` and a claim token in
  ``X-Payment-Access``: retry with that header; it is never charged twice (one authorization
  settles once).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from functools import wraps
from typing import Any

from payintent import access, x402
from payintent.access import ACCESS, CLAIM, AccessError, AccessKeys, Grant
from payintent.client import PayIntentClient, PayIntentError
from payintent.paywall_request import (
    PaidRequest,
    canonical_origin,
    canonical_path,
    canonical_query,
    display_url,
    price_text,
)
from payintent.paywall_state import PATH_KEY, RESOURCE_KEY, Bounded, Budget, SharedIntents, client_key, parse_timestamp
from payintent.paywall_verify import Refused, check_payment

__all__ = ["PATH_KEY", "RESOURCE_KEY", "Outcome", "Paywall", "PaywallMiddleware", "require_payment"]

log = logging.getLogger(__name__)

SETTLING_RETRY_SECONDS = 5
UNAVAILABLE_RETRY_SECONDS = 10
DEFAULT_ACCESS_SECONDS = 300
DEFAULT_RECOVERY_SECONDS = 120
INTENT_MARGIN_SECONDS = 300  # a shared intent this close to expiry is replaced (buyers need time to pay)
RECHECK_SECONDS = 15  # how often a shared intent's state is read again (another process may have settled it)
CLAIM_SECONDS = 1800  # a claim token outlives any settlement (an intent lives 30 minutes)
REROUTES = 2  # fresh intents an EVM authorization may be settled on after the named one was taken
REMEMBERED_SALES = 8192
DEFAULT_REQUESTS_PER_MINUTE = 600  # requests that make API calls (each 1-3), for the whole paywall
DEFAULT_REQUESTS_PER_MINUTE_PER_CLIENT = 60
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


@dataclass(frozen=True)
class _Sale:
    """A payment this paywall settled (or saw start settling): the resource it bought, for whom, when."""

    key: str
    payer: str
    at: float
    receipt: Mapping[str, Any]
    pending: bool = False


class Paywall:
    """Decides, per request, between a 402 challenge and serving a paid resource.

    ``secret`` keys the access tokens (default: ``PAYINTENT_PAYWALL_SECRET``, else derived from the
    client's API key, so every process of a deployment shares it); ``origin`` is the public
    ``scheme://host`` of the resource server (shown in 402s, required in proofs); ``name`` the
    paywall's name in its tokens (default: ``origin``; give each service selling with one merchant key
    its own); ``access_seconds`` is how long a payment's token serves its resource;
    ``recovery_seconds`` how long after paying a payer may get a new token with a signed proof;
    ``requests_per_minute`` (all clients) and ``requests_per_minute_per_client`` bound the requests
    that make API calls (0: no bound); ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        client: PayIntentClient,
        *,
        secret: str | bytes | None = None,
        name: str | None = None,
        origin: str | None = None,
        access_seconds: int = DEFAULT_ACCESS_SECONDS,
        recovery_seconds: int = DEFAULT_RECOVERY_SECONDS,
        requests_per_minute: int = DEFAULT_REQUESTS_PER_MINUTE,
        requests_per_minute_per_client: int = DEFAULT_REQUESTS_PER_MINUTE_PER_CLIENT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if access_seconds < 1 or recovery_seconds < 0:
            raise ValueError("access_seconds must be positive and recovery_seconds not negative")
        self.origin = canonical_origin(origin) if origin else ""
        if origin and not self.origin:
            raise ValueError(f"origin must be scheme://host[:port], not {origin!r}")
        self.name = str(name) if name is not None else self.origin
        self.client = client
        self.access_seconds = int(access_seconds)
        self.recovery_seconds = int(recovery_seconds)
        self.clock = clock
        self.keys = AccessKeys(access.resolve_secret(secret, getattr(client, "api_key", None)))
        self.intents = SharedIntents(client, clock, INTENT_MARGIN_SECONDS, RECHECK_SECONDS)
        self.budget = Budget(requests_per_minute_per_client, requests_per_minute, clock)
        self._sales: Bounded[str, _Sale] = Bounded(REMEMBERED_SALES)  # intent id -> what it bought
        self._moved: Bounded[tuple[str, str], str] = Bounded(REMEMBERED_SALES)  # (payer, nonce) -> intent id
        self._paid: Bounded[str, dict[str, Any]] = Bounded(REMEMBERED_SALES)  # intents read as paid (final)

    # --- the decision ------------------------------------------------------------------------------

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
        ``query`` the query string as sent; no URL, no host. ``route`` names the shared intent (the
        route template; default: the path), ``route_target`` replaces the path in the resource key,
        ``url`` is shown in 402s, ``client`` names the requester for the API budget."""
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

    # --- paying ------------------------------------------------------------------------------------

    def _pay(self, request: PaidRequest, payment: dict[str, Any]) -> Outcome:
        named = x402.intent_id_of(payment)
        issued = self.intents.known(named, request) if named else None
        shared = self.intents.current(request)
        requirements = issued.requirements if issued else tuple(shared["payment_requirements"])
        try:  # offline: a forged header costs nothing
            checked = check_payment(payment, requirements, self.clock(), named)
        except Refused as exc:
            return self._challenge(request, f"Invalid payment: {exc}")
        payer = checked.payer
        moved = self._moved.get((payer.lower(), checked.nonce)) if checked.nonce is not None else None
        if moved is not None:  # an authorization this paywall settled (or is settling) before
            settling = self._sales.get(moved)
            if settling is None or not settling.pending:
                return self._challenge(request, _NOT_PROOF)
            return self._settle(request, payment, moved, payer, checked.nonce)
        if checked.memo_intent is not None:  # Solana: the transaction can pay only the intent its memo names
            return self._pay_solana(request, payment, checked.memo_intent, payer)
        # An authorization names no intent: one for an intent sold already (or not issued here) pays the shared one.
        sold = self._sales.get(named) if issued and named else None
        target_id = str(named) if issued and sold is None else str(shared["intent_id"])
        return self._settle(request, payment, target_id, payer, checked.nonce)

    def _pay_solana(self, request: PaidRequest, payment: dict[str, Any], target_id: str, payer: str) -> Outcome:
        sold = self._sales.get(target_id)
        if sold is not None:
            return self._challenge(request, _NOT_PROOF if access.same_payer(sold.payer, payer) else _taken(target_id))
        if self.intents.known(target_id, request) is not None:
            return self._settle(request, payment, target_id, payer, None)
        denied = self._admit(request)  # issued by another process, perhaps: ask the API
        if denied is not None:
            return denied
        looked = self._intent_for(target_id, request)
        if looked is None:
            return self._challenge(request, "The payment names an intent for another resource or price")
        if looked.get("status") != "pending":
            mine = looked.get("status") == "paid" and access.same_payer(looked.get("buyer_address"), payer)
            return self._challenge(request, _NOT_PROOF if mine else _taken(target_id))
        return self._settle(request, payment, target_id, payer, None, admitted=True)

    def _settle(
        self,
        request: PaidRequest,
        payment: dict[str, Any],
        target_id: str,
        payer: str,
        nonce: str | None,
        *,
        admitted: bool = False,
    ) -> Outcome:
        """Settle ``payment`` on ``target_id``; an EVM authorization (``nonce``) moves on to a fresh
        shared intent when that one was taken by someone else."""
        if not admitted:
            denied = self._admit(request)
            if denied is not None:
                return denied
        signature = {k: v for k, v in payment.items() if k != "intent_id"}
        for attempt in range(REROUTES + 1):
            try:
                result = self.client.settle(target_id, signature)
            except PayIntentError as err:
                if err.code in _TAKEN:
                    self.intents.drop(request, target_id)
                    if nonce is not None and attempt < REROUTES:
                        log.info("paywall: intent %s was taken (%s); settling on a fresh one", target_id, err.code)
                        target_id = str(self.intents.current(request)["intent_id"])
                        continue
                    if err.code == "PAYMENT_IN_PROGRESS":
                        return _settling("Another payment for this intent is settling: retry with the same payment")
                    taken = self._intent_for(target_id, request) or {}
                    if access.same_payer(taken.get("buyer_address"), payer):  # this very payment, settled before
                        return self._challenge(request, _NOT_PROOF)
                    return self._challenge(request, _taken(target_id))
                return self._refused(request, target_id, payer, nonce, err)
            self.intents.drop(request, target_id)
            self._record(request, target_id, payer, nonce, result)
            return self._granted(request, result)
        raise AssertionError("unreachable")  # pragma: no cover - the loop always returns

    def _refused(
        self, request: PaidRequest, intent_id: str, payer: str, nonce: str | None, err: PayIntentError
    ) -> Outcome:
        if err.code == "SETTLEMENT_PENDING":
            # This request's own payment holds the intent: its sender may collect it once paid.
            self._record(request, intent_id, payer, nonce, {"intent_id": intent_id}, pending=True)
            claim = self.keys.issue(self._grant(CLAIM, request, intent_id, payer, int(self.clock()) + CLAIM_SECONDS))
            return _settling("The payment is settling: retry with this X-Payment-Access header", claim)
        if err.code in _SETTLING or err.transient or err.status == 429:
            log.warning("paywall: settlement of %s not finished: %s", intent_id, err.code)
            return _settling("The payment is settling: retry with the same payment header")
        if err.code == "NONCE_ALREADY_USED":
            return self._challenge(request, _NOT_PROOF)
        return self._challenge(request, f"{err.code}: {err.message}")

    def _record(
        self,
        request: PaidRequest,
        intent_id: str,
        payer: str,
        nonce: str | None,
        result: Mapping[str, Any],
        *,
        pending: bool = False,
    ) -> None:
        """Remember a payment that settled (or is settling) here: never overwritten, except a pending
        record by its completion; only after the API accepted it, so a forged header records nothing."""
        if nonce is not None:
            self._moved.put_new((payer.lower(), nonce.lower()), intent_id)
        sale = _Sale(request.key, payer, self.clock(), dict(result), pending)
        held = self._sales.put_new(intent_id, sale)
        if held is not sale and held.pending and not pending and access.same_payer(held.payer, payer):
            self._sales.put(intent_id, _Sale(held.key, payer, sale.at, dict(result)))

    # --- proof -------------------------------------------------------------------------------------

    def _by_token(self, request: PaidRequest, token: str) -> Outcome:
        try:
            price = price_text(request.price)
            grant = self.keys.read(token, request.key, self.clock(), audience=self.name, price=price)
        except AccessError as err:
            return self._challenge(request, f"{err}: pay again, or prove an earlier payment with X-Payment-Proof")
        if grant.kind == ACCESS:
            return Outcome(True, 200, {x402.PAYMENT_ACCESS_EXPIRES: str(grant.expires), "Cache-Control": "no-store"})
        if grant.kind == CLAIM:
            return self._collect(request, grant.intent_id, grant.payer, token)
        return self._challenge(request, "the access token is not valid")

    def _by_proof(self, request: PaidRequest, raw: str) -> Outcome:
        try:
            proof = access.read_proof(x402.decode_header(raw))
            self.keys.check_challenge(proof["challenge"], request.key, self.clock())
        except (x402.HeaderError, AccessError) as err:
            return self._challenge(request, f"Invalid X-Payment-Proof: {err}")
        if self.origin and proof["origin"] != self.origin:
            return self._challenge(request, f"Invalid X-Payment-Proof: it is for another origin than {self.origin}")
        message = access.proof_message(
            request.label, proof["intent_id"], proof["payer"], proof["challenge"], proof["origin"]
        )
        if not access.signed_by(proof["payer"], message, proof["signature"]):
            return self._challenge(request, "Invalid X-Payment-Proof: it is not signed by the payer's key")
        candidates = [proof["intent_id"]]
        if "nonce" in proof:  # the authorization may have been settled on a fresh intent (another buyer came first)
            moved = self._moved.get((proof["payer"].lower(), proof["nonce"].lower()))
            if moved and moved not in candidates:
                candidates.insert(0, moved)
        # Only intents this paywall sold or issued: a proof of anything else costs no API call.
        known = [i for i in candidates if self._sales.get(i) is not None or self.intents.known(i, request)]
        if not known:
            return self._challenge(request, "No payment for this resource under that intent")
        outcomes = [self._collect(request, intent_id, proof["payer"]) for intent_id in known]
        served = next((o for o in outcomes if o.paid), None)
        return served or next((o for o in outcomes if o.status != 402), outcomes[0])

    def _collect(self, request: PaidRequest, intent_id: str, payer: str, claim: str | None = None) -> Outcome:
        """Serve ``payer``'s payment of ``intent_id`` (proven by a claim token or a signed proof).

        A claim names this exact resource and is collected within ``access_seconds`` of the payment;
        a proof serves only the resource the payment bought, within ``recovery_seconds``."""
        window = self.access_seconds if claim else self.recovery_seconds
        sale = self._sales.get(intent_id)
        if sale is not None and sale.key != request.key and not claim:
            return self._challenge(request, "That payment bought another resource: pay for this one")
        if sale is not None and not sale.pending:
            if not access.same_payer(sale.payer, payer):
                return self._challenge(request, "That intent was not paid by this payer")
            if self.clock() > sale.at + window:
                return self._challenge(request, "That payment is too old to recover access: pay again")
            return self._granted(request, sale.receipt)
        shown = self.intents.shown(request)
        if sale is None and not claim and shown is not None and str(shown.get("intent_id")) == intent_id:
            return self._challenge(request, "No payment for this resource under that intent")  # it is unpaid here
        denied = self._admit(request) if self._paid.get(intent_id) is None else None
        if denied is not None:
            return denied
        intent = self._intent_for(intent_id, request)
        if intent is None:
            return self._challenge(request, "No payment for this resource under that intent")
        status = intent.get("status")
        if status == "pending":
            return _settling("The payment is settling: retry", claim)
        if status != "paid" or not access.same_payer(intent.get("buyer_address"), payer):
            return self._challenge(request, "That intent was not paid by this payer")
        paid_at = parse_timestamp(intent.get("paid_at"))
        if paid_at is None or self.clock() > paid_at + window:
            return self._challenge(request, "That payment is too old to recover access: pay again")
        receipt = {
            "tx_hash": intent.get("tx_hash"),
            "network": intent.get("chain"),
            "buyer_address": intent.get("buyer_address"),
            "intent_id": intent.get("intent_id"),
        }
        # Settled by another process (or forgotten): the first resource proven for it here is the one it bought.
        held = self._sales.put_new(intent_id, _Sale(request.key, payer, paid_at, receipt))
        if held.pending:
            self._sales.put(intent_id, _Sale(held.key, payer, paid_at, receipt))
        if held.key != request.key:
            return self._challenge(request, "That payment bought another resource: pay for this one")
        return self._granted(request, receipt)

    # --- answers -----------------------------------------------------------------------------------

    def _intent_for(self, intent_id: str, request: PaidRequest) -> dict[str, Any] | None:
        """The named intent if it was made for this route at this price (else None). One API call, none
        for an intent read as paid before (that is final)."""
        intent = self._paid.get(intent_id)
        if intent is None:
            try:
                intent = self.client.get_intent(intent_id)
            except PayIntentError as err:
                if err.status in (400, 404):
                    return None
                raise
            if intent.get("status") == "paid":
                self._paid.put(intent_id, intent)
        metadata = intent.get("metadata") or {}
        if metadata.get(RESOURCE_KEY) != request.route_key or Decimal(str(intent.get("amount_usdc"))) != request.price:
            return None
        return intent

    def _challenge(self, request: PaidRequest, error: str) -> Outcome:
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

    def _grant(self, kind: str, request: PaidRequest, intent_id: str, payer: str, expires: int) -> Grant:
        return Grant(kind, request.key, intent_id, payer, expires, self.name, price_text(request.price))

    def _granted(self, request: PaidRequest, result: Mapping[str, Any]) -> Outcome:
        receipt = x402.encode_header(x402.payment_response(result))
        expires = int(self.clock()) + self.access_seconds
        grant = self._grant(ACCESS, request, str(result.get("intent_id")), str(result.get("buyer_address")), expires)
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
        """Flask view decorator: serve the view only to requests that paid ``amount_usdc``. The shared
        intent is the rule's (``/items/<int:n>``), a token is for the exact path and query."""
        from flask import Response, make_response, request

        def decorator(view: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(view)
            def guarded(*args: Any, **kwargs: Any) -> Any:
                rule = request.url_rule.rule if request.url_rule is not None else None
                outcome = self.check_environ(request.environ, amount_usdc, description, route=rule)
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


def _settling(message: str, claim: str | None = None) -> Outcome:
    headers = {"Retry-After": str(SETTLING_RETRY_SECONDS), "Cache-Control": "no-store"}
    if claim:
        headers[x402.PAYMENT_ACCESS] = claim
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
