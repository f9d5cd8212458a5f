"""Webhook endpoints, test events, the delivery log and replay through the dashboard."""

from __future__ import annotations

import json
import re

import pytest
from sqlalchemy import func, select

from backend.events.services import EVENT_TYPES
from backend.extensions import db
from backend.webhooks.models import WebhookDelivery, WebhookEndpoint
from payintent.webhooks import verify_signature
from tests.dashboard.helpers import post, revealed_secret, text
from tests.webhooks.helpers import deliver
from tests.webhooks.receiver import Receiver, start_receiver


@pytest.fixture
def receiver():
    running = start_receiver()
    yield running
    running.close()


def _create(dashboard, url: str, events: list[str] | None = None) -> tuple[str, str]:
    """Add an endpoint; returns (webhook id, the secret shown once)."""
    response = post(dashboard, "/dashboard/webhooks", {"url": url, "events": events or ["payment.completed"]})
    assert response.status_code == 302, text(response)
    webhook_id = response.headers["Location"].rsplit("/", 1)[1]
    secret = revealed_secret(text(dashboard.get(response.headers["Location"])))
    assert secret is not None
    return webhook_id, secret


def _deliveries(webhook_id: str) -> list[WebhookDelivery]:
    db.session.expire_all()
    query = (
        select(WebhookDelivery).where(WebhookDelivery.endpoint_id == webhook_id).order_by(WebhookDelivery.created_at)
    )
    return list(db.session.scalars(query))


def test_create_shows_the_secret_once_and_it_signs_deliveries(dashboard, receiver: Receiver):
    webhook_id, secret = _create(dashboard, receiver.url("/ok"), ["payment.completed", "fraud.flagged"])
    assert secret.startswith("whsec_")
    endpoint = db.session.get(WebhookEndpoint, webhook_id)
    assert endpoint.events == ["payment.completed", "fraud.flagged"]
    page = text(dashboard.get(f"/dashboard/webhooks/{webhook_id}"))
    assert revealed_secret(page) is None and secret not in page
    assert receiver.url("/ok") in text(dashboard.get("/dashboard/webhooks"))

    assert post(dashboard, f"/dashboard/webhooks/{webhook_id}/test", {"event": "fraud.flagged"}).status_code == 302
    assert deliver() == 1
    received = receiver.wait_for(1, "/ok")[0]
    assert json.loads(received.body)["event"] == "fraud.flagged"
    verify_signature(received.body, received.headers["Service-Signature"], secret)  # the secret shown is the one used


def test_test_event_creates_a_delivery_shown_in_the_log_and_replay_reuses_the_event(dashboard, receiver):
    webhook_id, _ = _create(dashboard, receiver.url("/status/500"))
    for event_type in EVENT_TYPES:  # any of them
        response = post(dashboard, f"/dashboard/webhooks/{webhook_id}/test", {"event": event_type})
        assert response.status_code == 302, event_type
    deliveries = _deliveries(webhook_id)
    assert sorted(d.event_type for d in deliveries) == sorted(EVENT_TYPES)
    assert all(d.event_id.startswith("evt_test_") for d in deliveries)

    assert deliver() == len(EVENT_TYPES)  # every one fails once: the receiver answers 500
    page = text(dashboard.get(f"/dashboard/webhooks/{webhook_id}"))
    newest = _deliveries(webhook_id)[-1]
    assert all(d.id in page for d in _deliveries(webhook_id)[-10:])  # the first page: the ten newest
    assert page.count("Replay<span") == 10  # one Replay button per delivery on the first page
    assert "Next page" in page and f"1&ndash;10 of {len(EVENT_TYPES)}" in page
    assert '<td class="num">500</td>' in page  # attempts: status code
    assert re.search(r'<td class="num">\d+ ms</td>', page)  # latency
    assert "badge-failed" in page

    failed = newest
    response = post(dashboard, f"/dashboard/webhooks/{webhook_id}/deliveries/{failed.id}/replay")
    assert response.status_code == 302
    after = _deliveries(webhook_id)
    assert len(after) == len(EVENT_TYPES) + 1
    replay = next(d for d in after if d.replay_of == failed.id)
    assert replay.event_id == failed.event_id and replay.id != failed.id and replay.status == "pending"
    assert f"Event {failed.event_id} queued again as delivery {replay.id}" in text(
        dashboard.get(f"/dashboard/webhooks/{webhook_id}")
    )

    detail = dashboard.get(f"/dashboard/webhooks/{webhook_id}/deliveries/{failed.id}")
    assert detail.status_code == 200
    body = text(detail)
    assert failed.event_id in body and "receiver says no" in body  # the response body of the attempt
    assert "Replay this delivery" in body

    page2 = text(dashboard.get(f"/dashboard/webhooks/{webhook_id}?page=2"))
    assert "Page 2 of 2" in page2
    assert dashboard.get(f"/dashboard/webhooks/{webhook_id}?page=0").status_code == 400


