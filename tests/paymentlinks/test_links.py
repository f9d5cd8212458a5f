"""Payment links: the API (create, read, list, deactivate) and the public visit that makes an intent."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from backend.intents.models import Intent
from backend.merchants import services as merchants
from backend.paymentlinks import pages, services
from tests.conftest import CHECKOUT_HOST

URL = "/api/v1/payment_links"
INTENTS = "/api/v1/x402/intents"


def create_link(client: Any, merchant: Any, **body: Any) -> dict[str, Any]:
    body.setdefault("amount_usdc", 12.5)
    body.setdefault("description", "Sticker pack")
    response = client.post(URL, json=body, headers=merchant.headers)
    assert response.status_code == 201, response.data
    return response.get_json()["data"]


def visit(client: Any, link: dict[str, Any], **kwargs: Any) -> Any:
    path = link["url"].removeprefix(CHECKOUT_HOST)
    return client.get(path, **kwargs)


def test_a_link_is_created_read_and_listed(client, merchant):
    link = create_link(client, merchant, redirect_url="https://shop.example/thanks")
    assert link["link_id"].startswith("pl_")
    assert link["url"] == f"{CHECKOUT_HOST}/l/{link['link_id']}"
    assert (link["amount_usdc"], link["description"], link["active"]) == (12.5, "Sticker pack", True)
    assert link["redirect_url"] == "https://shop.example/thanks" and link["deactivated_at"] is None
    read = client.get(f"{URL}/{link['link_id']}", headers=merchant.headers)
    assert read.status_code == 200 and read.get_json()["data"] == link
    second = client.post(
        URL,
        data='{"amount_usdc": 0.000001, "description": "Tiny"}',
        content_type="application/json",
        headers=merchant.headers,
    ).get_json()["data"]
    page = client.get(URL, headers=merchant.headers).get_json()["data"]
    assert [item["link_id"] for item in page["payment_links"]] == [second["link_id"], link["link_id"]]
    assert page["total"] == 2 and Decimal(str(page["payment_links"][0]["amount_usdc"])) == Decimal("0.000001")


def test_each_visit_makes_a_fresh_intent_and_redirects_to_its_checkout(client, merchant):
    link = create_link(client, merchant, redirect_url="https://shop.example/thanks")
    first, second = visit(client, link), visit(client, link)
    assert first.status_code == second.status_code == 303
    assert first.headers["Cache-Control"] == "no-store"  # a cached redirect would send buyers to one intent
    assert all("/pay/" in r.headers["Location"] for r in (first, second))
    ids = [r.headers["Location"].rsplit("/pay/", 1)[1] for r in (first, second)]
    assert ids[0] != ids[1]
    for intent_id in ids:
        intent = client.get(f"{INTENTS}/{intent_id}", headers=merchant.headers).get_json()["data"]
        assert intent["status"] == "pending" and intent["amount_usdc"] == 12.5
        assert intent["description"] == "Sticker pack" and intent["redirect_url"] == "https://shop.example/thanks"
        assert intent["payment_link_id"] == link["link_id"]
        assert {r["maxAmountRequired"] for r in intent["payment_requirements"]} == {"12500000"}
    # An intent made through the API names no link.
    made = client.post(INTENTS, json={"amount_usdc": 1}, headers=merchant.headers).get_json()["data"]
    assert made["payment_link_id"] is None


def test_a_deactivated_link_answers_a_page_and_makes_no_intent(client, merchant):
    link = create_link(client, merchant)
    done = client.post(f"{URL}/{link['link_id']}/deactivate", headers=merchant.headers)
    assert done.status_code == 200
    data = done.get_json()["data"]
    assert data["active"] is False and data["deactivated_at"] is not None
    again = client.post(f"{URL}/{link['link_id']}/deactivate", headers=merchant.headers).get_json()["data"]
    assert again == data  # idempotent: the first deactivation's time stays
    before = Intent.query.count()
    page = visit(client, link)
    assert page.status_code == 410 and page.mimetype == "text/html"
    assert b"no longer active" in page.data and b"Traceback" not in page.data
    assert Intent.query.count() == before
    listed = client.get(f"{URL}?active=false", headers=merchant.headers).get_json()["data"]
    assert [item["link_id"] for item in listed["payment_links"]] == [link["link_id"]]
    assert client.get(f"{URL}?active=true", headers=merchant.headers).get_json()["data"]["total"] == 0


def test_unknown_links_are_a_plain_404_page(client):
    for path in ("/l/pl_" + "0" * 32, "/l/nonsense", "/l/%3Cscript%3E"):
        page = client.get(path)
        assert page.status_code == 404 and page.mimetype == "text/html", path
        assert b"<script>" not in page.data


@pytest.mark.parametrize(
    "headers",
    [
        {"User-Agent": "Slackbot-LinkExpanding 1.0 (+https://api.slack.com/robots)"},
        {"User-Agent": "facebookexternalhit/1.1"},
        {"User-Agent": "Mozilla/5.0 (compatible; Googlebot/2.1)"},
        {"User-Agent": "Mozilla/5.0 Chrome/120", "Sec-Fetch-Dest": "image", "Sec-Fetch-Site": "cross-site"},
        {"User-Agent": "Mozilla/5.0 Chrome/120", "Sec-Fetch-Dest": "iframe", "Sec-Fetch-Site": "cross-site"},
    ],
)
def test_previews_crawlers_and_embedded_requests_get_the_links_page_and_make_no_intent(client, merchant, headers):
    link = create_link(client, merchant)
    before = Intent.query.count()
    page = visit(client, link, headers=headers)
    assert page.status_code == 200 and page.mimetype == "text/html"
    assert b"Sticker pack" in page.data and b"12.5 USDC" in page.data and b"Continue to payment" in page.data
    assert client.head(link["url"].removeprefix(CHECKOUT_HOST), headers=headers).status_code == 200
    assert Intent.query.count() == before


def test_a_browser_opening_the_link_from_another_site_gets_an_intent(client, merchant):
    """A link clicked in an e-mail or a chat: a cross-site top-level navigation, the link's purpose."""
    link = create_link(client, merchant)
    headers = {"User-Agent": "Mozilla/5.0 Firefox/128", "Sec-Fetch-Dest": "document", "Sec-Fetch-Site": "cross-site"}
    assert visit(client, link, headers=headers).status_code == 303


