"""The webhooks API: registration, list/read/delete/rotate, test events, delivery logs; errors and scoping."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest

from backend.events.services import EVENT_TYPES
from tests.test_openapi import check, spec  # noqa: F401  (fixture)
from tests.webhooks.helpers import URL, attempts, deliver, delivery, register, send_test

# The key fields of the spec's event table, per type (and of payment.duplicate, ours).
KEY_FIELDS = {
    "payment.completed": {"intent_id", "status", "amount_usdc", "order_id", "tx_hash", "buyer_address", "chain",
                          "paid_at"},
    "payment.failed": {"intent_id", "reason", "order_id"},
    "payment.expired": {"intent_id", "order_id", "expired_at"},
    "invoice.paid": {"invoice_id", "amount_usdc", "paid_at"},
    "invoice.overdue": {"invoice_id", "amount_usdc", "due_date"},
    "refund.issued": {"refund_id", "amount_usdc", "tx_hash"},
    "bridge.completed": {"bridge_id", "from_chain", "to_chain", "amount_usdc", "tx_hash"},
    "transfer.completed": {"transfer_id", "to_address", "amount_usdc", "tx_hash"},
    "payroll.batch_completed": {"batch_id", "total_usdc", "recipient_count"},
    "fraud.flagged": {"transaction_id", "risk_score", "reason"},
    "payment.duplicate": {"intent_id", "order_id", "amount_usdc", "tx_hash", "buyer_address", "chain",
                          "settlement_id", "paid_tx_hash", "detected_at"},
}  # fmt: skip


def test_register_returns_a_secret_once(client, merchant, spec):  # noqa: F811
    response = client.post(
        URL, json={"url": "https://shop.example/hooks", "events": ["payment.completed", "payment.failed"]},
        headers=merchant.headers,
    )  # fmt: skip
    assert response.status_code == 201
    check(spec, URL, "post", response)
    data = response.get_json()["data"]
    assert set(data) == {"webhook_id", "url", "events", "secret", "created_at"}
    assert data["secret"].startswith("whsec_")
    assert len(base64.b64decode(data["secret"].removeprefix("whsec_"))) == 32
    assert data["events"] == ["payment.completed", "payment.failed"]
    assert data["created_at"].endswith("Z")

    read = client.get(f"{URL}/{data['webhook_id']}", headers=merchant.headers)
    assert read.status_code == 200
    check(spec, f"{URL}/{{webhook_id}}", "get", read)
    assert "secret" not in read.get_json()["data"]
    assert data["secret"] not in read.get_data(as_text=True)
    listed = client.get(URL, headers=merchant.headers)
    check(spec, URL, "get", listed)
    page = listed.get_json()["data"]
    assert page["total"] == 1 and page["webhooks"][0]["webhook_id"] == data["webhook_id"]
    assert data["secret"] not in listed.get_data(as_text=True)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://shop.example/x", "events": ["payment.completed"]}, "url"),
        ({"url": "not a url", "events": ["payment.completed"]}, "url"),
        ({"url": "https://shop.example/x", "events": ["payment.refunded"]}, "events"),
        ({"url": "https://shop.example/x", "events": []}, "events"),
        ({"url": "https://shop.example/x"}, "events"),
        ({"events": ["payment.completed"]}, "url"),
        ({"url": "https://u:p@shop.example/x", "events": ["payment.completed"]}, "url"),
        # marshmallow's URL check passes these; urllib cannot read them (it raised a 500 before: found by schemathesis)
        ({"url": "hTtps://[d:2]/", "events": ["payment.completed"]}, "url"),
        ({"url": "https://shop.example:65536/x", "events": ["payment.completed"]}, "url"),
        ({"url": "https://shop.example/x", "events": ["payment.completed"], "secret": "mine"}, "secret"),
    ],
)
def test_bad_registrations_are_400_and_write_nothing(client, merchant, spec, body, field):  # noqa: F811
    response = client.post(URL, json=body, headers=merchant.headers)
    assert response.status_code == 400, response.data
    check(spec, URL, "post", response)
    error = response.get_json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    assert field in error["fields"]
    assert client.get(URL, headers=merchant.headers).get_json()["data"]["total"] == 0


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9000/x", "http://localhost/x", "http://10.1.2.3/x", "http://169.254.169.254/latest/meta-data",
     "http://[::1]/x", "http://0.0.0.0/x", "http://100.64.0.1/x", "http://192.168.1.10/x"],
)  # fmt: skip
def test_private_targets_are_refused_unless_allowed(app, client, merchant, url):
    settings = app.config["PAYINTENT_SETTINGS"]
    app.config["PAYINTENT_SETTINGS"] = settings.__class__(
        **{**settings.__dict__, "webhook_allow_private_targets": False}
    )
    response = client.post(URL, json={"url": url, "events": ["payment.completed"]}, headers=merchant.headers)
    assert response.status_code == 400
    assert "url" in response.get_json()["error"]["fields"]
    app.config["PAYINTENT_SETTINGS"] = settings  # make run and the tests allow them
    assert (
        client.post(URL, json={"url": url, "events": ["payment.completed"]}, headers=merchant.headers).status_code
        == 201
    )


def test_delete_stops_deliveries_and_keeps_the_log(client, merchant, receiver, clock, spec):  # noqa: F811
    endpoint = register(client, merchant, receiver.url("/status/500"))
    queued = send_test(client, merchant, endpoint["webhook_id"])
    deliver()
    response = client.delete(f"{URL}/{endpoint['webhook_id']}", headers=merchant.headers)
    assert response.status_code == 200
    check(spec, f"{URL}/{{webhook_id}}", "delete", response)
    assert response.get_json()["data"] == {"webhook_id": endpoint["webhook_id"], "deleted": True}
    assert client.get(f"{URL}/{endpoint['webhook_id']}", headers=merchant.headers).status_code == 404
    assert client.delete(f"{URL}/{endpoint['webhook_id']}", headers=merchant.headers).status_code == 404
    clock.advance(hours=3)
    assert deliver() == 0
    assert delivery(queued["delivery_id"]).status == "cancelled"
    assert len(receiver.requests) == 1
    log = client.get(f"{URL}/deliveries/{queued['delivery_id']}", headers=merchant.headers)
    assert log.status_code == 200 and len(log.get_json()["data"]["attempts"]) == 1
    replay = client.post(f"{URL}/deliveries/{queued['delivery_id']}/replay", headers=merchant.headers)
    assert replay.status_code == 409 and replay.get_json()["error"]["code"] == "WEBHOOK_DELETED"
    assert client.post(
        f"{URL}/test", json={"webhook_id": endpoint["webhook_id"], "event": "payment.completed"},
        headers=merchant.headers,
    ).status_code == 404  # fmt: skip


def test_rotation_signs_the_next_attempts_with_the_new_secret(client, merchant, receiver, clock, spec):  # noqa: F811
    endpoint = register(client, merchant, receiver.url("/status/500"))
    send_test(client, merchant, endpoint["webhook_id"])
    deliver()
    response = client.post(f"{URL}/{endpoint['webhook_id']}/rotate-secret", headers=merchant.headers)
    assert response.status_code == 200
    check(spec, f"{URL}/{{webhook_id}}/rotate-secret", "post", response)
    new_secret = response.get_json()["data"]["secret"]
    assert new_secret.startswith("whsec_") and new_secret != endpoint["secret"]
    clock.advance(minutes=1)
    deliver()  # the retry
    first, second = receiver.requests
    assert first.body == second.body
    assert (
        first.headers["Service-Signature"]
        == "sha256=" + hmac.new(endpoint["secret"].encode(), first.body, hashlib.sha256).hexdigest()
    )
    assert (
        second.headers["Service-Signature"]
        == "sha256=" + hmac.new(new_secret.encode(), second.body, hashlib.sha256).hexdigest()
    )


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_test_event_of_every_type_carries_its_key_fields(client, merchant, receiver, spec, event_type):  # noqa: F811
    endpoint = register(client, merchant, receiver.url(), ["payment.completed"])  # tests go regardless
    response = client.post(
        f"{URL}/test", json={"webhook_id": endpoint["webhook_id"], "event": event_type}, headers=merchant.headers
    )
    assert response.status_code == 202
    check(spec, f"{URL}/test", "post", response)
    queued = response.get_json()["data"]
    assert queued["event"] == event_type and queued["status"] == "pending"
    assert queued["event_id"].startswith("evt_test_")
    deliver()
    (got,) = receiver.requests
    envelope = json.loads(got.body)
    assert envelope["event"] == event_type and envelope["id"] == queued["event_id"]
    assert set(envelope["data"]) >= KEY_FIELDS[event_type]
    assert not any(k.endswith("_usdc") and isinstance(v, str) for k, v in envelope["data"].items())


def test_test_event_errors_are_clear(client, merchant, other_merchant, receiver):
    endpoint = register(client, merchant, receiver.url())
    unknown_type = client.post(
        f"{URL}/test", json={"webhook_id": endpoint["webhook_id"], "event": "payment.refunded"},
        headers=merchant.headers,
    )  # fmt: skip
    assert unknown_type.status_code == 400
    assert "event" in unknown_type.get_json()["error"]["fields"]
    for webhook_id in ("we_nope", endpoint["webhook_id"]):
        headers = merchant.headers if webhook_id == "we_nope" else other_merchant.headers
        missing = client.post(f"{URL}/test", json={"webhook_id": webhook_id, "event": "payment.completed"},
                              headers=headers)  # fmt: skip
        assert missing.status_code == 404
        assert missing.get_json()["error"]["code"] == "NOT_FOUND"
    assert receiver.requests == []


def test_delivery_log_lists_and_filters(client, merchant, other_merchant, receiver, clock, spec):  # noqa: F811
    ok_hook = register(client, merchant, receiver.url())
    bad_hook = register(client, merchant, receiver.url("/status/500"))
    first = send_test(client, merchant, ok_hook["webhook_id"])
    second = send_test(client, merchant, bad_hook["webhook_id"], "payment.failed")
    deliver()
    listed = client.get(f"{URL}/deliveries", headers=merchant.headers)
    assert listed.status_code == 200
    check(spec, f"{URL}/deliveries", "get", listed)
    page = listed.get_json()["data"]
    assert page["total"] == 2
    by_endpoint = client.get(f"{URL}/deliveries?webhook_id={bad_hook['webhook_id']}", headers=merchant.headers)
    (only,) = by_endpoint.get_json()["data"]["deliveries"]
    assert only["delivery_id"] == second["delivery_id"]
    assert (only["status"], only["attempt_count"], only["last_status_code"]) == ("pending", 1, 500)
    assert only["next_attempt_at"] is not None
    by_event = client.get(f"{URL}/deliveries?event_id={first['event_id']}", headers=merchant.headers)
    assert [d["delivery_id"] for d in by_event.get_json()["data"]["deliveries"]] == [first["delivery_id"]]
    failed = client.get(f"{URL}/deliveries?status=succeeded", headers=merchant.headers).get_json()["data"]
    assert [d["delivery_id"] for d in failed["deliveries"]] == [first["delivery_id"]]

    detail = client.get(f"{URL}/deliveries/{second['delivery_id']}", headers=merchant.headers)
    check(spec, f"{URL}/deliveries/{{delivery_id}}", "get", detail)
    data = detail.get_json()["data"]
    assert data["payload"]["id"] == second["event_id"]
    (attempt,) = data["attempts"]
    assert attempt["number"] == 1 and attempt["status_code"] == 500 and attempt["succeeded"] is False
    assert attempt["response_body"] == "receiver says no" and attempt["latency_ms"] >= 0
    assert len(attempts(second["delivery_id"])) == 1

    # Another merchant sees none of it.
    assert client.get(f"{URL}/deliveries", headers=other_merchant.headers).get_json()["data"]["total"] == 0
    for path in (f"deliveries/{second['delivery_id']}", f"{bad_hook['webhook_id']}"):
        assert client.get(f"{URL}/{path}", headers=other_merchant.headers).status_code == 404
    assert (
        client.post(f"{URL}/deliveries/{second['delivery_id']}/replay", headers=other_merchant.headers).status_code
        == 404
    )
    assert client.get(f"{URL}/deliveries?status=lost", headers=merchant.headers).status_code == 400


def test_endpoints_need_a_key(client):
    assert client.get(URL).status_code == 401
    assert client.post(URL, json={"url": "https://x.example", "events": ["payment.completed"]}).status_code == 401


def test_nul_characters_are_refused_before_any_query(client, merchant):
    for path in (f"{URL}/we_%00x", f"{URL}/deliveries/whd_%00", f"{URL}/deliveries?webhook_id=we_%00",
                 "/api/v1/x402/intents?order_id=a%00b"):  # fmt: skip
        response = client.get(path, headers=merchant.headers)
        assert response.status_code == 400, path
        assert response.get_json()["error"]["code"] == "INVALID_REQUEST"
    for body in ({"url": "http://example.com/a\u0000b", "events": ["payment.completed"]},
                 {"url": "http://example.com/", "events": ["payment.completed\u0000"]}):  # fmt: skip
        response = client.post(URL, json=body, headers=merchant.headers)
        assert response.status_code == 400
        assert response.get_json()["error"]["code"] == "INVALID_JSON"
    response = client.post("/api/v1/x402/intents", json={"amount_usdc": 1, "order_id": "a\u0000"},
                           headers=merchant.headers)  # fmt: skip
    assert response.status_code == 400
    assert client.get(URL, headers=merchant.headers).get_json()["data"]["total"] == 0


def test_an_unusable_port_is_refused_at_registration(client, merchant):
    response = client.post(URL, json={"url": "http://example.com:99999/", "events": ["payment.completed"]},
                           headers=merchant.headers)  # fmt: skip
    assert response.status_code == 400
    assert "url" in response.get_json()["error"]["fields"]


def test_test_events_and_replays_cannot_pile_up_a_backlog(client, merchant, receiver, clock, spec, monkeypatch):  # noqa: F811
    from backend.webhooks import services

    monkeypatch.setattr(services, "MAX_PENDING_ON_DEMAND_PER_ENDPOINT", 3)
    endpoint = register(client, merchant, receiver.url("/status/500"))
    queued = [send_test(client, merchant, endpoint["webhook_id"]) for _ in range(3)]
    body = {"webhook_id": endpoint["webhook_id"], "event": "payment.completed"}
    refused = client.post(f"{URL}/test", json=body, headers=merchant.headers)
    assert refused.status_code == 409
    check(spec, f"{URL}/test", "post", refused)
    assert refused.get_json()["error"]["code"] == "TOO_MANY_PENDING_DELIVERIES"
    replay = client.post(f"{URL}/deliveries/{queued[0]['delivery_id']}/replay", headers=merchant.headers)
    assert replay.status_code == 409 and replay.get_json()["error"]["code"] == "TOO_MANY_PENDING_DELIVERIES"
    check(spec, f"{URL}/deliveries/{{delivery_id}}/replay", "post", replay)
    # Another endpoint is not held back, and once the backlog is worked off, more are accepted.
    other = register(client, merchant, receiver.url("/ok"))
    send_test(client, merchant, other["webhook_id"])
    for _ in range(5):
        deliver()
        clock.advance(hours=3)
    assert {delivery(q["delivery_id"]).status for q in queued} == {"failed"}
    send_test(client, merchant, endpoint["webhook_id"])
    again = client.post(f"{URL}/deliveries/{queued[0]['delivery_id']}/replay", headers=merchant.headers)
    assert again.status_code == 202
