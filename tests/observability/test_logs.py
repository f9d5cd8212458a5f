"""Logs: one JSON object per line, the request id on every line of a request, no secret ever written."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from typing import Any

import pytest
from eth_account import Account
from solders.keypair import Keypair

from backend.logs import configure_logging, redact, register_rpc_urls, register_secret
from tests.intents.helpers import URL

API_LOGGER = logging.getLogger("backend.test_observability")


def lines(captured: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in captured.splitlines() if line.strip()]


@pytest.fixture
def json_logs(app: Any) -> Any:
    """The app logging at INFO as JSON, with a careless view that logs every header it got."""
    app.config["PAYINTENT_SETTINGS"] = replace(app.config["PAYINTENT_SETTINGS"], log_level="INFO", log_format="json")
    configure_logging("INFO", "json")

    @app.post("/careless")
    def careless() -> Any:
        from flask import request

        API_LOGGER.info("got headers %s and body %s", dict(request.headers), request.get_data(as_text=True))
        return {"ok": True}

    yield app
    configure_logging("WARNING", "json")


def test_every_line_of_a_request_carries_its_id_and_no_line_a_full_api_key(json_logs, merchant, capsys):
    client = json_logs.test_client()
    capsys.readouterr()
    response = client.post(
        URL, json={"amount_usdc": 2.5}, headers={**merchant.headers, "X-Request-Id": "order-42.attempt-1"}
    )
    assert response.status_code == 201
    assert response.headers["X-Request-Id"] == "order-42.attempt-1"
    careless = client.post(
        "/careless",
        data=json.dumps({"webhook_secret": "whsec_c2VjcmV0LXZhbHVlLW9mLXRoaXM=", "password": "hunter2-hunter2"}),
        headers={**merchant.headers, "X-Request-Id": "careless-1", "Content-Type": "application/json"},
    )
    assert careless.status_code == 200
    captured = capsys.readouterr().err
    logged = lines(captured)

    request_line = next(line for line in logged if line["logger"] == "payintent.request")
    assert request_line["request_id"] == "order-42.attempt-1"
    assert request_line | {"ts": None, "duration_ms": None} == {
        "ts": None, "level": "INFO", "logger": "payintent.request", "request_id": "order-42.attempt-1",
        "message": request_line["message"], "method": "POST", "route": "/api/v1/x402/intents", "status": 201,
        "duration_ms": None,
    }  # fmt: skip
    assert request_line["message"].startswith("POST /api/v1/x402/intents 201 ")
    assert isinstance(request_line["duration_ms"], float) and request_line["duration_ms"] >= 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", request_line["ts"])

    headers_line = next(line for line in logged if line["logger"] == API_LOGGER.name)
    assert headers_line["request_id"] == "careless-1"  # a line logged inside the view carries the id too
    message = headers_line["message"]
    assert "Authorization': '[redacted]'" in message
    assert '"webhook_secret": "[redacted]"' in message and "c2VjcmV0" not in message
    assert '"password": "[redacted]"' in message and "hunter2" not in message
    # Nothing of the key past its listed prefix, on any line.
    assert merchant.api_key not in captured
    assert merchant.api_key[: len("sk_test_") + 7] not in captured


@pytest.mark.parametrize("given", ["", "has space", "x" * 129, 'with"quote', "-leading-dash", "ünïcode", "a;b"])
def test_an_unsafe_request_id_is_replaced_by_a_fresh_one(json_logs, capsys, given):
    capsys.readouterr()
    response = json_logs.test_client().get("/nope", headers={"X-Request-Id": given})
    assert response.status_code == 404
    fresh = response.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", fresh)
    (line,) = [line for line in lines(capsys.readouterr().err) if line["logger"] == "payintent.request"]
    assert line["request_id"] == fresh and line["route"] == "unmatched" and line["status"] == 404


def test_each_request_gets_its_own_id(json_logs):
    client = json_logs.test_client()
    ids = {client.get("/healthz").headers["X-Request-Id"] for _ in range(5)}
    assert len(ids) == 5


def test_probe_requests_are_logged_at_debug_only(json_logs, capsys):
    capsys.readouterr()
    client = json_logs.test_client()
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 404  # an error is logged even on a probe route
    logged = [line for line in lines(capsys.readouterr().err) if line["logger"] == "payintent.request"]
    assert [(line["route"], line["status"]) for line in logged] == [("/metrics", 404)]


def test_text_format_is_one_readable_line_with_the_request_id(app, capsys):
    configure_logging("INFO", "text")
    try:
        capsys.readouterr()
        app.test_client().get("/nope?x=1", headers={"X-Request-Id": "readable-1"})
        logging.getLogger("backend.somewhere").warning("outside a request")
    finally:
        configure_logging("WARNING", "json")
    out = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\S+ \S+ INFO payintent\.request \[readable-1\] GET unmatched 404 \d+\.\d ms", out[-2])
    assert re.fullmatch(r"\S+ \S+ WARNING backend\.somewhere \[-\] outside a request", out[-1])


def test_a_traceback_is_one_json_line_with_secrets_redacted(app, capsys):
    configure_logging("INFO", "json")
    try:
        capsys.readouterr()
        try:
            raise RuntimeError("could not use sk_test_abcdefSECRETSECRETSECRET")
        except RuntimeError:
            logging.getLogger("backend.x").exception("failed with Authorization: Bearer sk_test_zzzzzzSECRET")
    finally:
        configure_logging("WARNING", "json")
    (line,) = lines(capsys.readouterr().err)
    assert line["level"] == "ERROR" and line["request_id"] is None
    assert "RuntimeError: could not use sk_test_abcdef…" in line["exc"]
    assert "SECRET" not in json.dumps(line)


def test_redaction_keeps_what_is_useful_and_drops_what_is_secret():
    tx_hash = "0x" + "ab" * 32
    cases = {
        "key sk_test_AbC123xyzXYZ0123456789abcdefghijklmnop used": "key sk_test_AbC123… used",
        "sk_live_Q1w2E3r4T5y6U7i8O9p0": "sk_live_Q1w2E3…",
        "secret whsec_dGhpcyBpcyBzZWNyZXQ= rotated": "secret whsec_[redacted] rotated",
        "Authorization: Bearer abc.def-ghi": "Authorization: [redacted]",
        "{'Authorization': 'Basic dXNlcjpwYXNz', 'Accept': '*/*'}": "{'Authorization': '[redacted]', 'Accept': '*/*'}",
        "token Bearer abcdef": "token Bearer [redacted]",
        'login {"email": "a@b.c", "password": "pw1"}': 'login {"email": "a@b.c", "password": "[redacted]"}',
        "SECRET_KEY=dev-key webhook_secret: abc": "SECRET_KEY=[redacted] webhook_secret: [redacted]",
        "private_key=0x" + "11" * 32: "private_key=[redacted]",
        "postgresql://payintent:s3cr3t@db:5432/payintent": "postgresql://payintent:[redacted]@db:5432/payintent",
        "redis://:pw@redis:6379/0": "redis://:[redacted]@redis:6379/0",
        # Useful, not secret: ids, hashes, addresses, URLs without credentials.
        f"settlement stl_123 sent {tx_hash}": f"settlement stl_123 sent {tx_hash}",
        "http://127.0.0.1:8545 key_0123 mer_abc 0x70997970C51812dc3A010C7d01b50e0d17dc79C8": (
            "http://127.0.0.1:8545 key_0123 mer_abc 0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
        ),
    }
    for given, expected in cases.items():
        assert redact(given) == expected, given
        assert redact(expected) == expected  # redacting twice changes nothing


def test_registered_secrets_are_never_written_wherever_they_appear(capsys):
    relay = Account.create()
    solana_relay = Keypair()
    register_secret(relay.key.hex(), str(solana_relay))
    register_rpc_urls(["https://base-sepolia.g.example.com/v2/PROVIDERKEY0123456789?x=1"])
    configure_logging("INFO", "json")
    try:
        capsys.readouterr()
        log = logging.getLogger("relayer.test")
        log.info("loaded 0x%s and %s", relay.key.hex(), solana_relay)
        log.warning(
            "HTTPSConnectionPool(host='base-sepolia.g.example.com', port=443): Max retries exceeded with url: "
            "/v2/PROVIDERKEY0123456789?x=1 (RPC https://base-sepolia.g.example.com/v2/PROVIDERKEY0123456789?x=1)"
        )
    finally:
        configure_logging("WARNING", "json")
    captured = capsys.readouterr().err
    assert relay.key.hex() not in captured and str(solana_relay) not in captured
    assert "PROVIDERKEY" not in captured
    assert captured.count("[redacted]") == 4
    assert "base-sepolia.g.example.com" in captured  # the host alone stays: it says which RPC failed
