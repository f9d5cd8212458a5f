"""The merchant dashboard: server-rendered pages over the domain services.

Every POST carries the session's CSRF token and answers with a redirect (post/redirect/get);
bad input re-renders its form with status 400. Secrets (API keys, webhook signing secrets) are
shown once: the POST keeps them server-side (``reveals``) and puts only a random handle in the
session; the next page rendered by a GET shows the secret and deletes it. The session cookie never
carries a secret. Another merchant's objects are 404, like unknown ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from flask import (
    Blueprint,
    Response,
    flash,
    g,
    make_response,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from werkzeug.exceptions import HTTPException, NotFound

from backend import appstate, clock, passwords, ratelimit
from backend.chains.registry import ChainRegistry
from backend.config import Settings
from backend.dashboard import display, forms, reveals, security, services
from backend.dashboard.forms import Form
from backend.errors import DomainError, database_unavailable
from backend.events.services import EVENT_TYPES
from backend.extensions import db
from backend.intents import export
from backend.intents.models import PAID, STATUSES
from backend.merchants import services as merchants
from backend.merchants.models import Merchant
from backend.webhooks import services as webhooks
from backend.webhooks.transport import TargetRefused, check_url_literal

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent.parent / "static" / "dashboard"
DELIVERY_PAGE_SIZE = 10
_REVEAL = "reveal"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
# The refund and wallets pages run our own scripts (static/dashboard/*.js), which call our own JSON routes.
_SCRIPTED_CSP = _CSP + "; script-src 'self'; connect-src 'self'"
# Dashboard pages whose scripts run: the refund's page and the wallets page (their wallet code, wallets.js).
SCRIPTED_ENDPOINTS = frozenset({"dashboard.refund_detail", "dashboard.wallets", "dashboard.save_wallet"})
_ERRORS = {
    400: ("Something in that request was not right", "Go back, check the form and try again."),
    403: ("Not allowed", "You cannot do that."),
    404: ("Page not found", "There is nothing here, or it belongs to another account."),
    405: ("Not allowed", "That page cannot be used this way."),
    409: ("That could not be done", "It conflicts with the current state. Reload and try again."),
    413: ("That was too large", "The form you sent is larger than we accept."),
    429: ("Too many attempts", "Wait a few minutes, then try again."),
    500: ("Something went wrong on our side", "Nothing was lost. Try again in a moment."),
    503: ("Temporarily unavailable", "A service we depend on cannot be reached. Try again in a moment."),
}
_CSRF_MESSAGE = (
    "This form has expired or did not come from this dashboard, so nothing was changed. "
    "Go back, reload the page and submit it again."
)

bp = Blueprint("dashboard", __name__, url_prefix="/dashboard", static_folder=STATIC_DIR, static_url_path="/static")


# --- plumbing ------------------------------------------------------------------------------------


def app_registry() -> ChainRegistry:
    return appstate.chains()


def app_checkout_host() -> str:
    return appstate.settings().checkout_host


def session_merchant_id() -> str:
    merchant: Merchant = g.merchant  # set by login_required
    return merchant.id


def _take_reveal(http_status: int) -> reveals.Reveal | None:
    """The secret waiting for this page, if it is a successful GET by the merchant who made it (then never again)."""
    merchant, session_id = g.get("merchant"), security.session_id()
    if request.method != "GET" or http_status >= 400 or _REVEAL not in session:
        return None  # an error page leaves it for the next page
    handle = session.pop(_REVEAL)
    if merchant is None or session_id is None:
        return None
    return reveals.take(handle, merchant.id, session_id)


def render(template: str, http_status: int = 200, /, **context: Any) -> Response:
    reveal = _take_reveal(http_status)
    page = render_template(
        f"dashboard/{template}",
        merchant=g.get("merchant"),
        reveal=reveal,
        csrf_token=security.csrf_token,
        csrf_field=security.CSRF_FIELD,
        display=display,
        signup_open=_signup_open(),
        **context,
    )
    return make_response(page, http_status)


def error_page(status: int, message: str | None = None, title: str | None = None) -> Response:
    default_title, default_message = _ERRORS.get(status, _ERRORS[500 if status >= 500 else 400])
    return render("error.html", status, status=status, title=title or default_title, message=message or default_message)


# What the dashboard's scripts may ask a minute per merchant (each runs chain reads, as the API's calls do).
SCRIPT_CALLS_PER_MINUTE = 30


def limit_script_calls(merchant_id: str) -> None:
    """429 RATE_LIMITED (raised) past SCRIPT_CALLS_PER_MINUTE calls of the scripts' JSON routes by the merchant."""
    ratelimit.enforce(f"dashboard-script:{merchant_id}", SCRIPT_CALLS_PER_MINUTE)


