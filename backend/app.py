"""The Flask application factory: ``backend.app:create_app``."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from flask import Flask, request
from sqlalchemy.engine import make_url

from backend import appstate, passwords
from backend.apidocs import bp as apidocs_bp
from backend.chains.registry import ChainRegistry
from backend.checkout.pages import bp as checkout_page_bp
from backend.checkout.views import blp as checkout_blp
from backend.config import Settings
from backend.dashboard import init_app as init_dashboard
from backend.errors import DomainError
from backend.extensions import api, connect_args, db
from backend.facilitator.schemas import facilitator_components
from backend.facilitator.views import blp as facilitator_blp
from backend.http import JSONRequest
from backend.http_errors import register_error_handlers
from backend.intents.models import REFUND_ID_PATTERN
from backend.intents.views import IntentIdConverter
from backend.intents.views import blp as intents_blp
from backend.jsonio import ExactJSONProvider, dumps, stored_loads
from backend.merchants.views import blp as wallets_blp
from backend.observability.hooks import init_app as init_observability
from backend.paymentlinks.pages import bp as payment_link_page_bp
from backend.paymentlinks.services import LINK_ID_PATTERN
from backend.paymentlinks.views import LinkIdConverter
from backend.paymentlinks.views import blp as payment_links_blp
from backend.schemas import JSON_VALUE, JSON_VALUE_SCHEMA, FlatMetadata, HttpUrl, UsdcAmount, openapi_override
from backend.settlement.refund_views import RefundIdConverter
from backend.settlement.refund_views import blp as refunds_blp
from backend.settlement.schemas import x402_components
from backend.settlement.views import blp as payments_blp
from backend.webhooks.tasks import init_app as init_webhooks
from backend.webhooks.views import WEBHOOK_ID_PATTERN, WebhookIdConverter
from backend.webhooks.views import blp as webhooks_blp

MAX_REQUEST_BYTES = 64 * 1024


# Each process's connection pool: up to POOL_SIZE + POOL_OVERFLOW connections. A gunicorn worker runs WEB_THREADS
# (32) requests at once, more than the pool holds: a request holds a connection only while its transaction is open,
# and a /pay ends its transaction before it waits on the chain or the relayer (settlement.flow). A request that
# finds none free within POOL_TIMEOUT_SECONDS is answered 503 SERVICE_UNAVAILABLE (backend.http_errors), not 500.
# A relayer process keeps min(settlement threads, RELAYER_POOL_SIZE) connections and opens no more: a settlement
# thread holds one only while it reads or writes, never while it waits for the chain (relayer.tasks ends its
# transaction first), so its threads share fewer connections than they are; one that finds none free waits up to
# POOL_TIMEOUT_SECONDS, and then its settlement is tried again (relayer.tasks.SETTLE_RETRY_SECONDS). A relayer thus
# never opens a connection per thread when a block finishes all its settlements at once (docs/deploy.md's budget).
POOL_SIZE = 5
POOL_OVERFLOW = 15
POOL_TIMEOUT_SECONDS = 10
RELAYER_POOL_SIZE = 10


def _engine_options(url: str, threads: int | None = None) -> dict[str, Any]:
    """The engine's options; ``threads``: a relayer process's settlement threads (None: the api's pool)."""
    options: dict[str, Any] = {
        "json_serializer": dumps,
        "json_deserializer": stored_loads,
        "connect_args": connect_args(url),
    }
    if make_url(url).database not in (None, "", ":memory:"):  # an in-memory SQLite keeps one connection per thread
        pool_size, overflow = (POOL_SIZE, POOL_OVERFLOW) if threads is None else (min(threads, RELAYER_POOL_SIZE), 0)
        options.update(pool_size=pool_size, max_overflow=overflow, pool_timeout=POOL_TIMEOUT_SECONDS)
    if url.startswith("postgresql"):
        # A pooled connection the server dropped (a restart, an idle timeout) is replaced when checked out,
        # instead of failing the request that gets it: on psycopg2 by extensions.ping_idle_connections (installed
        # by the extension; it pings only a connection idle 0.5 s or one its server wrote to), elsewhere by
        # SQLAlchemy's pool_pre_ping (a round trip on every checkout).
        options.update(pool_recycle=1800)
        if make_url(url).get_driver_name() != "psycopg2":
            options.update(pool_pre_ping=True)
    return options


def most_connections(threads: int | None = None) -> int:
    """The most database connections one process opens (``_engine_options``): an api process, or a relayer
    process with ``threads`` settlement threads."""
    options = _engine_options("postgresql://budget/payintent", threads)
    return int(options["pool_size"]) + int(options["max_overflow"])


def relative_redirect(response: Any) -> Any:
    """A redirect never names the request's Host and is never cached.

    Werkzeug's routing redirects (a missing trailing slash, merged slashes: 308) are absolute URLs built from
    the Host header, so a cache in front could store "/dashboard -> https://evil.example/dashboard/" for
    everyone. The service never redirects to another site (``security.safe_next`` allows dashboard paths
    only), so every absolute Location becomes its path and query alone (a path that would read as another
    host, ``//evil.example`` or ``/\\evil.example``, keeps one slash), and every redirect gets ``no-store``.
    """
    if not 300 <= response.status_code < 400 or response.status_code == 304:  # 304: a cached file, still fresh
        return response
    response.headers["Cache-Control"] = "no-store"
    location = response.headers.get("Location")
    if location:
        parts = urlsplit(location)
        if parts.scheme or parts.netloc or parts.path.startswith(("//", "/\\")):
            path = "/" + parts.path.lstrip("/\\")
            response.headers["Location"] = urlunsplit(("", "", path, parts.query, parts.fragment))
    return response


def create_app(
    settings: Settings | None = None, chains: ChainRegistry | None = None, *, relayer_threads: int | None = None
) -> Flask:
    """The app; ``relayer_threads``: a relayer process's settlement threads, which size its database pool
    (``_engine_options``)."""
    settings = settings or Settings.from_env()
    # No app-wide /static: Flask's default served backend/static/ (the dashboard's and the docs' files) a second
    # time, without their security headers. Each blueprint serves its own files, with its headers.
    app = Flask(__name__, static_folder=None)
    if settings.trusted_proxy_hops:  # request.remote_addr (rate limits) from X-Forwarded-For, set by our proxies
        from werkzeug.middleware.proxy_fix import ProxyFix

        # X-Forwarded-Host is never trusted (x_host=0): nothing may take the host it names for ours.
        hops = settings.trusted_proxy_hops
        # Flask's documented way to put WSGI middleware in front; mypy refuses any assignment to a method.
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=0)  # type: ignore[method-assign]
    app.json = ExactJSONProvider(app)
    app.request_class = JSONRequest  # request.get_json(): depth-capped, and 400 INVALID_JSON like the API's parser
    app.config.update(
        SECRET_KEY=settings.secret_key,
        MAX_CONTENT_LENGTH=MAX_REQUEST_BYTES,
        SQLALCHEMY_DATABASE_URI=settings.database_url,
        SQLALCHEMY_ENGINE_OPTIONS=_engine_options(settings.database_url, relayer_threads),
        API_TITLE="payintent",
        API_VERSION="v1",
        OPENAPI_VERSION="3.1.0",
        OPENAPI_URL_PREFIX="/api/v1",
        OPENAPI_JSON_PATH="openapi.json",
        # No OPENAPI_SWAGGER_UI_*: flask-smorest's page loads Swagger UI from a CDN through an inline script;
        # backend.apidocs serves /api/v1/docs from the package instead, under a strict CSP.
        API_SPEC_OPTIONS={
            "info": {
                "description": "Stablecoin payment intents settled on chain (x402 / EIP-3009). Every call needs "
                "'Authorization: Bearer sk_test_...'. Errors are {success:false,error:{code,message}}.",
            },
            "security": [{"bearerAuth": []}],
        },
    )
    appstate.init_app(app, settings, chains or ChainRegistry.load(settings.chains_file))
    passwords.configure(
        settings.login_hash_concurrency, settings.login_hash_wait_seconds, settings.login_hash_slots_dir
    )
    init_observability(app)  # first: its request hooks wrap every other one (JSON logs, request ids, metrics)

    db.init_app(app)
    app.url_map.converters["webhook_id"] = WebhookIdConverter  # before the blueprints' rules are bound
    app.url_map.converters["link_id"] = LinkIdConverter
    app.url_map.converters["intent_id"] = IntentIdConverter
    app.url_map.converters["refund_id"] = RefundIdConverter
    api.init_app(app)
    api.spec.components.security_scheme("bearerAuth", {"type": "http", "scheme": "bearer"})
    api.register_field(UsdcAmount, "number", None)
    api.register_field(HttpUrl, "string", None)  # its pattern says which URLs (IRIs too: not format uri)
    api.register_field(FlatMetadata, "object", None)
    api.register_converter(WebhookIdConverter, lambda _: {"type": "string", "pattern": f"^{WEBHOOK_ID_PATTERN}$"})
    api.register_converter(LinkIdConverter, lambda _: {"type": "string", "pattern": f"^{LINK_ID_PATTERN}$"})
    api.register_converter(IntentIdConverter, lambda _: {"type": "string", "minLength": 1})
    api.register_converter(RefundIdConverter, lambda _: {"type": "string", "pattern": f"^{REFUND_ID_PATTERN}$"})
    api.ma_plugin.converter.add_attribute_function(openapi_override)  # a field's metadata["openapi"], last
    # Hand-written components (the x402 forms, for the configured networks), referenced by the schemas' fields.
    components = {JSON_VALUE: JSON_VALUE_SCHEMA, **x402_components(appstate.chains(app))}
    for name, component in {**components, **facilitator_components(appstate.chains(app))}.items():
        api.spec.components.schema(name, component)

    api.register_blueprint(intents_blp)
    api.register_blueprint(payments_blp)
    api.register_blueprint(facilitator_blp)
    api.register_blueprint(webhooks_blp)
    api.register_blueprint(payment_links_blp)
    api.register_blueprint(refunds_blp)
    api.register_blueprint(wallets_blp)
    api.register_blueprint(checkout_blp)
    register_error_handlers(app)

    app.register_blueprint(apidocs_bp)
    app.register_blueprint(checkout_page_bp)
    app.register_blueprint(payment_link_page_bp)

    init_dashboard(app)
    init_webhooks(app)  # events -> deliveries, and the after-commit wake-up of the senders

    @app.before_request
    def refuse_nul_characters() -> None:
        # No identifier or filter contains NUL; PostgreSQL cannot even compare with one.
        if "\x00" in request.path or any("\x00" in k or "\x00" in v for k, v in request.args.items(multi=True)):
            raise DomainError("INVALID_REQUEST", "The path and query must not contain NUL characters")

    @app.after_request
    def api_security_headers(response: Any) -> Any:
        # API answers may carry secrets (a new key, a webhook secret): never cached, never sniffed.
        # No CORS headers are ever sent: browsers on other origins cannot read the API.
        if request.path.startswith("/api/"):
            response.headers.setdefault("Cache-Control", "no-store")
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response

    @app.after_request
    def host_free_redirects(response: Any) -> Any:
        return relative_redirect(response)

    @app.after_request
    def baseline_security_headers(response: Any) -> Any:
        # Every answer, files and errors included: never sniffed, never framed, no active content unless the
        # page set its own policy (the dashboard, the docs page and the checkout page do, before this runs).
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'")
        return response

    @app.get("/healthz")
    def healthz() -> Any:
        return {"status": "ok"}

    return app