def test_the_links_page_button_makes_the_intent_but_a_cross_site_post_does_not(client, merchant):
    link = create_link(client, merchant)
    path = link["url"].removeprefix(CHECKOUT_HOST)
    before = Intent.query.count()
    for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Origin": "https://evil.example"}):
        refused = client.post(path, headers=headers)
        assert refused.status_code == 403 and refused.mimetype == "text/html", headers
    assert Intent.query.count() == before
    made = client.post(path, headers={"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost"})
    assert made.status_code == 303 and "/pay/" in made.headers["Location"]
    assert Intent.query.count() == before + 1


def test_a_link_has_at_most_so_many_intents_pending(client, merchant, monkeypatch):
    link = create_link(client, merchant)
    monkeypatch.setattr(services, "PENDING_PER_LINK", 2)
    assert [visit(client, link).status_code for _ in range(3)] == [303, 303, 429]
    busy = visit(client, link)
    assert busy.mimetype == "text/html" and busy.headers["Retry-After"] == "60"
    assert Intent.query.filter_by(payment_link_id=link["link_id"]).count() == 2


def test_a_deactivation_during_a_visit_wins(client, merchant, monkeypatch):
    """The link is deactivated (and committed) between the visit's check and its INSERT: the intent is cancelled at
    once and the visitor gets the deactivated page."""
    link = create_link(client, merchant)
    real = services.intents.new_intent

    def deactivated_meanwhile(*args, **kwargs):
        services.deactivate_link(merchant.id, link["link_id"])
        return real(*args, **kwargs)

    monkeypatch.setattr(services.intents, "new_intent", deactivated_meanwhile)
    page = visit(client, link)
    assert page.status_code == 410
    (intent,) = Intent.query.filter_by(payment_link_id=link["link_id"]).all()
    assert intent.status == "cancelled"


