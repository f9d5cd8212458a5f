"""The interactive API docs page loads Swagger UI from this app, never from a CDN, under its own strict CSP.

A third-party script on a payment service's origin could read what the page shows and call the API
with the key typed into "Authorize"; and a CDN makes the page blank offline. e2e/test_apidocs.py opens
the page in Chromium with every other origin unreachable.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

DOCS = "/api/v1/docs"
ROOT = Path(__file__).resolve().parents[1]


class _Resources(HTMLParser):
    """The URLs a page makes the browser fetch (scripts, stylesheets, icons, images) and its inline scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "script":
            if values.get("src"):
                self.urls.append(values["src"] or "")
            else:
                self._in_script = True
        elif tag == "link" and values.get("href"):
            self.urls.append(values["href"] or "")
        elif tag in ("img", "iframe", "embed", "source") and values.get("src"):
            self.urls.append(values["src"] or "")
        for name, value in attrs:
            if name.startswith("on") and value:
                self.inline_scripts.append(value)  # an event handler attribute is an inline script too

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False


def _resources(html: str) -> _Resources:
    parser = _Resources()
    parser.feed(html)
    return parser


def test_the_docs_page_loads_only_same_origin_files_that_the_app_serves(client):
    response = client.get(DOCS)
    assert response.status_code == 200
    page = _resources(response.get_data(as_text=True))
    assert page.inline_scripts == []
    assert any(url.endswith("/swagger-ui-bundle.js") for url in page.urls)
    assert any(url.endswith("/swagger-ui.css") for url in page.urls)
    for url in page.urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), f"not same-origin: {url}"
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert asset.content_length and asset.content_length > 0, url
    assert "cdn" not in response.get_data(as_text=True).lower()


def test_the_docs_page_has_a_strict_csp(client):
    response = client.get(DOCS)
    directives = {
        d.strip().split()[0]: d.strip().split()[1:] for d in response.headers["Content-Security-Policy"].split(";")
    }
    assert directives["default-src"] == ["'self'"]
    assert directives["script-src"] == ["'self'"]  # no 'unsafe-inline', no 'unsafe-eval', no other origin
    assert directives["style-src"] == ["'self'"]
    assert directives["connect-src"] == ["'self'"]
    assert directives["frame-ancestors"] == ["'none'"] and directives["object-src"] == ["'none'"]
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_the_document_and_a_missing_asset(client):
    spec = client.get("/api/v1/openapi.json")
    assert spec.status_code == 200 and spec.get_json()["openapi"].startswith("3.1")
    missing = client.get(f"{DOCS}/static/swagger-ui/nope.js")
    assert missing.status_code == 404 and missing.get_json()["success"] is False
    assert client.get(f"{DOCS}/static/../apidocs.py").status_code == 404


def test_without_swagger_ui_installed_the_page_says_so(client, monkeypatch, tmp_path):
    from backend import apidocs

    monkeypatch.setattr(apidocs, "SWAGGER_UI_DIR", tmp_path / "absent")
    response = client.get(DOCS)
    assert response.status_code == 200
    body = response.get_data(as_text=True)
    assert "make install" in body and 'href="/api/v1/openapi.json"' in body
    assert _resources(body).urls == []


def test_the_image_builds_swagger_ui_into_the_package():
    """The image cannot rely on a local `make install`: its own stage fetches the locked files into the wheel."""
    from backend import apidocs
    from tests.test_deploy import dockerfile_instructions, dockerignored

    instructions = dockerfile_instructions()
    copy = next(i for i, (k, args) in enumerate(instructions) if k == "COPY" and "--from=swagger-ui" in args)
    assert instructions[copy][1][-1] == "backend/static/apidocs/swagger-ui"
    wheel = next(i for i, (k, args) in enumerate(instructions) if k == "RUN" and args[:2] == ["pip", "wheel"])
    stage = max(i for i, (k, _) in enumerate(instructions[:copy]) if k == "FROM")
    assert stage < copy < wheel and instructions[stage][1][-1] == "wheel"
    assert any(k == "RUN" and "deploy/swagger_ui.mjs" in args and "--pack" in args for k, args in instructions)
    for needed in ("package.json", "package-lock.json", "deploy/swagger_ui.mjs"):
        assert not dockerignored(needed), needed
    assert dockerignored(f"{apidocs.SWAGGER_UI_DIR.relative_to(ROOT)}/swagger-ui-bundle.js")  # a local copy stays out


def test_swagger_ui_is_pinned_exactly():
    package = json.loads((ROOT / "package.json").read_text())
    version = package["devDependencies"]["swagger-ui-dist"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    locked = json.loads((ROOT / "package-lock.json").read_text())["packages"]["node_modules/swagger-ui-dist"]
    assert locked["version"] == version and locked["integrity"].startswith("sha512-")
    assert package["scarfSettings"] == {"enabled": False}  # its dependency's install-time analytics: off
