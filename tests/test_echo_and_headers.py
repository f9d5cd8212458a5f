"""What an error message repeats of the client's text is bounded and plain, and every file the service
serves carries the same security headers as its pages (Flask's default /static served them bare)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backend.errors import ECHO_LIMIT, MAX_ERROR_FIELDS, echo
from tests.conftest import make_settings, truncate_all
from tests.intents.helpers import create

HOSTILE = "<script>alert(1)</script>\r\nSet-Cookie: x=1\u202e" + "A" * 5000


def _plain(message: str) -> None:
    assert len(message) < 300, len(message)
    assert "<" not in message and "\r" not in message and "\n" not in message and "\u202e" not in message


def test_echo() -> None:
    assert echo("eip155:8453") == "'eip155:8453'"
    assert echo("a<b>\x00\u202e") == "'a?b???'"
    assert echo("x" * 100) == "'" + "x" * ECHO_LIMIT + "...'"
    assert echo(None) == "'None'"


def test_checkout_balance_with_a_hostile_network(client: Any, merchant: Any) -> None:
    intent = create(client, merchant)
    response = client.get(
        f"/api/v1/checkout/intents/{intent['intent_id']}/balance",
        query_string={"network": HOSTILE[:60], "address": "0x" + "11" * 20},
    )
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "UNSUPPORTED_NETWORK"
    _plain(error["message"])


def test_unknown_fields_are_named_boundedly(client: Any, merchant: Any) -> None:
    body = {"amount_usdc": "1", **{f"{HOSTILE[:300]}{n}": 1 for n in range(100)}}
    response = client.post("/api/v1/x402/intents", json=body, headers=merchant.headers)
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    _plain(error["message"])
    assert len(error["fields"]) <= MAX_ERROR_FIELDS
    for name in error["fields"]:
        _plain(name)


def test_hostile_metadata_key_and_x402_version(client: Any, merchant: Any) -> None:
    response = client.post(
        "/api/v1/x402/intents",
        json={"amount_usdc": "1", "metadata": {"<b>\u202ek": {"x": 1}}},
        headers=merchant.headers,
    )
    assert response.status_code == 400
    _plain(response.get_json()["error"]["message"])
    intent = create(client, merchant)
    response = client.post(
        "/api/v1/x402/pay",
        json={"intent_id": intent["intent_id"], "payment_signature": {"x402Version": HOSTILE}},
        headers=merchant.headers,
    )
    assert response.status_code == 400
    _plain(response.get_json()["error"]["message"])


@pytest.fixture
def files_app(db_url: str, chains: Any, tmp_path: Path) -> Any:
    from backend.app import create_app
    from backend.extensions import db

    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text("<!doctype html><title>pay</title>")
    (tmp_path / "assets" / "index-abc.js").write_text("console.log(1)")
    truncate_all(db_url)
    app = create_app(make_settings(db_url, checkout_dist_dir=str(tmp_path)), chains=chains)
    with app.app_context():
        yield app
        db.session.remove()
        db.engine.dispose()


def test_every_file_carries_the_security_headers(files_app: Any) -> None:
    client = files_app.test_client()
    for path in ("/dashboard/static/dashboard.css", "/api/v1/docs/static/init.js", "/pay/assets/index-abc.js"):
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.headers["X-Content-Type-Options"] == "nosniff", path
        assert "default-src" in response.headers["Content-Security-Policy"], path
    # Flask's app-wide /static served the same files with none of them; it is gone.
    assert client.get("/static/dashboard/dashboard.css").status_code == 404
    # Error answers and JSON carry them too.
    for path in ("/nothing-here", "/healthz"):
        response = client.get(path)
        assert response.headers["X-Content-Type-Options"] == "nosniff", path
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"], path