def test_a_link_over_a_lowered_maximum_makes_no_intent(client, merchant, monkeypatch):
    import dataclasses

    from backend import appstate

    link = create_link(client, merchant)
    lowered = dataclasses.replace(appstate.settings(), max_amount_usdc=Decimal(10))
    monkeypatch.setattr(pages.appstate, "settings", lambda: lowered)
    page = visit(client, link)
    assert page.status_code == 409 and b"cannot take payments" in page.data
    assert Intent.query.filter_by(payment_link_id=link["link_id"]).count() == 0


def test_visits_from_one_ipv6_site_share_a_limit(client, merchant, monkeypatch):
    link = create_link(client, merchant)
    monkeypatch.setattr(services, "VISITS_PER_MINUTE", 2)
    path = link["url"].removeprefix(CHECKOUT_HOST)
    codes = [client.get(path, environ_base={"REMOTE_ADDR": f"2001:db8:1:{n:x}::1"}).status_code for n in range(1, 5)]
    assert codes == [303, 303, 429, 429]  # four /64s of one /48
    assert client.get(path, environ_base={"REMOTE_ADDR": "2001:db8:2::1"}).status_code == 303


def test_a_database_failure_is_a_page_too(client, merchant, monkeypatch):
    from sqlalchemy.exc import OperationalError

    link = create_link(client, merchant)

    def down(*args, **kwargs):
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(services, "visit", down)
    page = visit(client, link)
    assert page.status_code == 503 and page.mimetype == "text/html" and page.headers["Retry-After"] == "5"
    assert b"connection refused" not in page.data


def test_another_merchants_link_is_not_found_through_the_api(client, merchant, other_merchant):
    link = create_link(client, merchant)
    for method, path in (("get", f"{URL}/{link['link_id']}"), ("post", f"{URL}/{link['link_id']}/deactivate")):
        answer = getattr(client, method)(path, headers=other_merchant.headers)
        assert answer.status_code == 404 and answer.get_json()["error"]["code"] == "NOT_FOUND"
    assert client.get(URL, headers=other_merchant.headers).get_json()["data"]["total"] == 0
    assert client.get(f"{URL}/{link['link_id']}", headers=merchant.headers).get_json()["data"]["active"] is True


@pytest.mark.parametrize(
    "body",
    [
        {"amount_usdc": 0, "description": "x"},
        {"amount_usdc": -1, "description": "x"},
        {"amount_usdc": "1.0000001", "description": "x"},
        {"amount_usdc": 1.5},
        {"amount_usdc": 1, "description": ""},
        {"amount_usdc": 1, "description": "   "},
        {"amount_usdc": 1, "description": "x" * 501},
        {"amount_usdc": 1, "description": "x", "redirect_url": "javascript:alert(1)"},
        {"amount_usdc": 1, "description": "x", "extra": 1},
        {"amount_usdc": 1, "description": "a\u0000b"},
    ],
)
def test_bad_links_are_refused_and_nothing_is_written(client, merchant, body):
    answer = client.post(URL, json=body, headers=merchant.headers)
    assert answer.status_code == 400, answer.data
    assert answer.get_json()["success"] is False and answer.get_json()["error"]["code"] in (
        "VALIDATION_ERROR",
        "INVALID_JSON",
    )
    assert client.get(URL, headers=merchant.headers).get_json()["data"]["total"] == 0


def test_the_api_needs_a_key(client):
    assert client.get(URL).status_code == 401
    assert client.post(URL, json={"amount_usdc": 1, "description": "x"}).status_code == 401


def test_visits_are_rate_limited_per_client_and_the_limit_makes_no_intent(client, merchant, monkeypatch):
    link = create_link(client, merchant)
    monkeypatch.setattr(services, "VISITS_PER_MINUTE", 2)
    before = Intent.query.count()
    codes = [visit(client, link).status_code for _ in range(4)]
    assert codes == [303, 303, 429, 429]
    limited = visit(client, link)
    assert limited.mimetype == "text/html" and 1 <= int(limited.headers["Retry-After"]) <= 60
    assert Intent.query.count() == before + 2


def test_a_merchant_without_wallets_gets_a_page_not_an_intent(app, client, merchant):
    link = create_link(client, merchant)
    for wallet in merchants.list_wallets(merchant.id):
        merchants.remove_wallet(merchant.id, wallet.network)
    before = Intent.query.count()
    page = visit(client, link)
    assert page.status_code == 409 and b"cannot take payments" in page.data
    assert Intent.query.count() == before
