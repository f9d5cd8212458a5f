"""The interactive API reference (``/api/v1/docs``): Swagger UI served by the app itself, under its own CSP.

The Swagger UI files come from the npm package ``swagger-ui-dist`` (pinned in package.json), copied by
``make install`` (and by the Dockerfile) into ``static/apidocs/swagger-ui/`` by ``deploy/swagger_ui.mjs``;
nothing is loaded from a CDN, so the page works offline and no third-party script runs on a payment
service's origin. The page has no inline script (``static/apidocs/init.js`` starts Swagger UI), so its
Content-Security-Policy allows scripts and styles from this origin only. Without the files (a package
installed without ``make install``) the page says so and links the OpenAPI document.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, current_app, render_template, url_for
from werkzeug.wrappers import Response

STATIC_DIR = Path(__file__).resolve().parent / "static" / "apidocs"
SWAGGER_UI_DIR = STATIC_DIR / "swagger-ui"
# img-src data:: Swagger UI's stylesheet draws its icons as data: SVGs. connect-src 'self': the document
# and "Try it out" requests go to this origin only.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

bp = Blueprint("apidocs", __name__, url_prefix="/api/v1/docs", static_folder=STATIC_DIR, static_url_path="/static")


@bp.get("")
def page() -> str:
    return render_template(
        "apidocs/docs.html",
        title=current_app.config["API_TITLE"],
        spec_url=url_for("api-docs.openapi_json"),
        installed=(SWAGGER_UI_DIR / "swagger-ui-bundle.js").is_file(),
    )


@bp.after_request
def _headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response
