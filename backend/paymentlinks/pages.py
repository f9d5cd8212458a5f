"""A payment link's public URL, ``/l/<link_id>``.

A buyer's browser opening the link (a top-level navigation) gets a fresh intent and is sent to its checkout: 303.
Anything else that fetches the URL gets the link's own page (amount, description, seller, a "Continue to payment"
button) and makes no intent: a link previewer or crawler (by its User-Agent), a request a page embeds (an image,
a script, a frame: ``Sec-Fetch-Dest`` other than ``document``) and ``HEAD``. The button POSTs to the same URL,
which makes the intent if the form is ours (``Sec-Fetch-Site`` same-origin or none, or else an ``Origin`` of this
host). Every refusal is a short HTML page with the status that fits: 404 unknown, 410 deactivated, 409 the link
cannot take payments now, 429 too many visits (``Retry-After``), 403 a cross-site POST, 503 a dependency down.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Response, render_template, request
from werkzeug.exceptions import HTTPException

from backend import appstate
from backend.errors import CATALOG, DomainError, database_unavailable
from backend.paymentlinks import services

log = logging.getLogger(__name__)
bp = Blueprint("payment_link_page", __name__)

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
# Link previewers, search engines and other robots: they get the link's page, never an intent.
ROBOTS = re.compile(
    r"bot|crawl|spider|slurp|preview|facebookexternalhit|embedly|whatsapp|telegram|discord|slack|skype|"
    r"linkedin|pinterest|vkshare|qwantify|bitlyurl|outbrain|nuzzel|curl|wget|python-requests|httpx|go-http",
    re.IGNORECASE,
)
_PAGES = {
    400: ("This request cannot be read", "Open the payment link you were given again."),
    403: ("Start from the payment link", "Open the payment link you were given, then press Continue to payment."),
    404: ("Payment link not found", "There is no payment link at this address. Check the link you were given."),
    405: ("Payment link", "Open this address in your browser to pay."),
    409: ("This link cannot take payments right now", "Please let the seller know."),
    410: ("Payment link no longer active", "The seller has deactivated this payment link. Ask them for a new one."),
    429: ("Too many payments started", "Too many payments were started here in the last minute. Try again shortly."),
    503: ("Temporarily unavailable", "A service we depend on cannot be reached. Try again in a moment."),
}


def _secure(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Robots-Tag"] = "noindex"
    response.headers["Cache-Control"] = "no-store"  # every visit makes its own intent: never a cached redirect
    return response


def _page(status: int, headers: dict[str, str] | None = None) -> Response:
    title, message = _PAGES.get(status, _PAGES[503 if status >= 500 else 400])
    html = render_template("paymentlinks/unavailable.html", title=title, message=message)
    response = Response(html, status=status, mimetype="text/html")
    response.headers.update(headers or {})
    return _secure(response)


@bp.errorhandler(DomainError)
def _domain_error(error: DomainError) -> Response:
    return _page(CATALOG[error.code].status, error.headers)


@bp.errorhandler(HTTPException)
def _http_error(error: HTTPException) -> Response:
    return _page(error.code or 500)


@bp.errorhandler(Exception)
def _unexpected(error: Exception) -> Response:
    if not database_unavailable(error):
        log.exception("payment link page failed")
    return _page(503, {"Retry-After": "5"})


def _a_buyer_navigating() -> bool:
    """A person's browser opening the link itself: not a robot, not a request another page embeds."""
    if ROBOTS.search(request.headers.get("User-Agent", "")):
        return False
    return request.headers.get("Sec-Fetch-Dest", "document") == "document"


def _our_form() -> bool:
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("Origin")
    return origin is None or urlsplit(origin).netloc == request.host


def _make_intent(link_id: str) -> Response:
    services.limit_visits()
    settings = appstate.settings()
    checkout = services.visit(link_id, appstate.chains(), settings.checkout_host, settings.max_amount_usdc)
    return _secure(Response(status=303, headers={"Location": checkout}))


def _link_page(link_id: str) -> Response:
    services.limit_visits("page")
    link: dict[str, Any] = services.link_page(link_id)
    amount = f"{Decimal(link['amount_usdc']).normalize():,f}"
    html = render_template("paymentlinks/link.html", link=link, amount=amount)
    return _secure(Response(html, status=200, mimetype="text/html"))


@bp.route("/l/<string:link_id>", methods=["GET", "POST"])
def visit(link_id: str) -> Response:
    if request.method == "POST":
        if not _our_form():
            return _page(403)
        return _make_intent(link_id)
    if request.method == "HEAD" or not _a_buyer_navigating():
        return _link_page(link_id)
    return _make_intent(link_id)
