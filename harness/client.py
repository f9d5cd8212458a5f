"""A minimal HTTP client for the API of a stack on 127.0.0.1 (one request per connection, no pooling)."""

from __future__ import annotations

import http.client
import json
from typing import Any

import simplejson

from harness.ports import HOST


def request(
    port: int,
    method: str,
    path: str,
    token: str = "",
    body: Any = None,
    timeout: float = 10,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """One HTTP request on a new connection; the answer's status and JSON (or text). A ``Decimal`` in
    ``body`` is sent as an exact JSON number."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = dict(headers or {})
        if token:
            headers["Authorization"] = f"Bearer {token}"
        payload = None
        if body is not None:
            payload = simplejson.dumps(body, use_decimal=True)
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode("utf-8", "replace")
    finally:
        conn.close()