def _reveal(merchant_id: str, kind: str, secret: str, subject: str) -> None:
    """Show ``secret`` on the next page rendered (by a GET), and never again; the session gets a handle only."""
    session_id = security.session_id()
    if session_id is None:  # cannot happen: every caller is logged in
        raise RuntimeError("a secret can only be revealed in a logged-in session")
    reveals.discard(session.pop(_REVEAL, None))
    session[_REVEAL] = reveals.store(merchant_id, session_id, kind, secret, subject)


def login_required(view: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if g.get("merchant") is None:
            target = request.path + (f"?{request.query_string.decode('latin-1')}" if request.query_string else "")
            return redirect(url_for("dashboard.login", next=target if request.method == "GET" else None))
        return view(*args, **kwargs)

    return wrapper


def _load_merchant() -> None:
    merchant_id = security.session_merchant_id()
    g.merchant = db.session.get(Merchant, merchant_id) if merchant_id else None
    if merchant_id and g.merchant is None:  # the account is gone
        session.clear()


@bp.before_request
def _before() -> Response | None:
    if request.endpoint == "dashboard.static":
        return None
    g.merchant = None
    if request.method not in _SAFE_METHODS:
        if any("\x00" in text for pair in request.form.items(multi=True) for text in pair):
            return error_page(400, "Forms must not contain NUL characters.")
        # A form's field; a JSON body (the refund and wallets pages' scripts) in the X-CSRF-Token header only. No
        # other site can send either (no CORS is ever allowed; the session cookie is SameSite=Lax).
        if request.is_json:
            submitted = request.headers.get(security.CSRF_HEADER)
        else:
            submitted = request.form.get(security.CSRF_FIELD)
        if not security.csrf_valid(submitted):
            return error_page(400, _CSRF_MESSAGE, "This form could not be accepted")
    _load_merchant()
    return None


@bp.after_request
def _headers(response: Response) -> Response:
    if request.endpoint != "dashboard.static":
        response.headers["Cache-Control"] = "no-store"
    response.headers["Content-Security-Policy"] = _SCRIPTED_CSP if request.endpoint in SCRIPTED_ENDPOINTS else _CSP
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    return response


@bp.before_app_request
def _routing_errors() -> Response | None:
    """Unknown dashboard URLs and wrong methods get a page, not the API's JSON error."""
    exc = request.routing_exception
    if exc is None or not (request.path == bp.url_prefix or request.path.startswith(f"{bp.url_prefix}/")):
        return None
    code = getattr(exc, "code", None)
    if not isinstance(code, int) or code < 400:
        return None  # e.g. the redirect that adds a trailing slash
    _load_merchant()
    response = _headers(error_page(code))
    valid = getattr(exc, "valid_methods", None)
    if code == 405 and valid:
        response.headers["Allow"] = ", ".join(sorted(valid))  # sorted: the router keeps a set
    return response


@bp.errorhandler(HTTPException)
def _http_error(exc: HTTPException) -> Response:
    return error_page(exc.code or 500)


@bp.errorhandler(DomainError)
def _domain_error(err: DomainError) -> Response:
    """The catalog's status as a page; its message too, unless a 404 (the page says it) or a 5xx."""
    if err.http_status == 404:
        return error_page(404)
    return error_page(err.http_status, err.message if err.http_status < 500 else None)


@bp.errorhandler(Exception)
def _unexpected(exc: Exception) -> Response:
    db.session.rollback()
    if database_unavailable(exc):
        log.error("dashboard: database unavailable on %s %s: %s", request.method, request.path, exc)
        return error_page(503)
    log.exception("dashboard: unhandled error on %s %s", request.method, request.path)
    return error_page(500)


# --- account -------------------------------------------------------------------------------------


def _minutes(seconds: int) -> str:
    minutes = -(-seconds // 60)
    if minutes > 120:
        hours = -(-minutes // 60)
        return f"{hours} hours"
    return f"{minutes} minute{'s' if minutes != 1 else ''}"


def _busy(template: str, form: Form, **context: Any) -> Response:
    """Every password-hash slot stayed taken (a flood of log-ins or sign-ups): 503, try again in a moment."""
    form.error("form", passwords.BUSY_MESSAGE)
    response = render(template, 503, form=form, **context)
    response.headers["Retry-After"] = "1"
    return response


def _throttled(template: str, form: Form, throttled: security.LoginThrottled, **context: Any) -> Response:
    """Too many log-ins or password checks (security.reserve_login_attempt): 429 with Retry-After, no hash run."""
    form.error("form", f"{throttled.message} Try again in {_minutes(throttled.retry_after)}.")
    response = render(template, 429, form=form, **context)
    response.headers["Retry-After"] = str(throttled.retry_after)
    return response


def _settings() -> Settings:
    return appstate.settings()


def _signup_open() -> bool:
    return _settings().dashboard_signup == "open"


def _signup_retry_after() -> int | None:
    """Count one sign-up from this client (an IPv4 address, an IPv6 /64); the seconds to wait when over the limit."""
    per_hour = _settings().dashboard_signups_per_hour
    if per_hour <= 0:
        return None
    return ratelimit.hit(f"dashboard:signup:{ratelimit.client_key()}", per_hour, 3600)


@bp.route("/signup", methods=["GET", "POST"])
def signup() -> Any:
    if g.merchant is not None:
        return redirect(url_for(".overview"))
    if not _signup_open():
        return render("signup_closed.html", 403)
    if request.method == "GET":
        return render("signup.html", form=Form())
    form = forms.signup_form(request.form)
    if form.ok:  # counted once the form would reach the accounts: creating one, or saying the email is taken
        retry_after = _signup_retry_after()
        if retry_after is not None:
            form.error("form", f"Too many sign-ups from your network. Try again in {_minutes(retry_after)}.")
            response = render("signup.html", 429, form=form)
            response.headers["Retry-After"] = str(retry_after)
            return response
        try:  # a sign-up runs argon2 like a log-in: it counts against the address's password checks
            security.count_password_check(ratelimit.client_key())
        except security.LoginThrottled as throttled:
            return _throttled("signup.html", form, throttled)
    try:
        issued = services.sign_up(form) if form.ok else None
    except passwords.PasswordCheckBusy:
        return _busy("signup.html", form)
    if issued is None:
        return render("signup.html", 400, form=form)
    security.start_session(issued.key.merchant_id)
    _reveal(issued.key.merchant_id, "api_key", issued.secret, "your first API key")
    flash("Your account is ready. Next: register a wallet so intents can be paid.", "success")
    redirected = redirect(url_for(".overview"))
    security.remember_device(redirected, form.values["email"])
    return redirected


@bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    next_page = security.safe_next(request.values.get("next"))
    if g.merchant is not None:
        return redirect(next_page or url_for(".overview"))
    if request.method == "GET":
        return render("login.html", form=Form(), next_page=next_page)
    form = forms.login_form(request.form)
    if not form.ok:
        return render("login.html", 400, form=form, next_page=next_page)
    email = form.values["email"]
    try:
        attempt = security.reserve_login_attempt(email, ratelimit.client_key())
    except security.LoginThrottled as throttled:
        return _throttled("login.html", form, throttled, next_page=next_page)
    try:
        merchant = services.authenticate_merchant(email, form.values["password"])
    except passwords.PasswordCheckBusy:  # the password was not checked: no failure to count
        security.login_abandoned(attempt)
        return _busy("login.html", form, next_page=next_page)
    except Exception:
        security.login_abandoned(attempt)
        raise
    if merchant is None:
        security.login_failed(attempt)
        form.error("form", "Invalid email or password.")
        return render("login.html", 400, form=form, next_page=next_page)
    security.login_succeeded(attempt)
    security.start_session(merchant.id)
    response = redirect(next_page or url_for(".overview"))
    security.remember_device(response, email)
    return response


@bp.post("/logout")
def logout() -> Any:
    session_id = security.session_id()
    if session_id is not None:
        reveals.forget_session(session_id)
    security.end_session()
    flash("You are logged out.", "success")
    return redirect(url_for(".login"))


@bp.get("/")
@login_required
def overview() -> Any:
    summary = services.overview(session_merchant_id(), app_registry(), app_checkout_host())
    return render("overview.html", summary=summary, statuses=STATUSES)


# --- API keys ------------------------------------------------------------------------------------


@bp.get("/keys")
@login_required
def keys() -> Any:
    return render("keys.html", keys=services.api_keys(session_merchant_id()))


@bp.post("/keys")
@login_required
def create_key() -> Any:
    issued = merchants.create_api_key(session_merchant_id())
    _reveal(session_merchant_id(), "api_key", issued.secret, f"API key {issued.key.display_prefix}\u2026")
    flash("API key created.", "success")
    return redirect(url_for(".keys"))


@bp.route("/keys/<key_id>/revoke", methods=["GET", "POST"])
@login_required
def revoke_key(key_id: str) -> Any:
    if request.method == "GET":
        key = next((k for k in services.api_keys(session_merchant_id()) if k.id == key_id), None)
        if key is None:
            raise NotFound()
        return render(
            "confirm.html",
            heading=f"Revoke API key {key.display_prefix}\u2026?",
            detail="Requests using this key are refused at once. This cannot be undone.",
            action=url_for(".revoke_key", key_id=key_id),
            button="Revoke key",
            back=url_for(".keys"),
        )
    key = merchants.revoke_api_key(session_merchant_id(), key_id)
    flash(f"API key {key.display_prefix}\u2026 is revoked; the API refuses it from now on.", "success")
    return redirect(url_for(".keys"))


# --- wallets -------------------------------------------------------------------------------------


@bp.get("/wallets")
@login_required
def wallets() -> Any:
    return _wallets_page(None)


def _wallets_page(form: Form | None, status: int = 200) -> Response:
    proof = {"challenge_url": url_for(".wallet_challenge"), "prove_url": url_for(".wallet_prove"),
             "csrf_token": security.csrf_token()}  # fmt: skip
    rows = services.wallet_rows(session_merchant_id(), app_registry())
    return render("wallets.html", status, rows=rows, form=form, proof=proof)


@bp.post("/wallets")
@login_required
def save_wallet() -> Any:
    form = forms.wallet_form(request.form)
    wallet = services.save_wallet(session_merchant_id(), form, app_registry()) if form.ok else None
    if wallet is None:
        return _wallets_page(form, 400)
    network = app_registry().get(wallet.network)
    flash(f"Saved, unverified. New intents pay {wallet.address} on {network.name if network else wallet.network}.",
          "success")  # fmt: skip
    return redirect(url_for(".wallets"))


@bp.post("/wallets/remove")
@login_required
def remove_wallet() -> Any:
    network = (request.form.get("network") or "").strip()
    merchants.remove_wallet(session_merchant_id(), network)
    flash(f"Wallet removed. New intents are not payable on {network}.", "success")
    return redirect(url_for(".wallets"))


# --- webhooks ------------------------------------------------------------------------------------


def _webhooks_page(form: Form, status: int = 200) -> Response:
    endpoints, _ = webhooks.list_endpoints(session_merchant_id(), limit=webhooks.MAX_ENDPOINTS_PER_MERCHANT, offset=0)
    return render(
        "webhooks.html", status, endpoints=endpoints, form=form, event_types=EVENT_TYPES,
        limit=webhooks.MAX_ENDPOINTS_PER_MERCHANT,
    )  # fmt: skip


@bp.get("/webhooks")
@login_required
def webhook_list() -> Any:
    return _webhooks_page(Form({"url": "", "events": [t for t in EVENT_TYPES if t.startswith("payment.")]}))


@bp.post("/webhooks")
@login_required
def create_webhook() -> Any:
    form = forms.webhook_form(request.form)
    if form.ok:
        try:
            check_url_literal(form.values["url"], appstate.settings().webhook_allow_private_targets)
        except TargetRefused as exc:
            form.error("url", f"This URL cannot receive webhooks: {exc}.")
    if not form.ok:
        return _webhooks_page(form, 400)
    try:
        endpoint, secret = webhooks.create_endpoint(session_merchant_id(), form.values["url"], form.values["events"])
    except DomainError as err:
        if err.http_status != 409:
            raise
        form.error("url", err.message + ".")
        return _webhooks_page(form, 409)
    _reveal(session_merchant_id(), "webhook_secret", secret, f"the signing secret of {endpoint.url}")
    flash("Webhook endpoint added.", "success")
    return redirect(url_for(".webhook_detail", webhook_id=endpoint.id))


def _webhook_page(webhook_id: str, form: Form, status: int = 200) -> Response:
    endpoint = webhooks.get_endpoint(session_merchant_id(), webhook_id)
    page = forms.page_number(request.args)
    if page is None:
        return error_page(400, "The page number must be a whole number of 1 or more.")
    merchant_id = session_merchant_id()
    deliveries, total = services.delivery_page(merchant_id, webhook_id, page=page, page_size=DELIVERY_PAGE_SIZE)
    return render(
        "webhook.html", status, endpoint=endpoint, deliveries=deliveries, form=form, event_types=EVENT_TYPES,
        pager=display.Pager(page, DELIVERY_PAGE_SIZE, total),
    )  # fmt: skip


@bp.get("/webhooks/<webhook_id>")
@login_required
def webhook_detail(webhook_id: str) -> Any:
    return _webhook_page(webhook_id, Form({"event": EVENT_TYPES[0]}))


@bp.post("/webhooks/<webhook_id>/test")
@login_required
def send_test_event(webhook_id: str) -> Any:
    form = forms.event_form(request.form)
    if not form.ok:
        return _webhook_page(webhook_id, form, 400)
    delivery_id, event_id = webhooks.send_test_event(session_merchant_id(), webhook_id, form.values["event"])
    flash(f"Test {form.values['event']} event {event_id} queued as delivery {delivery_id}.", "success")
    return redirect(url_for(".webhook_detail", webhook_id=webhook_id))


@bp.route("/webhooks/<webhook_id>/rotate", methods=["GET", "POST"])
@login_required
def rotate_webhook_secret(webhook_id: str) -> Any:
    if request.method == "GET":
        endpoint = webhooks.get_endpoint(session_merchant_id(), webhook_id)
        return render(
            "confirm.html",
            heading="Rotate this endpoint's signing secret?",
            detail=f"Deliveries to {endpoint.url} are signed with a new secret from now on, retries included. "
            "Update your receiver with it; the old secret stops working at once.",
            action=url_for(".rotate_webhook_secret", webhook_id=webhook_id),
            button="Rotate secret",
            back=url_for(".webhook_detail", webhook_id=webhook_id),
        )
    endpoint, secret = webhooks.rotate_secret(session_merchant_id(), webhook_id)
    _reveal(session_merchant_id(), "webhook_secret", secret, f"the new signing secret of {endpoint.url}")
    flash("Signing secret rotated.", "success")
    return redirect(url_for(".webhook_detail", webhook_id=webhook_id))


@bp.route("/webhooks/<webhook_id>/delete", methods=["GET", "POST"])
@login_required
def delete_webhook(webhook_id: str) -> Any:
    endpoint = webhooks.get_endpoint(session_merchant_id(), webhook_id)
    if request.method == "GET":
        return render(
            "confirm.html",
            heading="Delete this webhook endpoint?",
            detail=f"Nothing more is sent to {endpoint.url}; its pending deliveries are cancelled.",
            action=url_for(".delete_webhook", webhook_id=webhook_id),
            button="Delete endpoint",
            back=url_for(".webhook_detail", webhook_id=webhook_id),
        )
    webhooks.delete_endpoint(session_merchant_id(), webhook_id)
    flash(f"Webhook endpoint {endpoint.url} deleted.", "success")
    return redirect(url_for(".webhook_list"))


@bp.get("/webhooks/<webhook_id>/deliveries/<delivery_id>")
@login_required
def delivery_detail(webhook_id: str, delivery_id: str) -> Any:
    endpoint = webhooks.get_endpoint(session_merchant_id(), webhook_id)
    delivery = services.endpoint_delivery(session_merchant_id(), webhook_id, delivery_id)
    return render("delivery.html", endpoint=endpoint, delivery=delivery)


@bp.post("/webhooks/<webhook_id>/deliveries/<delivery_id>/replay")
@login_required
def replay_delivery(webhook_id: str, delivery_id: str) -> Any:
    webhooks.get_endpoint(session_merchant_id(), webhook_id)
    delivery = services.endpoint_delivery(session_merchant_id(), webhook_id, delivery_id)
    new_id = webhooks.replay_delivery(session_merchant_id(), delivery_id)
    flash(f"Event {delivery['event_id']} queued again as delivery {new_id}.", "success")
    return redirect(url_for(".webhook_detail", webhook_id=webhook_id))


# --- intents -------------------------------------------------------------------------------------


@bp.get("/intents")
@login_required
def intent_list() -> Any:
    form = forms.intents_filter(request.args)
    if not form.ok:
        return render("intents.html", 400, form=form, intents=[], pager=None, statuses=STATUSES)
    rows, total = services.intent_page(session_merchant_id(), form, app_checkout_host())
    pager = display.Pager(form.values["page"], forms.PAGE_SIZE, total)
    return render("intents.html", form=form, intents=rows, pager=pager, statuses=STATUSES)


@bp.get("/intents/export.csv")
@login_required
def intent_export() -> Any:
    """The intents page's filters (status, order_id; not its page) as a CSV download (backend.intents.export)."""
    form = forms.intents_filter({name: request.args.get(name, "") for name in ("status", "order_id")})
    if not form.ok:
        return render("intents.html", 400, form=form, intents=[], pager=None, statuses=STATUSES)
    filters = export.ExportFilters(status=form.values["status"] or None, order_id=form.values["order_id"] or None)
    now = clock.now()
    return export.download(export.export_csv(session_merchant_id(), filters, now), now)


@bp.get("/intents/<intent_id>")
@login_required
def intent_detail(intent_id: str) -> Any:
    merchant_id = session_merchant_id()
    intent, requirements, explorer = services.intent_detail(merchant_id, intent_id, app_registry(), app_checkout_host())
    duplicates = services.duplicate_payments(str(intent["intent_id"]))
    refunds = services.intent_refunds(str(intent["intent_id"]))
    paid = intent["status"] == PAID
    refundable = services.refundable_usdc(session_merchant_id(), str(intent["intent_id"])) if paid else None
    return render("intent.html", intent=intent, requirements=requirements, explorer_url=explorer,
                  duplicates=duplicates, refunds=refunds, refundable=refundable)  # fmt: skip
