"""Lone UTF-16 surrogates in JSON bodies: ``"\\ud800"`` is valid JSON text but no Unicode character, so it
cannot be encoded to UTF-8 (for the database, a log line or a webhook body). Every route refuses it at the
parse with ``400 INVALID_JSON`` (keys too), never a 500; a correctly paired surrogate (an emoji) is fine.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.jsonio import JSONParseError, strict_loads

LONE = ["\\ud800", "\\udfff", "\\uDBFF", "x\\ud800y", "\\udc00\\ud800", "\\ud800\\u0041"]


@pytest.mark.parametrize("escaped", LONE)
def test_the_parser_refuses_a_lone_surrogate(escaped: str) -> None:
    for text in (f'"{escaped}"', f'{{"a": ["{escaped}"]}}', f'{{"{escaped}": 1}}'):
        with pytest.raises(JSONParseError, match="surrogate"):
            strict_loads(text)
        with pytest.raises(JSONParseError, match="surrogate"):
            strict_loads(text.encode())


def test_paired_surrogates_and_lookalikes_are_fine() -> None:
    assert strict_loads('{"d": "mug \\ud83d\\ude00"}') == {"d": "mug \U0001f600"}
    assert strict_loads('"\\\\ud800"') == "\\ud800"  # an escaped backslash, then plain text
    assert strict_loads('"\u00e9\\u00e9"') == "\u00e9\u00e9"


def _bodies() -> list[tuple[str, str, str]]:
    """(method, path, body) for each public and keyed route with a JSON body, a lone surrogate in a field."""
    s = "\\ud800"
    return [
        ("post", "/api/v1/x402/intents", f'{{"amount_usdc": "1.00", "description": "mug {s}"}}'),
        ("post", "/api/v1/x402/intents", f'{{"amount_usdc": "1.00", "metadata": {{"note": "{s}"}}}}'),
        ("post", "/api/v1/x402/intents", f'{{"amount_usdc": "1.00", "metadata": {{"k{s}": "v"}}}}'),
        ("post", "/api/v1/x402/intents", f'{{"amount_usdc": "1.00", "order_id": "o-{s}"}}'),
        ("post", "/api/v1/webhooks", f'{{"url": "https://example.com/{s}", "events": ["payment.completed"]}}'),
        ("post", "/api/v1/webhooks", f'{{"url": "https://example.com/", "description": "{s}"}}'),
        ("post", "/api/v1/webhooks/test", f'{{"event_type": "payment.completed{s}"}}'),
        ("post", "/api/v1/x402/pay", f'{{"intent_id": "{s}", "payment_signature": "{s}"}}'),
        ("post", "/api/v1/checkout/intents/00000000-0000-4000-8000-000000000000/pay", f'{{"x{s}": "{s}"}}'),
    ]


@pytest.mark.parametrize(("method", "path", "body"), _bodies())
def test_every_route_answers_400_invalid_json(client: Any, merchant: Any, method: str, path: str, body: str) -> None:
    response = getattr(client, method)(
        path, data=body.encode(), headers={**merchant.headers, "Content-Type": "application/json"}
    )
    assert response.status_code == 400, (path, response.status_code, response.get_data(as_text=True)[:300])
    error = response.get_json()["error"]
    assert error["code"] == "INVALID_JSON"
    assert "surrogate" in error["message"]
    # The key still works: the refused request left no broken transaction behind.
    assert client.get("/api/v1/webhooks", headers=merchant.headers).status_code == 200


def test_json_escape_in_the_message_is_not_echoed(client: Any, merchant: Any) -> None:
    body = json.dumps({"description": "\\ud800"}).replace("\\\\", "\\")
    response = client.post(
        "/api/v1/x402/intents", data=body, headers={**merchant.headers, "Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert "\ud800" not in response.get_data(as_text=True)


def test_payment_headers_and_answers_read_by_the_library_refuse_it_too() -> None:
    import base64

    from payintent import jsonlimits, x402

    with pytest.raises(jsonlimits.LoneSurrogate):
        jsonlimits.loads('{"network": "\\ud800"}')
    header = base64.b64encode(b'{"x402Version": 1, "network": "\\ud800"}').decode()
    with pytest.raises(x402.HeaderError):
        x402.decode_header(header)
