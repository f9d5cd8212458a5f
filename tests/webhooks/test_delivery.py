"""Deliveries to a real HTTP receiver: signatures byte for byte, the retry schedule, leases, replay."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from standardwebhooks import Webhook

from backend.extensions import db
from backend.webhooks import services
from backend.webhooks.models import WebhookAttempt
from backend.webhooks.transport import SendResult
from tests.conftest import free_port
from tests.intents.helpers import create
from tests.webhooks.helpers import URL, attempts, deliver, delivery, register, send_test

SCHEDULE = [0, 60, 300, 1800, 7200]  # seconds after the previous attempt


def test_delivery_is_signed_over_the_exact_bytes_sent(client, merchant, receiver):
    endpoint = register(client, merchant, receiver.url())
    queued = send_test(client, merchant, endpoint["webhook_id"])
    assert deliver() == 1
    (got,) = receiver.wait_for(1)
    secret = endpoint["secret"]

    # The spec's header: sha256=<lowercase hex HMAC-SHA256 of the raw body, keyed with the secret>.
    independent = hmac.new(secret.encode(), got.body, hashlib.sha256).hexdigest()
    assert got.headers["Service-Signature"] == f"sha256={independent}"
    assert got.headers["Content-Type"] == "application/json"
    # Standard Webhooks: the reference verifier accepts it; id is the event id, timestamp is now.
    stamp = got.headers["webhook-timestamp"]
    assert abs(int(stamp) - time.time()) < 5
    key = base64.b64decode(secret.removeprefix("whsec_"))
    expected = base64.b64encode(hmac.new(key, f"{queued['event_id']}.{stamp}.".encode() + got.body, "sha256").digest())
    assert got.headers["webhook-signature"] == "v1," + expected.decode()
    assert Webhook(secret).verify(got.body, got.headers)["id"] == queued["event_id"]

    # The body is the stored envelope, byte for byte.
    envelope = json.loads(got.body)
    assert set(envelope) == {"id", "event", "created_at", "data"}
    assert envelope["id"] == queued["event_id"] == got.headers["webhook-id"]
    stored = db.session.execute(db.text("SELECT payload FROM events WHERE id = :id"), {"id": envelope["id"]}).scalar()
    assert stored.encode() == got.body
    # A re-serialised body no longer matches.
    reserialised = json.dumps(envelope).encode()
    assert hmac.new(secret.encode(), reserialised, hashlib.sha256).hexdigest() != independent
    row = delivery(queued["delivery_id"])
    assert (row.status, row.attempt_count, row.last_status_code) == ("succeeded", 1, 200)


@pytest.mark.parametrize("behaviour", ["down", "500", "302", "slow"])
def test_failing_receiver_is_retried_on_the_exact_schedule_then_failed(
    client, merchant, receiver, clock, app, behaviour
):
    url = {
        "down": f"http://127.0.0.1:{free_port()}/hook",
        "500": receiver.url("/status/500"),
        "302": receiver.url("/status/302"),
        "slow": receiver.url("/slow/1.5"),
    }[behaviour]
    app.config["PAYINTENT_SETTINGS"] = app.config["PAYINTENT_SETTINGS"].__class__(
        **{**app.config["PAYINTENT_SETTINGS"].__dict__, "webhook_timeout_seconds": 1.0}
    )
    endpoint = register(client, merchant, url)
    queued = send_test(client, merchant, endpoint["webhook_id"])
    start = clock.current
    expected_times = []
    elapsed = 0
    for n, gap in enumerate(SCHEDULE, start=1):
        elapsed += gap
        if gap:
            clock.advance(seconds=gap - 1)
            assert deliver(deadline=1.0) == 0, f"attempt {n} went out before it was due"
            clock.advance(seconds=1)
        assert deliver(deadline=1.0) == 1, f"attempt {n} was not sent when due"
        expected_times.append(start + timedelta(seconds=elapsed))
    clock.advance(days=2)
    assert deliver(deadline=1.0) == 0  # never a sixth attempt

    row = delivery(queued["delivery_id"])
    assert (row.status, row.attempt_count, row.next_attempt_at) == ("failed", 5, None)
    tries = attempts(queued["delivery_id"])
    assert [a.number for a in tries] == [1, 2, 3, 4, 5]
    assert [a.attempted_at for a in tries] == expected_times
    assert not any(a.succeeded for a in tries)
    if behaviour == "down":
        assert all(a.status_code is None and a.error.startswith("connection failed") for a in tries)
    elif behaviour == "slow":
        assert all(a.error.startswith("timeout") for a in tries)
        assert all(a.latency_ms >= 1000 for a in tries)
    else:
        assert all(a.status_code == int(behaviour) for a in tries)
        assert receiver.on("/ok") == []  # the redirect was not followed
        assert tries[0].response_body == "receiver says no"
    if behaviour != "down":
        # The same event id and the same bytes on every attempt.
        got = receiver.on(url.split(str(receiver.server.server_address[1]))[1])
        assert len(got) == 5
        assert {r.headers["webhook-id"] for r in got} == {queued["event_id"]}
        assert len({r.body for r in got}) == 1


def test_a_receiver_answering_after_ten_seconds_is_a_failure(client, merchant, receiver, clock):
    endpoint = register(client, merchant, receiver.url("/slow/10.6"))
    queued = send_test(client, merchant, endpoint["webhook_id"])
    assert deliver() == 1  # the real 10 s deadline of the spec
    (attempt,) = attempts(queued["delivery_id"])
    assert not attempt.succeeded
    assert attempt.error.startswith("timeout")
    assert 10_000 <= attempt.latency_ms < 10_600
    assert delivery(queued["delivery_id"]).next_attempt_at == clock.current + timedelta(minutes=1)


def test_success_on_a_retry_ends_the_delivery(client, merchant, receiver, clock):
    endpoint = register(client, merchant, receiver.url("/status/503"))
    queued = send_test(client, merchant, endpoint["webhook_id"])
    deliver()
    # The receiver recovers: point the endpoint at a working path (same secret, same event).
    db.session.execute(
        db.text("UPDATE webhook_endpoints SET url = :u WHERE id = :id"),
        {"u": receiver.url("/ok"), "id": endpoint["webhook_id"]},
    )
    db.session.commit()
    clock.advance(minutes=1)
    assert deliver() == 1
    row = delivery(queued["delivery_id"])
    assert (row.status, row.attempt_count, row.last_status_code) == ("succeeded", 2, 200)
    clock.advance(hours=3)
    assert deliver() == 0


def test_a_failing_endpoint_holds_back_neither_other_endpoints_nor_newer_events(client, merchant, receiver, clock):
    broken = register(client, merchant, receiver.url("/status/500"), ["payment.expired"])
    healthy = register(client, merchant, receiver.url("/ok"), ["payment.expired"])
    for _ in range(3):
        create(client, merchant)
    clock.advance(minutes=31)
    from backend.intents.services import expire_overdue

    assert expire_overdue() == 3
    assert deliver() == 6
    assert len(receiver.on("/ok")) == 3
    # A newer event to the healthy endpoint goes out at once while the broken one waits for its retry.
    clock.advance(seconds=10)
    send_test(client, merchant, healthy["webhook_id"], "payment.expired")
    assert deliver() == 1
    assert len(receiver.on("/ok")) == 4
    assert len(receiver.on("/status/500")) == 3
    pages = client.get(f"{URL}/deliveries?webhook_id={broken['webhook_id']}", headers=merchant.headers).get_json()
    assert {d["status"] for d in pages["data"]["deliveries"]} == {"pending"}
    assert healthy["webhook_id"] != broken["webhook_id"]


def test_deliveries_go_only_to_subscribed_live_endpoints(client, merchant, other_merchant, receiver, clock):
    register(client, merchant, receiver.url("/ok"), ["payment.completed"])  # not subscribed to expired
    expired_hook = register(client, merchant, receiver.url("/status/200"), ["payment.expired", "payment.failed"])
    register(client, other_merchant, receiver.url("/status/201"), ["payment.expired"])  # someone else's
    create(client, merchant)
    clock.advance(minutes=31)
    from backend.intents.services import expire_overdue

    expire_overdue()
    assert deliver() == 1
    (got,) = receiver.requests
    assert got.path == "/status/200"
    envelope = json.loads(got.body)
    assert envelope["event"] == "payment.expired"
    assert set(envelope["data"]) >= {"intent_id", "order_id", "expired_at"}
    assert expired_hook["webhook_id"]


def test_a_crashed_workers_delivery_is_sent_again_after_its_lease(client, merchant, receiver, clock):
    endpoint = register(client, merchant, receiver.url())
    queued = send_test(client, merchant, endpoint["webhook_id"])
    claimed = services.claim_due(clock.current)  # a worker claims it and dies before sending
    assert claimed is not None and claimed.id == queued["delivery_id"]
    assert deliver() == 0  # leased: nobody else sends it meanwhile
    clock.advance(seconds=services.LEASE_SECONDS + 1)
    assert deliver() == 1
    (got,) = receiver.wait_for(1)
    assert got.headers["webhook-id"] == queued["event_id"]
    row = delivery(queued["delivery_id"])
    assert (row.status, row.attempt_count) == ("succeeded", 1)
    # The dead worker's late report is refused: its lease is gone.
    from backend.webhooks.transport import SendResult

    assert services.record_attempt(claimed, clock.current, SendResult(True, 200, 5, None, None)) is False
    assert len(attempts(queued["delivery_id"])) == 1


def test_a_delivery_read_while_its_attempt_is_recorded_shows_the_attempt_under_its_heading_or_neither(
    app, client, merchant, receiver, clock
):
    """The delivery page's read: a worker that records the attempt (one commit) while the delivery is read shows
    both its heading and its attempts as before the commit, or both as after; never a succeeded attempt under a
    heading that says "pending, 0 attempts"."""
    endpoint = register(client, merchant, receiver.url())
    queued = send_test(client, merchant, endpoint["webhook_id"])
    claimed = services.claim_due(clock.current)
    assert claimed is not None

    def record() -> None:
        with app.app_context():
            assert services.record_attempt(claimed, clock.current, SendResult(True, 200, 5, None, None))
            db.session.remove()

    recorded: list[str] = []

    def after_execute(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if not recorded and "FROM webhook_deliveries" in statement:  # the delivery's row was read: the worker commits
            recorded.append(statement)
            worker = threading.Thread(target=record)
            worker.start()
            worker.join(10)

    sa.event.listen(db.engine, "after_cursor_execute", after_execute)
    try:
        shown = services.get_delivery(merchant.id, queued["delivery_id"])
    finally:
        sa.event.remove(db.engine, "after_cursor_execute", after_execute)
    assert recorded and len(attempts(queued["delivery_id"])) == 1  # the worker committed during the read
    assert shown["attempt_count"] == len(shown["attempts"])
    assert (shown["status"], shown["attempt_count"]) in {("pending", 0), ("succeeded", 1)}


def test_replay_sends_the_same_event_again(client, merchant, receiver, clock):
    endpoint = register(client, merchant, receiver.url("/status/500"))
    queued = send_test(client, merchant, endpoint["webhook_id"])
    for gap in SCHEDULE:
        clock.advance(seconds=gap)
        deliver()
    assert delivery(queued["delivery_id"]).status == "failed"
    db.session.execute(
        db.text("UPDATE webhook_endpoints SET url = :u WHERE id = :id"),
        {"u": receiver.url("/ok"), "id": endpoint["webhook_id"]},
    )
    db.session.commit()
    response = client.post(f"{URL}/deliveries/{queued['delivery_id']}/replay", headers=merchant.headers)
    assert response.status_code == 202
    replay = response.get_json()["data"]
    assert replay["event_id"] == queued["event_id"]
    assert replay["delivery_id"] != queued["delivery_id"]
    assert replay["status"] == "pending"
    assert deliver() == 1
    (got,) = receiver.on("/ok")
    assert got.headers["webhook-id"] == queued["event_id"]
    assert got.body == receiver.on("/status/500")[0].body
    detail = client.get(f"{URL}/deliveries/{replay['delivery_id']}", headers=merchant.headers).get_json()["data"]
    assert detail["status"] == "succeeded"
    assert detail["replay_of"] == queued["delivery_id"]
    assert [a["status_code"] for a in detail["attempts"]] == [200]


def test_two_workers_never_send_the_same_attempt_twice(app, client, merchant, receiver, clock):
    endpoint = register(client, merchant, receiver.url())
    queued = [send_test(client, merchant, endpoint["webhook_id"])["event_id"] for _ in range(60)]
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with app.app_context():
                deliver()
                db.session.remove()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    ids = [r.headers["webhook-id"] for r in receiver.requests]
    assert sorted(ids) == sorted(queued)  # each event exactly once
    db.session.expire_all()
    assert db.session.query(WebhookAttempt).count() == 60


def test_private_targets_are_refused_at_delivery_time(client, merchant, receiver, clock, app):
    settings = app.config["PAYINTENT_SETTINGS"]
    endpoint = register(client, merchant, receiver.url())
    queued = send_test(client, merchant, endpoint["webhook_id"])
    # The name resolves to loopback at delivery time (as a rebinding DNS answer would).
    db.session.execute(
        db.text("UPDATE webhook_endpoints SET url = :u WHERE id = :id"),
        {"u": receiver.url().replace("127.0.0.1", "localhost"), "id": endpoint["webhook_id"]},
    )
    db.session.commit()
    assert settings.webhook_allow_private_targets
    assert services.deliver_due(allow_private=False) == 1
    (attempt,) = attempts(queued["delivery_id"])
    assert attempt.error.startswith("refused:") and "not a public address" in attempt.error
    assert receiver.requests == []


def test_secrets_never_reach_the_logs(client, merchant, receiver, clock, caplog):
    caplog.set_level(logging.DEBUG)
    endpoint = register(client, merchant, receiver.url("/status/500"))
    rotated = client.post(f"{URL}/{endpoint['webhook_id']}/rotate-secret", headers=merchant.headers).get_json()
    send_test(client, merchant, endpoint["webhook_id"])
    deliver()
    assert caplog.records  # the delivery was logged
    for secret in (endpoint["secret"], rotated["data"]["secret"]):
        assert secret not in caplog.text
        assert secret.removeprefix("whsec_") not in caplog.text


def test_a_slow_endpoint_cannot_take_every_sender(client, merchant, receiver, clock):
    slow = register(client, merchant, receiver.url("/status/500"))
    other = register(client, merchant, receiver.url("/ok"))
    for _ in range(services.MAX_IN_FLIGHT_PER_ENDPOINT + 3):
        send_test(client, merchant, slow["webhook_id"])
    clock.advance(seconds=1)
    newer = send_test(client, merchant, other["webhook_id"])
    cap = services.MAX_IN_FLIGHT_PER_ENDPOINT + 4  # a merchant cap that lets the endpoint cap show
    first = services.claim_due(clock.current, cap)
    second = services.claim_due(clock.current, cap)
    assert first is not None and first.url == slow["url"]  # the oldest
    assert second is not None and second.id == newer["delivery_id"]  # then the merchant's idle endpoint
    held = [services.claim_due(clock.current, cap) for _ in range(services.MAX_IN_FLIGHT_PER_ENDPOINT - 1)]
    assert all(c is not None and c.url == slow["url"] for c in held)  # four senders on the slow endpoint
    assert services.claim_due(clock.current, cap) is None  # and no more, though three more are due


def test_claims_serve_the_merchant_with_the_fewest_attempts_in_flight(client, merchant, other_merchant, clock):
    busy = register(client, merchant, "http://127.0.0.1:9/busy")
    for _ in range(10):
        send_test(client, merchant, busy["webhook_id"])
    clock.advance(seconds=30)  # the other merchant's event is much newer than the backlog
    quiet = register(client, other_merchant, "http://127.0.0.1:9/quiet")
    newer = send_test(client, other_merchant, quiet["webhook_id"])
    claims = [services.claim_due(clock.current, 2) for _ in range(4)]
    owners = [c.merchant_id if c else None for c in claims]
    # Both idle: the oldest; then the merchant with nothing in flight; then the busy one up to its cap.
    assert owners == [merchant.id, other_merchant.id, merchant.id, None]
    assert claims[1].id == newer["delivery_id"]
    services.record_attempt(claims[0], clock.current, SendResult(False, 500, 3, "HTTP 500", None))
    assert services.claim_due(clock.current, 2).merchant_id == merchant.id  # a slot freed: served again


def test_receiver_text_that_a_database_refuses_still_records_the_attempt(client, merchant, receiver, clock):
    from backend.webhooks.transport import SendResult

    endpoint = register(client, merchant, receiver.url())
    queued = send_test(client, merchant, endpoint["webhook_id"])
    claimed = services.claim_due(clock.current)
    odd = SendResult(False, 500, 3, "x" * 900 + "\x00", "binary\x00answer")
    assert services.record_attempt(claimed, clock.current, odd) is True
    (attempt,) = attempts(queued["delivery_id"])
    assert len(attempt.error) == 500 and "\x00" not in attempt.error
    assert attempt.response_body == "binary\ufffdanswer"
    assert delivery(queued["delivery_id"]).attempt_count == 1


def test_an_endpoint_deleted_mid_attempt_logs_the_attempt_and_stays_cancelled(client, merchant, receiver, clock):
    from backend.webhooks.transport import SendResult

    endpoint = register(client, merchant, receiver.url())
    queued = send_test(client, merchant, endpoint["webhook_id"])
    claimed = services.claim_due(clock.current)
    assert client.delete(f"{URL}/{endpoint['webhook_id']}", headers=merchant.headers).status_code == 200
    assert services.record_attempt(claimed, clock.current, SendResult(False, 500, 3, "HTTP 500", None)) is True
    row = delivery(queued["delivery_id"])
    assert (row.status, row.attempt_count, row.next_attempt_at) == ("cancelled", 1, None)
    assert len(attempts(queued["delivery_id"])) == 1


def test_deliveries_of_a_deleted_endpoint_are_never_sent(client, merchant, receiver, clock):
    endpoint = register(client, merchant, receiver.url())
    send_test(client, merchant, endpoint["webhook_id"])
    # As if the delete committed between an event's fan-out and its commit: the delivery stayed pending.
    db.session.execute(
        db.text("UPDATE webhook_endpoints SET deleted_at = created_at WHERE id = :id"), {"id": endpoint["webhook_id"]}
    )
    db.session.commit()
    assert deliver() == 0
    assert receiver.requests == []
