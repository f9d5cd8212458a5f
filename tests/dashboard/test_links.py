"""Payment links through the dashboard: create (checked by the API's schema), list, deactivate, tenancy."""

from __future__ import annotations

from backend.paymentlinks.models import PaymentLink
from tests.conftest import create_merchant
from tests.dashboard.helpers import log_in, post, text


def _links() -> list[PaymentLink]:
    return PaymentLink.query.order_by(PaymentLink.created_at).all()


def test_a_link_is_created_listed_and_deactivated(dashboard):
    page = dashboard.get("/dashboard/links")
    assert page.status_code == 200 and "No payment links yet" in text(page)
    created = post(dashboard, "/dashboard/links", {"amount_usdc": "12.50", "description": "Mug", "redirect_url": ""})
    assert created.status_code == 302
    (link,) = _links()
    assert (link.amount_atomic, link.description, link.redirect_url, link.active) == (12_500_000, "Mug", None, True)
    listed = text(dashboard.get("/dashboard/links"))
    assert f"/l/{link.id}" in listed and "12.5 USDC" in listed and "Payment link created" in listed
    done = post(dashboard, f"/dashboard/links/{link.id}/deactivate")
    assert done.status_code == 302
    listed = text(dashboard.get("/dashboard/links"))
    assert "deactivated" in listed and "makes no more intents" in listed
    assert _links()[0].active is False


def test_bad_links_are_explained_and_nothing_is_written(dashboard):
    cases = [
        ({"amount_usdc": "", "description": "Mug"}, "Enter an amount in USDC"),
        ({"amount_usdc": "1.2345678", "description": "Mug"}, "Enter an amount in USDC"),
        ({"amount_usdc": "-1", "description": "Mug"}, "Enter an amount in USDC"),
        ({"amount_usdc": "0", "description": "Mug"}, "Must be greater than 0"),
        ({"amount_usdc": "2000000", "description": "Mug"}, "Must be at most"),
        ({"amount_usdc": "1", "description": ""}, "Enter what the buyer pays for"),
        ({"amount_usdc": "1", "description": "Mug", "redirect_url": "javascript:alert(1)"}, "Not a valid URL"),
    ]
    for form, message in cases:
        answer = post(dashboard, "/dashboard/links", form)
        assert answer.status_code == 400, form
        assert message in text(answer), (form, text(answer)[:2000])
    assert _links() == []


def test_another_merchants_link_cannot_be_deactivated(app, client, dashboard):
    post(dashboard, "/dashboard/links", {"amount_usdc": "3", "description": "Mine"})
    (link,) = _links()
    post(dashboard, "/dashboard/logout")
    create_merchant(app, "other@example.com")
    log_in(client, "other@example.com")
    answer = post(client, f"/dashboard/links/{link.id}/deactivate")
    assert answer.status_code == 404
    assert "Mine" not in text(client.get("/dashboard/links"))
    assert _links()[0].active is True
