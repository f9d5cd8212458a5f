"""Driving the dashboard like a browser: read the CSRF token from the page, post forms, read pages."""

from __future__ import annotations

import html
import re
from typing import Any

PASSWORD = "correct horse battery"  # the conftest merchant's password
_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')
_SECRET = re.compile(r'id="revealed-secret"[^>]*\bvalue="([^"]+)"')


def text(response: Any) -> str:
    return response.get_data(as_text=True)


def form_token(page: str) -> str:
    match = _TOKEN.search(page)
    assert match, "the page has no form with a CSRF token"
    return html.unescape(match.group(1))


def token(client: Any, path: str = "/dashboard/login") -> str:
    """The session's CSRF token, read from a page with a form (a GET: it never writes)."""
    response = client.get(path)
    assert response.status_code == 200, (path, response.status_code)
    return form_token(text(response))


def session_token(client: Any) -> str:
    """The CSRF token held in the session (without rendering a page, which would consume a one-time secret)."""
    with client.session_transaction() as session:
        value = session.get("csrf")
    assert value, "the session has no CSRF token yet"
    return str(value)


def post(client: Any, path: str, data: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """POST a dashboard form with the session's CSRF token, as the page's form would."""
    body = {"csrf_token": session_token(client), **(data or {})}
    return client.post(path, data=body, **kwargs)


def revealed_secret(page: str) -> str | None:
    match = _SECRET.search(page)
    return html.unescape(match.group(1)) if match else None


def sign_up(client: Any, email: str, password: str = PASSWORD, name: str = "Mugs & Co") -> Any:
    data = {"csrf_token": token(client, "/dashboard/signup"), "email": email, "password": password, "name": name}
    return client.post("/dashboard/signup", data=data)


def log_in(client: Any, email: str, password: str = PASSWORD, **kwargs: Any) -> Any:
    data = {"csrf_token": token(client), "email": email, "password": password}
    return client.post("/dashboard/login", data=data, **kwargs)


def log_out(client: Any) -> Any:
    return post(client, "/dashboard/logout")


def intent_ids(page: str) -> list[str]:
    """Intent ids linked from a page, in order."""
    return re.findall(r'href="/dashboard/intents/([0-9a-f-]{36})"', page)
