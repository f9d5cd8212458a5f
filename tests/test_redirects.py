"""The Host header never reaches a redirect, and redirects are never cached.

Werkzeug's routing redirects (``/dashboard`` -> ``/dashboard/``, merged slashes) were absolute URLs built
from the request's Host (and, behind ``TRUSTED_PROXY_HOPS``, from ``X-Forwarded-Host``): a shared cache in
front could keep "/dashboard -> http://evil.example/dashboard/" and send every merchant there.
"""

from __future__ import annotations

from typing import Any

from backend.app import create_app
from tests.conftest import make_settings

HOSTILE = {"Host": "evil.example", "X-Forwarded-Host": "evil2.example", "X-Forwarded-Proto": "https"}


def _redirects(client: Any) -> None:
    cases = {
        "/dashboard": "/dashboard/",
        "/dashboard?next=%2Fdashboard%2Fkeys": "/dashboard/?next=%2Fdashboard%2Fkeys",
        "/dashboard//keys": "/dashboard/keys",
    }
    for path, location in cases.items():
        response = client.get(path, headers=HOSTILE)
        assert response.status_code in (301, 308), (path, response.status_code)
        assert response.headers["Location"] == location, path
        assert response.headers["Cache-Control"] == "no-store", path
        assert "evil" not in str(response.headers), path
    # The application's own redirects (already relative) are not cached either.
    login = client.get("/dashboard/", headers=HOSTILE)
    assert login.status_code == 302
    assert login.headers["Location"].startswith("/dashboard/login")
    assert login.headers["Cache-Control"] == "no-store"


def test_a_redirect_never_names_the_host_header(client: Any) -> None:
    _redirects(client)


def test_behind_a_trusted_proxy_x_forwarded_host_is_ignored(sqlite_url: str, chains: Any) -> None:
    from flask import request

    from backend.extensions import db

    app = create_app(make_settings(sqlite_url, trusted_proxy_hops=1), chains=chains)
    seen: dict[str, str] = {}

    @app.get("/test-only/host")
    def host() -> str:
        seen.update(host=request.host, scheme=request.scheme, remote=request.remote_addr or "")
        return "ok"

    with app.app_context():
        client = app.test_client()
        _redirects(client)
        headers = {"Host": "pay.example.com", "X-Forwarded-Host": "evil.example", "X-Forwarded-Proto": "https",
                   "X-Forwarded-For": "203.0.113.9"}  # fmt: skip
        assert client.get("/test-only/host", headers=headers).status_code == 200
        # The proxy's client address and scheme are used; the host it forwards is not.
        assert seen == {"host": "pay.example.com", "scheme": "https", "remote": "203.0.113.9"}
        db.session.remove()
        db.engine.dispose()


def test_a_redirect_cannot_be_turned_into_another_site() -> None:
    from flask import Flask

    from backend.app import relative_redirect

    app = Flask(__name__)
    for location, expected in {
        "http://evil.example/dashboard/": "/dashboard/",
        "//evil.example/x?y=1": "/x?y=1",
        "/\\evil.example/": "/evil.example/",
        "/dashboard/keys": "/dashboard/keys",
    }.items():
        response = relative_redirect(app.response_class(status=308, headers={"Location": location}))
        assert response.headers["Location"] == expected, location
        assert response.headers["Cache-Control"] == "no-store"
    not_modified = relative_redirect(app.response_class(status=304, headers={"Cache-Control": "max-age=60"}))
    assert not_modified.headers["Cache-Control"] == "max-age=60"
