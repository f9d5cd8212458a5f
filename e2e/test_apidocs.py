"""The API docs page in Chromium with every other origin unreachable: Swagger UI renders every operation.

Not against ``payintent dev``: the page needs only the app (it reads no database), served here on a
free port. Every request to another origin is refused and recorded, and so is every CSP violation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright.sync_api import Browser, Route, expect
from werkzeug.serving import make_server

from e2e.conftest import ARTIFACTS, DEFAULT_TIMEOUT_MS, VIEWPORT
from tests.conftest import free_port, make_settings

METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from backend.app import create_app

    database = Path(tmp_path_factory.mktemp("apidocs")) / "unused.db"
    app = create_app(make_settings(f"sqlite:///{database}"))
    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    thread.join(timeout=10)


def test_the_docs_page_renders_every_operation_offline(browser: Browser, docs_server: str) -> None:
    spec = requests.get(f"{docs_server}/api/v1/openapi.json", timeout=10).json()
    operations = sum(1 for item in spec["paths"].values() for method in item if method in METHODS)
    assert operations > 5

    context = browser.new_context(viewport=VIEWPORT)
    refused: list[str] = []

    def offline(route: Route) -> None:
        url = route.request.url
        if url == docs_server or url.startswith(docs_server + "/"):
            route.continue_()
        else:
            refused.append(url)
            route.abort("internetdisconnected")

    context.route("**/*", offline)
    context.add_init_script(
        "window.__csp = []; document.addEventListener('securitypolicyviolation', "
        "e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"
    )
    page = context.new_page()
    page.set_default_timeout(DEFAULT_TIMEOUT_MS)
    errors: list[Any] = []
    page.on("pageerror", lambda error: errors.append(error))
    try:
        page.goto(f"{docs_server}/api/v1/docs")
        expect(page.locator(".opblock")).to_have_count(operations)
        intents = page.locator(".opblock-summary-path", has_text="/api/v1/x402/intents").first
        expect(intents).to_be_visible()
        intents.click()  # opens the operation's details
        expect(page.locator(".opblock-body").first).to_be_visible()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "test_the_docs_page_renders_every_operation_offline.png"))
        assert page.evaluate("window.__csp") == []
        assert errors == []
        assert refused == []
    finally:
        context.close()
