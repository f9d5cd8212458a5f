"""A merchant sees and changes only its own data: another merchant's ids are 404, and nothing moves."""

from __future__ import annotations

from sqlalchemy import select

from backend.extensions import db
from backend.merchants.models import ApiKey
from backend.webhooks import services as webhooks
from backend.webhooks.models import WebhookDelivery, WebhookEndpoint
from tests.dashboard.helpers import intent_ids, log_in, post, text
from tests.intents.helpers import create


def test_another_merchants_pages_and_actions_are_404(client, app, merchant, other_merchant):
    intent = create(client, other_merchant, order_id="theirs")
    endpoint, secret = webhooks.create_endpoint(
        other_merchant.id, "https://hooks.example/theirs", ["payment.completed"]
    )
    delivery_id, _ = webhooks.send_test_event(other_merchant.id, endpoint.id, "payment.completed")
    mine = create(client, merchant, order_id="mine")

    assert log_in(client, "shop@example.com").status_code == 302
    for path in [
        f"/dashboard/intents/{intent['intent_id']}",
        f"/dashboard/webhooks/{endpoint.id}",
        f"/dashboard/webhooks/{endpoint.id}/rotate",
        f"/dashboard/webhooks/{endpoint.id}/delete",
        f"/dashboard/webhooks/{endpoint.id}/deliveries/{delivery_id}",
        f"/dashboard/keys/{other_merchant.key_id}/revoke",
    ]:
        response = client.get(path)
        assert response.status_code == 404, path
        assert "Page not found" in text(response)
    for path, data in [
        (f"/dashboard/keys/{other_merchant.key_id}/revoke", {}),
        (f"/dashboard/webhooks/{endpoint.id}/rotate", {}),
        (f"/dashboard/webhooks/{endpoint.id}/delete", {}),
        (f"/dashboard/webhooks/{endpoint.id}/test", {"event": "payment.completed"}),
        (f"/dashboard/webhooks/{endpoint.id}/deliveries/{delivery_id}/replay", {}),
    ]:
        assert post(client, path, data).status_code == 404, path

    db.session.expire_all()
    assert db.session.get(ApiKey, other_merchant.key_id).revoked_at is None
    assert client.get("/api/v1/x402/intents", headers=other_merchant.headers).status_code == 200
    theirs = db.session.get(WebhookEndpoint, endpoint.id)
    assert theirs.deleted_at is None and theirs.secret == secret
    assert db.session.scalar(select(WebhookDelivery.id).where(WebhookDelivery.id != delivery_id)) is None

    # Lists show only our own.
    assert intent_ids(text(client.get("/dashboard/intents"))) == [mine["intent_id"]]
    assert intent_ids(text(client.get("/dashboard/intents?order_id=theirs"))) == []
    assert "hooks.example/theirs" not in text(client.get("/dashboard/webhooks"))
    other_prefix = db.session.get(ApiKey, other_merchant.key_id).display_prefix
    assert other_prefix not in text(client.get("/dashboard/keys"))


def test_a_delivery_is_only_reachable_under_its_own_endpoint(dashboard, merchant):
    first, _ = webhooks.create_endpoint(merchant.id, "https://hooks.example/a", ["payment.completed"])
    second, _ = webhooks.create_endpoint(merchant.id, "https://hooks.example/b", ["payment.completed"])
    delivery_id, _ = webhooks.send_test_event(merchant.id, first.id, "payment.completed")
    assert dashboard.get(f"/dashboard/webhooks/{first.id}/deliveries/{delivery_id}").status_code == 200
    assert dashboard.get(f"/dashboard/webhooks/{second.id}/deliveries/{delivery_id}").status_code == 404
    assert post(dashboard, f"/dashboard/webhooks/{second.id}/deliveries/{delivery_id}/replay").status_code == 404
    assert len(list(db.session.scalars(select(WebhookDelivery.id)))) == 1


def test_pages_need_a_login(client, merchant):
    for path in ["/dashboard/", "/dashboard/keys", "/dashboard/wallets", "/dashboard/webhooks", "/dashboard/intents"]:
        response = client.get(path)
        assert response.status_code == 302 and response.headers["Location"].startswith("/dashboard/login"), path