def test_successful_delivery_shows_its_attempt(dashboard, receiver):
    webhook_id, _ = _create(dashboard, receiver.url("/ok"))
    post(dashboard, f"/dashboard/webhooks/{webhook_id}/test", {"event": "payment.completed"})
    deliver()
    page = text(dashboard.get(f"/dashboard/webhooks/{webhook_id}"))
    assert "badge-succeeded" in page and '<td class="num">200</td>' in page


def test_rotate_shows_the_new_secret_once(dashboard, receiver):
    webhook_id, first = _create(dashboard, receiver.url("/ok"))
    assert dashboard.get(f"/dashboard/webhooks/{webhook_id}/rotate").status_code == 200
    response = post(dashboard, f"/dashboard/webhooks/{webhook_id}/rotate")
    assert response.status_code == 302
    rotated = revealed_secret(text(dashboard.get(response.headers["Location"])))
    assert rotated is not None and rotated != first
    db.session.expire_all()
    assert db.session.get(WebhookEndpoint, webhook_id).secret == rotated
    assert revealed_secret(text(dashboard.get(f"/dashboard/webhooks/{webhook_id}"))) is None


def test_delete_endpoint(dashboard, receiver):
    webhook_id, _ = _create(dashboard, receiver.url("/ok"))
    post(dashboard, f"/dashboard/webhooks/{webhook_id}/test", {"event": "payment.completed"})
    confirm = dashboard.get(f"/dashboard/webhooks/{webhook_id}/delete")
    assert confirm.status_code == 200 and "Delete endpoint" in text(confirm)
    assert db.session.get(WebhookEndpoint, webhook_id).deleted_at is None  # the GET only asks
    response = post(dashboard, f"/dashboard/webhooks/{webhook_id}/delete")
    assert response.status_code == 302 and response.headers["Location"] == "/dashboard/webhooks"
    db.session.expire_all()
    assert db.session.get(WebhookEndpoint, webhook_id).deleted_at is not None
    assert [d.status for d in _deliveries(webhook_id)] == ["cancelled"]
    assert dashboard.get(f"/dashboard/webhooks/{webhook_id}").status_code == 404
    assert receiver.url("/ok") not in text(dashboard.get("/dashboard/webhooks"))


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"url": "", "events": ["payment.completed"]}, "Enter the URL"),
        ({"url": "ftp://hooks.example/x", "events": ["payment.completed"]}, "Not a valid URL."),
        ({"url": "https://hooks.example/x"}, "Choose at least one event type."),
        ({"url": "https://hooks.example/x", "events": ["payment.bogus"]}, "Must be one of"),
        ({"url": "https://user:pw@hooks.example/x", "events": ["payment.completed"]}, "must not carry credentials"),
    ],
    ids=["empty", "scheme", "no-events", "unknown-event", "credentials"],
)
def test_bad_webhook_form_is_400_and_creates_nothing(dashboard, form, message):
    response = post(dashboard, "/dashboard/webhooks", form)
    assert response.status_code == 400
    body = text(response)
    assert message.lower() in body.lower(), body[:3000]
    if form.get("url"):
        assert f'value="{form["url"]}"' in body  # kept for correcting
    assert db.session.scalar(select(WebhookEndpoint.id)) is None


def test_private_targets_are_refused_when_the_server_says_so(dashboard, app):
    settings = app.config["PAYINTENT_SETTINGS"]
    app.config["PAYINTENT_SETTINGS"] = type(settings)(**{**settings.__dict__, "webhook_allow_private_targets": False})
    try:
        response = post(
            dashboard, "/dashboard/webhooks", {"url": "http://127.0.0.1:9/x", "events": ["payment.completed"]}
        )
    finally:
        app.config["PAYINTENT_SETTINGS"] = settings
    assert response.status_code == 400
    assert "is not a public address" in text(response)
    assert db.session.scalar(select(WebhookEndpoint.id)) is None


def test_unknown_test_event_type_is_400(dashboard, receiver):
    webhook_id, _ = _create(dashboard, receiver.url("/ok"))
    response = post(dashboard, f"/dashboard/webhooks/{webhook_id}/test", {"event": "payment.bogus"})
    assert response.status_code == 400 and "Choose one of the event types." in text(response)
    assert _deliveries(webhook_id) == []


def test_endpoint_limit_is_a_message_not_an_error(dashboard, merchant):
    from backend.webhooks.services import MAX_ENDPOINTS_PER_MERCHANT, create_endpoint

    for n in range(MAX_ENDPOINTS_PER_MERCHANT):
        create_endpoint(merchant.id, f"https://hooks.example/{n}", ["payment.completed"])
    assert "the most an account can have" in text(dashboard.get("/dashboard/webhooks"))
    response = post(
        dashboard, "/dashboard/webhooks", {"url": "https://hooks.example/x", "events": ["payment.completed"]}
    )
    assert response.status_code == 409
    assert "at most 16 webhook endpoints" in text(response)
    count = db.session.scalar(select(func.count()).select_from(WebhookEndpoint))
    assert count == MAX_ENDPOINTS_PER_MERCHANT
