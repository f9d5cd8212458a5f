"""The hosted checkout page: the static bundle built from checkout-ui/, served at ``/pay/<intent_id>``.

Every intent gets the same ``index.html``; the page reads its intent id from the path and asks the
public checkout API for the rest, so serving it touches neither the database nor a chain.
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, abort, send_from_directory

from backend import appstate

bp = Blueprint("checkout_page", __name__)

# The page talks only to this service; wallets are browser extensions, outside the page's CSP.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
NOT_BUILT = (
    "<!doctype html><meta charset=utf-8><title>Checkout unavailable</title>"
    "<p>The checkout page has not been built. Run <code>make install</code> (it runs "
    "<code>npm run build</code> in <code>checkout-ui/</code>).</p>"
)


def _dist() -> Path:
    return Path(appstate.settings().checkout_dist_dir)


def _secure(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"  # the intent id is in the URL
    return response


@bp.get("/pay/<string:intent_id>")
def page(intent_id: str) -> Response:
    """The checkout page; unknown ids get the same page, which then shows "not found"."""
    dist = _dist()
    if not (dist / "index.html").is_file():
        return _secure(Response(NOT_BUILT, status=503, mimetype="text/html"))
    response = send_from_directory(dist, "index.html", max_age=0)
    response.headers["Cache-Control"] = "no-cache"
    return _secure(response)


@bp.get("/pay/assets/<path:filename>")
def asset(filename: str) -> Response:
    """Scripts, styles and images; their names carry a content hash, so they are cached for a year."""
    directory = _dist() / "assets"
    if not directory.is_dir():
        abort(404)
    response = send_from_directory(directory, filename, max_age=365 * 24 * 3600)
    response.headers["Cache-Control"] = "public, max-age=31536000, immutable"
    return _secure(response)
